"""SlurmClusterResolver: the cluster of a Slurm job step, read from the variables srun sets.

``srun --ntasks=4 python train.py`` starts four tasks; each finds its place from Slurm's
variables: its rank ``SLURM_PROCID`` among ``SLURM_STEP_NUM_TASKS`` tasks, the step's nodes
``SLURM_STEP_NODELIST`` (``node[01-04,07]``, see :mod:`stratagem.cluster.nodelist`) and how many
tasks run on each, ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``); outside a step the job's
variables (``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``) stand in. From
them it builds TensorFlow's cluster:

- every task gets the address ``NODE:PORT``, ``PORT = port_base + its index on its node``
  (0, 1, ... in rank order on that node), so the tasks of one node never share a port;
- the ranks go to the jobs in the order of their names (as in TensorFlow, which sorts them:
  ``{"worker": 2, "ps": 1}`` makes rank 0 the ps and ranks 1 and 2 the workers, and a
  ``"chief"`` is always rank 0); by default every task is a worker;
- with GPUs and ``auto_set_gpu``, a task's ``CUDA_VISIBLE_DEVICES`` becomes its share of its
  node's GPUs: ``gpus_per_task`` of them, the task's index on the node picking which.

``sg.MultiWorkerMirroredStrategy()`` and ``sg.ParameterServerStrategy()`` use it by
themselves inside a job step (see :func:`stratagem.cluster.resolve`); the environment can then
set what the arguments would: ``STRATAGEM_SLURM_JOBS`` the jobs (``chief=1,worker=2,ps=1``), and
``STRATAGEM_SLURM_PORT_BASE`` the first port. The step must have exactly the tasks the jobs
need: more or fewer is refused when the resolver is made, before any training starts.

Example::

    >>> from stratagem.cluster import SlurmClusterResolver
    >>> env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3",
    ...        "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    >>> resolver = SlurmClusterResolver(jobs={"worker": 2, "ps": 1}, environment=env)
    >>> resolver.cluster_spec().as_dict()
    {'ps': ['node07:8888'], 'worker': ['node07:8889', 'node08:8888']}
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 1, 'grpc://node08:8888')
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from stratagem.cluster.nodelist import expand_nodelist, expand_tasks_per_node, place_tasks
from stratagem.cluster.resolver import COLLECTIVE_JOBS, ClusterResolver, check_task
from stratagem.cluster.spec import ClusterSpec
from stratagem.cluster.tf_config import TASK_TYPES
from stratagem.errors import ClusterConfigError

__all__ = ["DEFAULT_PORT_BASE", "JOBS_VARIABLE", "PORT_BASE_VARIABLE", "SlurmClusterResolver",
           "in_slurm_step", "parse_jobs"]

DEFAULT_PORT_BASE = 8888   # TensorFlow's
JOBS_VARIABLE = "STRATAGEM_SLURM_JOBS"
PORT_BASE_VARIABLE = "STRATAGEM_SLURM_PORT_BASE"
# The node's GPU list as it was before a resolver narrowed CUDA_VISIBLE_DEVICES to one task's
# share: a second resolver in the same process then picks from the same list.
_NODE_GPUS = "STRATAGEM_SLURM_NODE_GPUS"


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (started by ``srun``).

    A batch script (``sbatch``) or an ``salloc`` shell is not one: it has ``SLURM_PROCID`` but
    no ``SLURM_STEP_ID``, and runs once whatever the job's task count; only srun starts the
    tasks that form the cluster.
    """
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def parse_jobs(text: str, source: str = JOBS_VARIABLE) -> dict[str, int]:
    """``"chief=1,worker=2,ps=1"`` as ``{"chief": 1, "worker": 2, "ps": 1}``."""
    jobs: dict[str, int] = {}
    for item in text.split(","):
        name, equals, count = (part.strip() for part in item.partition("="))
        if not equals or not name or not count.isdigit():
            raise ClusterConfigError(
                f"{source}={text!r}: {item.strip()!r} is not 'job=count'; write the jobs like "
                "'chief=1,worker=2,ps=1'.")
        if name in jobs:
            raise ClusterConfigError(f"{source}={text!r} names job {name!r} twice.")
        jobs[name] = int(count)
    return jobs


def _read_int(env: Mapping[str, str], names: tuple[str, ...], minimum: int) -> int | None:
    for name in names:
        if name in env:
            text = env[name]
            try:
                value = int(text.strip())
            except ValueError:
                raise ClusterConfigError(f"Slurm variable {name}={text!r} is not an integer; "
                                         "it is set by srun, check what overwrote it.") from None
            if value < minimum:
                raise ClusterConfigError(f"Slurm variable {name}={value} must be >= {minimum}.")
            return value
    return None


def _require(value: object, names: tuple[str, ...]) -> None:
    if value is None:
        raise ClusterConfigError(
            f"SlurmClusterResolver: {' / '.join(names)} is not set: this process is not a task of "
            "a Slurm job step. Start it with srun (inside sbatch or salloc), e.g. "
            "`srun --ntasks=2 python train.py`.")


def _check_jobs(jobs: object) -> dict[str, int]:
    if not isinstance(jobs, Mapping) or not jobs:
        raise ClusterConfigError(
            f"SlurmClusterResolver: jobs must be a dict from job name to task count, like "
            f"{{'worker': 2, 'ps': 1}}; got {jobs!r}.")
    for name, count in jobs.items():
        if name not in TASK_TYPES:
            raise ClusterConfigError(
                f"SlurmClusterResolver: unknown job {name!r}; the jobs of a training cluster are "
                f"{', '.join(repr(t) for t in TASK_TYPES)}.")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ClusterConfigError(
                f"SlurmClusterResolver: job {name!r} has task count {count!r}; give an integer >= 0.")
    if not any(jobs.get(job) for job in COLLECTIVE_JOBS):
        raise ClusterConfigError(
            f"SlurmClusterResolver: jobs {dict(jobs)} have no chief or worker task; a training "
            "cluster needs at least one (add 'worker': N).")
    return {name: jobs[name] for name in sorted(jobs)}   # TensorFlow's order: by name


def _count_nvidia_gpus() -> int:
    """The GPUs of this node, counted without touching CUDA (it reads CUDA_VISIBLE_DEVICES only
    once, when it starts, and this resolver may be about to set it)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        listing = subprocess.run([tool, "--list-gpus"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def _node_gpus(env: Mapping[str, str], gpus_per_node: int | None) -> list[str]:
    """The names (CUDA_VISIBLE_DEVICES entries) of this node's GPUs for the step."""
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 0):
        raise ClusterConfigError(f"SlurmClusterResolver: gpus_per_node={gpus_per_node!r}; give an "
                                 "integer >= 0.")
    listed = env.get(_NODE_GPUS, env.get("CUDA_VISIBLE_DEVICES"))
    if listed is None:
        count = _count_nvidia_gpus() if gpus_per_node is None else gpus_per_node
        return [str(i) for i in range(count)]
    gpus = [entry.strip() for entry in listed.split(",") if entry.strip()]
    if gpus_per_node is not None:
        if gpus_per_node > len(gpus):
            raise ClusterConfigError(
                f"SlurmClusterResolver: gpus_per_node={gpus_per_node}, but this task sees "
                f"{len(gpus)} GPU{'s' * (len(gpus) != 1)} (CUDA_VISIBLE_DEVICES={listed!r}); "
                "request them from Slurm (--gpus-per-node) or lower gpus_per_node.")
        gpus = gpus[:gpus_per_node]
    return gpus


class SlurmClusterResolver(ClusterResolver):
    """A resolver for the tasks of a Slurm job step: TensorFlow's SlurmClusterResolver.

    - ``jobs``: job name -> task count, e.g. ``{"chief": 1, "worker": 2, "ps": 1}``; the ranks
      go to the jobs sorted by name. Default: ``STRATAGEM_SLURM_JOBS`` if set, else every task a
      worker. The step's task count must equal the jobs' total.
    - ``port_base``: the port of a node's first task, the next task ``port_base + 1``, ...
      Default: ``STRATAGEM_SLURM_PORT_BASE`` if set, else 8888 (TensorFlow's).
    - ``gpus_per_node``: the GPUs of each node. Default: those this task sees
      (``CUDA_VISIBLE_DEVICES``, set by Slurm when the job has GPUs), else ``nvidia-smi``'s count.
    - ``gpus_per_task``: each task's share. Default: ``gpus_per_node`` divided by the largest
      number of tasks on one node -- or, where Slurm bound GPUs to each task itself
      (``--gpus-per-task``: the task sees just that many), the GPUs it sees, left as they are.
    - ``tasks_per_node``: an int (the same on every node of the node list) or a dict node ->
      count, in rank order; default Slurm's ``SLURM_STEP_TASKS_PER_NODE``.
    - ``auto_set_gpu``: set ``CUDA_VISIBLE_DEVICES`` to this task's share (when it has GPUs).
    - ``rpc_layer``: the prefix of :meth:`master`'s addresses ("grpc", as in TensorFlow).
    - ``environment`` replaces ``os.environ`` (for tests; ``CUDA_VISIBLE_DEVICES`` is written there).

    Differences from TensorFlow's: the cluster is read once, when the resolver is made (the
    variables of a step do not change), so every error comes at start-up; nodes keep Slurm's
    order (TensorFlow sorts the names, which puts ``node10`` before ``node9``); ranks are
    placed on nodes as Slurm's ``SLURM_DISTRIBUTION`` places them (block, cyclic or plane), and
    this task's own node and local index (``SLURMD_NODENAME``, ``SLURM_LOCALID``) are checked
    against that placement; a step with more tasks than the jobs use is refused too; with GPUs,
    a task's share is taken from the GPUs it sees, not from indices counted from 0 (so it stays
    inside a job's allocation on a shared node).

    Example::

        >>> from stratagem.cluster import SlurmClusterResolver
        >>> env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
        ...        "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
        >>> resolver = SlurmClusterResolver(environment=env)   # task 1 of `srun --ntasks=2`
        >>> resolver.task_type, resolver.task_id, resolver.worker_rank, resolver.chief_address
        ('worker', 1, 1, 'gpu1:8888')
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int | None = None,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str | None = "grpc", *,
                 environment: MutableMapping[str, str] | Mapping[str, str] | None = None) -> None:
        env = os.environ if environment is None else environment
        step = "SLURM_STEP_NODELIST" in env or "SLURM_STEP_NUM_TASKS" in env
        rank = _read_int(env, ("SLURM_PROCID",), minimum=0)
        _require(rank, ("SLURM_PROCID",))
        count_names = ("SLURM_STEP_NUM_TASKS",) if step else ("SLURM_NTASKS", "SLURM_NPROCS")
        num_tasks = _read_int(env, count_names, minimum=1)
        _require(num_tasks, count_names)
        assert rank is not None and num_tasks is not None
        if rank >= num_tasks:
            raise ClusterConfigError(f"Slurm variables: SLURM_PROCID={rank} is out of range for "
                                     f"{num_tasks} tasks.")
        nodes, counts = self._layout(env, step, tasks_per_node)
        if sum(counts) != num_tasks:
            raise ClusterConfigError(
                f"SlurmClusterResolver: the tasks per node ({dict(zip(nodes, counts))}) add up to "
                f"{sum(counts)}, but Slurm started {num_tasks} tasks ({count_names[0]}); "
                "leave tasks_per_node unset to read it from Slurm, or make it match.")
        self._jobs = self._resolve_jobs(jobs, env, num_tasks)
        self._port_base = self._resolve_port_base(port_base, env, max(counts))
        placement = place_tasks(nodes, counts, env.get("SLURM_DISTRIBUTION"))
        self._check_own_place(env, rank, placement[rank])
        addresses = [f"{node}:{self._port_base + local}" for node, local in placement]
        cluster: dict[str, list[str]] = {}
        task_type, task_id, start = None, None, 0
        for job, count in self._jobs.items():
            if count:
                cluster[job] = addresses[start:start + count]
            if start <= rank < start + count:
                task_type, task_id = job, rank - start
            start += count
        try:
            spec = ClusterSpec(cluster)
        except ClusterConfigError as err:
            raise ClusterConfigError(f"SlurmClusterResolver: {err}") from None
        check_task(spec, task_type, task_id, source="SlurmClusterResolver")
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer or None)
        self._spec = spec
        self._rank = rank
        self._local_rank = placement[rank][1]
        self._local_world_size = counts[nodes.index(placement[rank][0])]
        gpus = _node_gpus(env, gpus_per_node)
        if gpus_per_node is None and gpus_per_task is None and _bound_by_slurm(env, len(gpus)):
            self._gpus_per_task = len(gpus)   # Slurm gave this task its own GPUs: keep them
            return
        if gpus_per_task is None:
            gpus_per_task = len(gpus) // max(counts)
        if isinstance(gpus_per_task, bool) or not isinstance(gpus_per_task, int) or gpus_per_task < 0:
            raise ClusterConfigError(f"SlurmClusterResolver: gpus_per_task={gpus_per_task!r}; give "
                                     "an integer >= 0.")
        if max(counts) * gpus_per_task > len(gpus):
            raise ClusterConfigError(
                f"SlurmClusterResolver: {max(counts)} tasks on one node with gpus_per_task="
                f"{gpus_per_task} need {max(counts) * gpus_per_task} GPUs per node, but a node has "
                f"{len(gpus)}; lower gpus_per_task, run fewer tasks per node "
                "(--ntasks-per-node), or request more GPUs.")
        self._gpus_per_task = gpus_per_task
        if auto_set_gpu and gpus_per_task:
            mine = gpus[self._local_rank * gpus_per_task:(self._local_rank + 1) * gpus_per_task]
            _set_visible_gpus(env, gpus, mine)

    @staticmethod
    def _layout(env: Mapping[str, str], step: bool,
                tasks_per_node: int | Mapping[str, int] | None) -> tuple[list[str], list[int]]:
        """The step's nodes in rank order and each node's task count."""
        if isinstance(tasks_per_node, Mapping):
            nodes, counts = list(tasks_per_node), list(tasks_per_node.values())
            if not nodes or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
                raise ClusterConfigError(f"SlurmClusterResolver: tasks_per_node must map node names "
                                         f"to counts >= 0, got {dict(tasks_per_node)!r}.")
            return nodes, counts
        names = (("SLURM_STEP_NODELIST",) if step else ("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        text = next((env[name] for name in names if name in env), None)
        _require(text, names)
        assert text is not None
        nodes = expand_nodelist(text)
        if tasks_per_node is not None:
            if isinstance(tasks_per_node, bool) or not isinstance(tasks_per_node, int) or tasks_per_node < 1:
                raise ClusterConfigError(f"SlurmClusterResolver: tasks_per_node={tasks_per_node!r}; "
                                         "give an integer >= 1 or a dict node -> count.")
            return nodes, [tasks_per_node] * len(nodes)
        count_name = "SLURM_STEP_TASKS_PER_NODE" if step else "SLURM_TASKS_PER_NODE"
        _require(env.get(count_name), (count_name,))
        return nodes, expand_tasks_per_node(env[count_name], count_name)

    @staticmethod
    def _resolve_jobs(jobs: Mapping[str, int] | None, env: Mapping[str, str],
                      num_tasks: int) -> dict[str, int]:
        source = "jobs"
        if jobs is None and env.get(JOBS_VARIABLE, "").strip():
            jobs, source = parse_jobs(env[JOBS_VARIABLE]), JOBS_VARIABLE
        checked = _check_jobs({"worker": num_tasks} if jobs is None else jobs)
        needed = sum(checked.values())
        listing = ", ".join(f"{count} {job}" for job, count in checked.items())
        if needed > num_tasks:
            raise ClusterConfigError(
                f"the Slurm step has {num_tasks} task{'s' * (num_tasks != 1)}, but the cluster "
                f"needs {needed} ({listing}, from {source}): start it with `srun --ntasks="
                f"{needed}` (or `#SBATCH --ntasks={needed}`), or ask for fewer tasks in {source}.")
        if needed < num_tasks:
            idle = f"task {needed}" if needed == num_tasks - 1 else f"tasks {needed} to {num_tasks - 1}"
            raise ClusterConfigError(
                f"the Slurm step has {num_tasks} tasks, but the cluster uses {needed} ({listing}, "
                f"from {source}): {idle} would have no part in it. Start "
                f"it with `srun --ntasks={needed}`, or give the extra tasks a job in {source}.")
        return checked

    @staticmethod
    def _resolve_port_base(port_base: int | None, env: Mapping[str, str], most_tasks: int) -> int:
        source = "port_base"
        if port_base is None:
            text = env.get(PORT_BASE_VARIABLE, "").strip()
            if not text:
                return DEFAULT_PORT_BASE
            if not text.isdigit():
                raise ClusterConfigError(f"{PORT_BASE_VARIABLE}={text!r} is not a port number.")
            port_base, source = int(text), PORT_BASE_VARIABLE
        if isinstance(port_base, bool) or not isinstance(port_base, int) \
                or not 1 <= port_base <= 65536 - most_tasks:
            raise ClusterConfigError(
                f"SlurmClusterResolver: {source}={port_base!r}; with up to {most_tasks} task"
                f"{'s' * (most_tasks != 1)} on a node it must be 1 to {65536 - most_tasks}.")
        return port_base

    @staticmethod
    def _check_own_place(env: Mapping[str, str], rank: int, place: tuple[str, int]) -> None:
        node, local = place
        actual_node = env.get("SLURMD_NODENAME")
        actual_local = _read_int(env, ("SLURM_LOCALID",), minimum=0)
        if (actual_node is not None and actual_node != node) or \
                (actual_local is not None and actual_local != local):
            raise ClusterConfigError(
                f"Slurm placed task {rank} on node {actual_node or '?'} as its task "
                f"{actual_local if actual_local is not None else '?'}, but its distribution "
                f"({env.get('SLURM_DISTRIBUTION') or 'block'}) puts it on {node} as task {local}: "
                "the cluster's addresses would be wrong. Start the step with "
                "--distribution=block (the default), or describe the cluster with TF_CONFIG.")

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this task (TensorFlow's method)."""
        return self.task_type, self.task_id

    @property
    def local_rank(self) -> int:
        """This task's index among the step's tasks on its node (``SLURM_LOCALID``)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """How many of the step's tasks run on this task's node."""
        return self._local_world_size

    def num_accelerators(self, task_type: str | None = None,
                         task_id: int | None = None) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or ``{}`` without GPUs (as TensorFlow's answers)."""
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}


def _bound_by_slurm(env: Mapping[str, str], visible: int) -> bool:
    """Whether Slurm bound GPUs to this task itself: ``--gpus-per-task=N`` (``SLURM_GPUS_PER_TASK``,
    maybe ``type:N``) binds N to each task by default, and the task then sees exactly N."""
    per_task = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2].strip()
    return _NODE_GPUS not in env and per_task.isdigit() and int(per_task) == visible > 0


def _set_visible_gpus(env: Mapping[str, str], node_gpus: list[str], mine: list[str]) -> None:
    value = ",".join(mine)
    if env.get("CUDA_VISIBLE_DEVICES") == value:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise ClusterConfigError(
            f"SlurmClusterResolver would set CUDA_VISIBLE_DEVICES={value!r} for this task, but CUDA "
            "has already started in this process and would not see the change; make the strategy "
            "(or the resolver) before the first CUDA call, or pass auto_set_gpu=False.")
    if not isinstance(env, MutableMapping):
        raise ClusterConfigError("SlurmClusterResolver: auto_set_gpu needs a writable environment.")
    env.setdefault(_NODE_GPUS, ",".join(node_gpus))
    env["CUDA_VISIBLE_DEVICES"] = value
