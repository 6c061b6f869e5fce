"""ClusterResolver: where this process sits in the cluster.

A resolver answers one question for the strategies: which cluster am I part of, and which
task am I in it? It gives TensorFlow's interface (``cluster_spec()``, ``task_type``,
``task_id``, ``rpc_layer``, ``master()``, ``num_accelerators()``) plus the four facts a
synchronous multi-worker strategy needs, derived once here instead of in every strategy:

- ``num_workers``: the tasks that take part in the collective -- the chief and the workers
  (parameter servers and evaluators do not);
- ``worker_rank``: this task's rank in that collective -- the chief is rank 0, then the
  workers in index order; ``None`` for a parameter server or an evaluator;
- ``is_chief``: whether this task has rank 0 (the chief, or worker 0 when there is no chief);
  it saves checkpoints and writes summaries;
- ``chief_address``: the address of rank 0, where the collective meets (its rendezvous).

A lone local task (no cluster at all) is its own chief: rank 0 of 1.

Example::

    >>> from stratagem.cluster import ClusterSpec, SimpleClusterResolver
    >>> spec = ClusterSpec({"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
    ...                     "evaluator": ["h3:2222"]})
    >>> resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1)
    >>> resolver.num_workers, resolver.worker_rank, resolver.is_chief, resolver.chief_address
    (3, 2, False, 'h0:2222')
    >>> SimpleClusterResolver(spec, task_type="evaluator", task_id=0).worker_rank is None
    True
    >>> SimpleClusterResolver(ClusterSpec()).is_chief     # a lone local task
    True
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from stratagem.cluster.spec import ClusterSpec
from stratagem.errors import ClusterConfigError

__all__ = ["ClusterResolver", "SimpleClusterResolver", "check_task"]

# The jobs whose tasks form the synchronous collective, in rank order.
COLLECTIVE_JOBS = ("chief", "worker")


def _collective_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    return [(job, index) for job in COLLECTIVE_JOBS if job in spec.jobs
            for index in spec.task_indices(job)]


def check_task(spec: ClusterSpec, task_type: object, task_id: object, *, source: str) -> None:
    """Raises ClusterConfigError unless ``(task_type, task_id)`` names a task of ``spec``.

    ``(None, None)`` (no task) passes. An evaluator need not be listed in the cluster,
    as in TensorFlow: it evaluates checkpoints on the side and talks to no one.
    ``source`` prefixes the messages ("TF_CONFIG", "SimpleClusterResolver").
    """
    if "chief" in spec.jobs and spec.num_tasks("chief") > 1:
        raise ClusterConfigError(
            f"{source}: the cluster has {spec.num_tasks('chief')} chief tasks, but a cluster "
            "has at most one chief (it saves checkpoints and writes summaries); keep one "
            "address under 'chief' and move the others to 'worker'.")
    if task_type is None and task_id is None:
        return
    if task_type is None or task_id is None:
        raise ClusterConfigError(
            f"{source}: got task_type={task_type!r} and task_id={task_id!r}; give both "
            "(which task this process is) or neither.")
    if not isinstance(task_type, str):
        raise ClusterConfigError(
            f"{source}: task type {task_type!r} is not a string; use a job name such as "
            "'worker'.")
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ClusterConfigError(
            f"{source}: task index {task_id!r} is not a non-negative integer; write it "
            "like 0 or 1 (a number, not a string).")
    if task_type == "evaluator" and task_type not in spec.jobs:
        return
    if task_type not in spec.jobs:
        raise ClusterConfigError(
            f"{source}: this task is a {task_type!r}, but the cluster has no {task_type!r} "
            f"job (its jobs are {spec.jobs}); add the {task_type!r} addresses to the cluster "
            "or fix the task type.")
    indices = spec.task_indices(task_type)
    if task_id not in indices:
        count = len(indices)
        known = (f"indices 0 to {count - 1}" if indices == list(range(count))
                 else f"indices {indices}")
        raise ClusterConfigError(
            f"{source}: task index {task_id} is out of range: job {task_type!r} has {count} "
            f"task{'s' if count != 1 else ''} ({known}); use one of those indices or add "
            "this task's address to the cluster.")


class ClusterResolver(abc.ABC):
    """Where this process sits in the cluster: TensorFlow's ClusterResolver interface.

    Subclasses implement :meth:`cluster_spec` and pass the task to ``__init__``; the
    collective facts (``num_workers``, ``worker_rank``, ``is_chief``, ``chief_address``)
    follow from those, and a subclass whose cluster has no spec (torchrun) overrides them.
    """

    def __init__(self, *, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The whole cluster: every job and the address of every task."""

    @property
    def task_type(self) -> str | None:
        """This task's job name ("chief", "worker", "ps", "evaluator"); None when alone."""
        return self._task_type

    @property
    def task_id(self) -> int | None:
        """This task's index in its job; None when alone."""
        return self._task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefix of addresses returned by :meth:`master` ("grpc"), or None."""
        return self._rpc_layer

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task (this one by default), prefixed by ``rpc_layer://``.

        Returns ``""`` for a lone local task, or an evaluator the cluster does not list.
        """
        if (task_type is None) != (task_id is None):
            raise ClusterConfigError(
                f"master() got task_type={task_type!r} and task_id={task_id!r}; give both "
                "to name another task, or neither for this one.")
        spec = self.cluster_spec()
        if task_type is None:
            task_type, task_id = self.task_type, self.task_id
            if task_type is None or task_type not in spec.jobs:
                return ""
        assert task_id is not None
        address = spec.task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type: str | None = None,
                         task_id: int | None = None) -> dict[str, int]:
        """Accelerators this task may use, by kind: ``{"GPU": n}``, or ``{}`` with none.

        Counts the CUDA devices visible to this process (TensorFlow counts its task's GPUs
        the same way, and also leaves out kinds it finds none of).
        """
        import torch  # here, so that reading a cluster description needs no torch import

        count = torch.cuda.device_count()
        return {"GPU": count} if count else {}

    def _is_alone(self, spec: ClusterSpec) -> bool:
        return not spec and self.task_type is None

    @property
    def num_workers(self) -> int:
        """How many tasks take part in the collective: the chief and the workers."""
        spec = self.cluster_spec()
        return 1 if self._is_alone(spec) else len(_collective_tasks(spec))

    @property
    def worker_rank(self) -> int | None:
        """This task's rank in the collective (chief 0, then workers); None if not in it."""
        spec = self.cluster_spec()
        if self._is_alone(spec):
            return 0
        members = _collective_tasks(spec)
        task = (self.task_type, self.task_id)
        return members.index(task) if task in members else None  # type: ignore[arg-type]

    @property
    def is_chief(self) -> bool:
        """Whether this task is rank 0: the chief, or worker 0 when there is no chief."""
        return self.worker_rank == 0

    @property
    def chief_address(self) -> str | None:
        """The "host:port" of rank 0, where the collective meets; None when alone."""
        spec = self.cluster_spec()
        members = _collective_tasks(spec)
        return spec.task_address(*members[0]) if members else None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
                f"worker_rank={self.worker_rank!r}, num_workers={self.num_workers!r})")


class SimpleClusterResolver(ClusterResolver):
    """A resolver for a cluster given by hand, e.g. in tests or by a launcher.

    Every option is keyword-only, since TensorFlow's SimpleClusterResolver takes them in a
    different order (``master`` second). ``num_accelerators`` overrides the count of
    visible GPUs, e.g. ``{"GPU": 2}``.
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], *,
                 task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None,
                 num_accelerators: Mapping[str, int] | None = None) -> None:
        spec = ClusterSpec(cluster_spec)
        check_task(spec, task_type, task_id, source="SimpleClusterResolver")
        if num_accelerators is not None:
            bad = {kind: n for kind, n in num_accelerators.items()
                   if not isinstance(kind, str) or isinstance(n, bool)
                   or not isinstance(n, int) or n < 0}
            if bad:
                raise ClusterConfigError(
                    f"SimpleClusterResolver: num_accelerators must map a device kind to a "
                    f"count >= 0, like {{'GPU': 2}}; these entries are not: {bad!r}.")
            num_accelerators = dict(num_accelerators)
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer)
        self._spec = spec
        self._num_accelerators = num_accelerators

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def num_accelerators(self, task_type: str | None = None,
                         task_id: int | None = None) -> dict[str, int]:
        if self._num_accelerators is None:
            return super().num_accelerators(task_type, task_id)
        return {kind: n for kind, n in self._num_accelerators.items() if n}
