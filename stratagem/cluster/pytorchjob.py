"""What Kubeflow's PyTorchJob and TrainJob set in a pod, and when it cannot be read as it is.

A PyTorchJob with a Master replica sets, in every pod, torchrun's variables for one process
per pod -- ``MASTER_ADDR`` (the master pod's Service, ``<job>-master-0``), ``MASTER_PORT``,
``WORLD_SIZE`` and ``RANK`` (the master 0, worker ``i`` ``i + 1``) -- and the same facts as
torchrun's own arguments, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NNODES`` (pods),
``PET_NODE_RANK`` and ``PET_NPROC_PER_NODE`` (``nprocPerNode``, ``"auto"`` by default).
A process started straight from the container's command reads the first four like torchrun's
(:class:`~stratagem.cluster.TorchrunClusterResolver`), and so does every process torchrun
starts from the ``PET_*`` ones (``command: ["torchrun", "train.py"]``).

Two environments cannot be read by a process the container started directly, and are refused
with the fix instead of training with the wrong ranks:

- ``nprocPerNode`` above 1 without torchrun: the operator counts ``WORLD_SIZE`` in processes
  (pods × nprocPerNode) but ``RANK`` in pods, so the ranks would not add up;
- ``PET_*`` without ``RANK`` and ``WORLD_SIZE`` (an ``elasticPolicy``, a PyTorchJob without a
  Master replica, a Kubeflow Trainer TrainJob): they are torchrun's arguments and name no
  process's rank at all.

Example::

    >>> from stratagem.cluster.pytorchjob import check_operator_variables
    >>> master = {"MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "8",
    ...           "RANK": "0", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "0", "PET_NNODES": "2"}
    >>> check_operator_variables(master, rank=0, world_size=8)
    Traceback (most recent call last):
    ...
    stratagem.errors.ClusterConfigError: PyTorchJob variables: PET_NPROC_PER_NODE=4 asks for 4 ...
"""

from __future__ import annotations

from collections.abc import Mapping

from stratagem.errors import ClusterConfigError

__all__ = ["PYTORCHJOB_VARIABLES", "check_operator_variables", "refuse_torchrun_arguments"]

#: The variables Kubeflow's training operator sets in a PyTorchJob's pods (besides
#: ``PYTHONUNBUFFERED``): torchrun's four, and torchrun's arguments as ``PET_*``.
PYTORCHJOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_MASTER_ADDR",
                        "PET_MASTER_PORT", "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE",
                        "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID", "PET_RDZV_CONF",
                        "PET_MAX_RESTARTS", "PET_STANDALONE")

_TORCHRUN = ('start the training script with torchrun in the container\'s command (command: '
             '["torchrun", "train.py"]): torchrun reads the PET_* variables and gives each process '
             "its RANK and WORLD_SIZE")


def _started_by_torchrun(env: Mapping[str, str]) -> bool:
    # torchrun (torch.distributed.run, and torch.distributed.launch through it) sets it in
    # every process it starts; the operator never does.
    return "TORCHELASTIC_RUN_ID" in env


def _integer(text: str | None) -> int | None:
    try:
        return None if text is None else int(text.strip())
    except ValueError:
        return None   # "auto", "cpu", "gpu", or a "min:max" range of nodes


def check_operator_variables(env: Mapping[str, str], *, rank: int, world_size: int) -> None:
    """Raises ClusterConfigError when ``RANK`` and ``WORLD_SIZE`` come from a PyTorchJob whose
    values a process not started by torchrun cannot use: ``PET_NPROC_PER_NODE`` above 1, or
    ``PET_NNODES`` / ``PET_NODE_RANK`` that disagree with them (one of them stale)."""
    if _started_by_torchrun(env) or "PET_NPROC_PER_NODE" not in env:
        return
    text = env["PET_NPROC_PER_NODE"]
    nproc = _integer(text)
    if nproc is not None and nproc > 1:
        raise ClusterConfigError(
            f"PyTorchJob variables: PET_NPROC_PER_NODE={text} asks for {nproc} processes in each "
            f"pod, so the operator set WORLD_SIZE={world_size} (pods x {nproc}) while RANK={rank} "
            f"is this pod's rank, not a process's; this process was not started by torchrun, so "
            f"the ranks would not add up. Either {_TORCHRUN}, or set nprocPerNode: \"1\" in the "
            "PyTorchJob spec.")
    nnodes = _integer(env.get("PET_NNODES"))
    if nnodes is not None and nnodes != world_size:
        raise ClusterConfigError(
            f"PyTorchJob variables: WORLD_SIZE={world_size} but PET_NNODES={nnodes} pods of one "
            f"process each (PET_NPROC_PER_NODE={text}); the operator sets both alike, so one of "
            "them is stale (set by hand in the pod template, or inherited): remove it.")
    node_rank = _integer(env.get("PET_NODE_RANK"))
    if node_rank is not None and node_rank != rank:
        raise ClusterConfigError(
            f"PyTorchJob variables: RANK={rank} but PET_NODE_RANK={node_rank}; the operator sets "
            "both to the pod's rank, so one of them is stale (set by hand in the pod template, "
            "or inherited): remove it.")


def refuse_torchrun_arguments(env: Mapping[str, str]) -> None:
    """Raises ClusterConfigError when torchrun's ``PET_*`` arguments are set but neither
    ``RANK`` nor ``WORLD_SIZE`` is, outside torchrun: a container that should run torchrun."""
    arguments = sorted(name for name in env if name.startswith("PET_"))
    if not arguments or "RANK" in env or "WORLD_SIZE" in env or _started_by_torchrun(env):
        return
    raise ClusterConfigError(
        f"{', '.join(arguments)} {'is' if len(arguments) == 1 else 'are'} set but RANK and "
        "WORLD_SIZE are not: these are torchrun's arguments, which Kubeflow's PyTorchJob (with an "
        "elasticPolicy, or without a Master replica) and TrainJob set for a container that runs "
        f"torchrun, and they give no process its rank. {_TORCHRUN[0].upper()}{_TORCHRUN[1:]}.")
