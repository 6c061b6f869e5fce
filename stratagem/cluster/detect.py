"""resolve(): pick the resolver that the environment of this process calls for.

The order, first match wins:

1. ``TF_CONFIG`` describes a cluster -> :class:`TFConfigClusterResolver`;
2. ``RANK`` or ``WORLD_SIZE`` is set (torchrun, or Kubeflow's PyTorchJob) ->
   :class:`TorchrunClusterResolver` (only one of them set is an error it reports, not a reason
   to run alone);
3. a task of a Slurm job step (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set: started by
   ``srun``) -> :class:`SlurmClusterResolver`;
4. ``JOB_COMPLETION_INDEX`` is set (a pod of a Kubernetes Indexed Job or JobSet) ->
   :class:`KubernetesClusterResolver`; torchrun's ``PET_*`` arguments without ``RANK`` (a
   PyTorchJob or TrainJob whose container should run torchrun) are refused before, unless
   ``STRATAGEM_JOBS`` says the pod is a stratagem task;
5. otherwise a lone local task: ``SimpleClusterResolver(ClusterSpec())``.

A Slurm batch script (``sbatch``) or ``salloc`` shell is no job step: it runs once, whatever
the job's task count, so a script started there without srun trains alone -- with a
RuntimeWarning when the job has several tasks, saying to start it with srun. TF_CONFIG and
torchrun's variables come before Slurm's: a launcher that sets them inside an srun task
(``srun stratagem launch ...``, ``srun torchrun ...``) describes its own processes.

When both TF_CONFIG and torchrun's variables are set, TF_CONFIG wins: it is the more
complete description (every task's address), and a launcher that sets it means it. If the
two disagree on this task's rank or on the number of workers, a RuntimeWarning says so,
since one of them is then stale (inherited from a parent process, typically).

Example::

    >>> from stratagem.cluster import resolve
    >>> resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
    ...          "MASTER_PORT": "29500"}).worker_rank
    1
    >>> resolve({}).num_workers       # nothing set: a lone local task
    1
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from stratagem.cluster.kubernetes import KubernetesClusterResolver
from stratagem.cluster.pytorchjob import refuse_torchrun_arguments
from stratagem.cluster.resolver import ClusterResolver, SimpleClusterResolver
from stratagem.cluster.slurm import SlurmClusterResolver, in_slurm_step
from stratagem.cluster.spec import ClusterSpec
from stratagem.cluster.tf_config import TFConfigClusterResolver
from stratagem.cluster.torchrun import TorchrunClusterResolver

__all__ = ["resolve"]


def _warn_if_torchrun_disagrees(resolver: TFConfigClusterResolver,
                                env: Mapping[str, str]) -> None:
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return
    if (rank, world_size) != (resolver.worker_rank, resolver.num_workers):
        warnings.warn(
            f"TF_CONFIG and torchrun's variables disagree: TF_CONFIG makes this task rank "
            f"{resolver.worker_rank} of {resolver.num_workers} workers, RANK={rank} and "
            f"WORLD_SIZE={world_size} say rank {rank} of {world_size}. Using TF_CONFIG; unset "
            "the stale one.", RuntimeWarning, stacklevel=3)


def _warn_if_outside_srun(env: Mapping[str, str]) -> None:
    tasks = env.get("SLURM_NTASKS", "")
    if "SLURM_JOB_ID" in env and tasks.strip().isdigit() and int(tasks) > 1:
        warnings.warn(
            f"this process runs in Slurm job {env['SLURM_JOB_ID']} of {int(tasks)} tasks, but not "
            "as one of them (it is the batch script or an salloc shell, not started by srun): it "
            f"trains alone, as one worker. Start it with `srun python ...` to run {int(tasks)} "
            "workers.", RuntimeWarning, stacklevel=3)


def resolve(environment: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for this process: TF_CONFIG, else torchrun, else Slurm, else Kubernetes, else alone.

    ``environment`` replaces ``os.environ``, for tests.
    """
    env = os.environ if environment is None else environment
    resolver = TFConfigClusterResolver(environment=env)
    if resolver.cluster_spec():
        _warn_if_torchrun_disagrees(resolver, env)
        return resolver
    if "RANK" in env or "WORLD_SIZE" in env:
        return TorchrunClusterResolver(environment=env)
    if in_slurm_step(env):
        return SlurmClusterResolver(environment=env)
    if "STRATAGEM_JOBS" not in env:
        refuse_torchrun_arguments(env)
    if "JOB_COMPLETION_INDEX" in env:
        return KubernetesClusterResolver(environment=env)
    _warn_if_outside_srun(env)
    return SimpleClusterResolver(ClusterSpec())
