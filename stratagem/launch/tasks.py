"""The tasks of a local cluster: which jobs, which address each task has, what it runs.

A launch asks for ``num_workers`` workers, optionally a chief, ``num_ps`` parameter
servers and an evaluator. :func:`plan_cluster` turns that into a :class:`ClusterSpec` on loopback and one
:class:`Task` per process, ordered chief, workers, parameter servers; :func:`tf_config`
writes the TF_CONFIG each task is given, in TensorFlow's exact format, and
:func:`torchrun_variables` the ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` that torchrun would give a task of collective training, so that a script's
own rank logic (``int(os.environ.get("RANK", -1))``, as in a DistributedDataParallel script)
reads the same under both launchers.

Who runs the user's script:

- collective training (no ps): every worker, and the chief if there is one;
- parameter-server training (``num_ps > 0``): only the chief, which is the coordinator;
  it is added even without ``chief=True``. Workers and parameter servers run
  :func:`server_command` and wait for the coordinator's work;
- an evaluator (``num_evaluators=1``) runs the script too, with task type
  ``"evaluator"``: the script sees it in TF_CONFIG and evaluates checkpoints (as in
  TensorFlow). It takes no part in training and is never restarted with the group.

Example::

    >>> import json
    >>> from stratagem.launch.tasks import plan_cluster, tf_config, torchrun_variables
    >>> spec, tasks = plan_cluster(["train.py", "--lr", "0.1"], num_workers=2, num_ps=0,
    ...                            chief=True, ports=[2220, 2221, 2222])
    >>> spec
    ClusterSpec({'chief': ['127.0.0.1:2220'], 'worker': ['127.0.0.1:2221', '127.0.0.1:2222']})
    >>> [task.name for task in tasks]
    ['chief', 'worker 0', 'worker 1']
    >>> json.loads(tf_config(spec, tasks[2]))["task"]
    {'type': 'worker', 'index': 1}
    >>> tasks[2].command[1:]
    ('train.py', '--lr', '0.1')
    >>> torchrun_variables(spec, tasks[2])
    {'RANK': '2', 'WORLD_SIZE': '3', 'LOCAL_RANK': '2', 'LOCAL_WORLD_SIZE': '3'}
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from stratagem.cluster import ClusterSpec, SimpleClusterResolver
from stratagem.cluster.resolver import COLLECTIVE_JOBS
from stratagem.launch.ports import format_address

__all__ = ["Task", "plan_cluster", "server_command", "tf_config", "torchrun_variables"]


def server_command() -> list[str]:
    """What a worker or parameter server runs in parameter-server training.

    The one place that names it: ``stratagem server`` serves the task that TF_CONFIG
    describes until it is told to stop (SIGTERM).
    """
    return [sys.executable, "-m", "stratagem", "server"]


@dataclass(frozen=True)
class Task:
    """One process of the cluster: its place in the ClusterSpec and its command line."""

    task_type: str
    task_id: int
    command: tuple[str, ...]
    runs_script: bool  # False for the servers of parameter-server training

    @property
    def trains(self) -> bool:
        """Whether the task is part of training (all but an evaluator, which only watches it)."""
        return self.task_type != "evaluator"

    @property
    def name(self) -> str:
        """How output and messages name the task: ``"chief"``, ``"worker 1"``, ``"ps 0"``."""
        return "chief" if self.task_type == "chief" else f"{self.task_type} {self.task_id}"


def plan_cluster(script_command: Sequence[str], *, num_workers: int, num_ps: int, chief: bool,
                 ports: Sequence[int], host: str = "127.0.0.1",
                 server: Sequence[str] | None = None,
                 num_evaluators: int = 0) -> tuple[ClusterSpec, list[Task]]:
    """The ClusterSpec and the tasks of a launch; ``ports`` has one port per task, in order.

    ``script_command`` is the script and its arguments; ``sys.executable`` is put in front.
    ``server`` replaces :func:`server_command` (tests use a stand-in).
    """
    counts = {"chief": int(chief or num_ps > 0), "worker": num_workers, "ps": num_ps,
              "evaluator": num_evaluators}
    assert len(ports) == sum(counts.values()), "one port per task"
    script = (sys.executable, *script_command)
    serve = tuple(server_command() if server is None else server)
    cluster: dict[str, list[str]] = {}
    tasks: list[Task] = []
    port_iter = iter(ports)
    for job, count in counts.items():
        if not count:
            continue
        cluster[job] = [format_address(host, next(port_iter)) for _ in range(count)]
        runs_script = job in ("chief", "evaluator") or not num_ps
        tasks += [Task(job, index, script if runs_script else serve, runs_script)
                  for index in range(count)]
    return ClusterSpec(cluster), tasks


def tf_config(spec: ClusterSpec, task: Task) -> str:
    """TF_CONFIG for ``task``: ``{"cluster": {...}, "task": {"type": ..., "index": ...}}``."""
    return json.dumps({"cluster": spec.as_dict(),
                       "task": {"type": task.task_type, "index": task.task_id}})


def torchrun_variables(spec: ClusterSpec, task: Task) -> dict[str, str]:
    """What torchrun would set for ``task``, consistent with its TF_CONFIG; ``{}`` outside the collective.

    In collective training (no parameter servers) the chief and the workers are the ranks
    of one group, in TF_CONFIG's order (the chief 0, then the workers): ``RANK`` and
    ``WORLD_SIZE`` are that rank and that count, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` the
    same among the tasks whose address has this task's host. An evaluator, and every task of
    parameter-server training (which has no such group), gets none. ``MASTER_ADDR`` and
    ``MASTER_PORT`` are not set: TF_CONFIG says where the group meets, and it comes first.
    """
    if "ps" in spec.jobs:
        return {}
    rank = SimpleClusterResolver(spec, task_type=task.task_type, task_id=task.task_id).worker_rank
    if rank is None:
        return {}
    members = [(job, index) for job in COLLECTIVE_JOBS if job in spec.jobs
               for index in spec.task_indices(job)]
    hosts = [spec.task_address(job, index).rpartition(":")[0] for job, index in members]
    local = [i for i, host in enumerate(hosts) if host == hosts[rank]]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(members)),
            "LOCAL_RANK": str(local.index(rank)), "LOCAL_WORLD_SIZE": str(len(local))}
