"""WorkerService: what ``stratagem server`` serves on a worker task of parameter-server training.

It holds the worker's :class:`~stratagem.ps.runtime.WorkerRuntime` and hands it to
whatever needs it: each request is read by a
:class:`~stratagem.ps.closures.ClosureUnpickler` made with it. A closure arrives once
(cloudpickle) and is cached under its key; each ``run`` then:

1. pulls the latest value of every dense variable the closure mentions, one request per
   parameter server, all in flight at once;
2. calls the user's function; inside it an embedding reads only the rows its batch
   uses (``pull_rows``) and ``optimizer.step()`` pushes the gradients (dense ones per
   shard, an embedding's only for the rows used) to the parameter servers;
3. returns the function's result, detached, with the buffers the function wrote in place
   and what it added to the metrics it mentions (``{"result": ..., "buffers_written":
   [var_id, ...], "metrics": {metric_id: delta}, "traffic": {...}}``): a worker's buffers stay
   on the worker, and the coordinator warns when its copy of one of these is read; the metrics'
   deltas are merged into the coordinator's metrics when it accepts the result, so each run
   counts once; ``traffic`` is what its calls to the ps moved (:mod:`stratagem.ps.traffic`).

The closure cache is bounded: an LRU of ``closure_cache_size`` functions (default 256, or
the ``STRATAGEM_WORKER_CLOSURE_CACHE`` environment variable). A ``run`` of a key this
worker does not hold (evicted, or the worker restarted) raises
:class:`~stratagem.ps.closures.ClosureNotCachedError`, and the coordinator sends the
function again. A ``run`` request also carries the per-worker datasets and iterators
the coordinator's program dropped (``release``): the runtime forgets them.

Workers outlive coordinators: when a coordinator never seen before pings (it took the
cluster over from an earlier one), the worker starts a fresh runtime and closure cache for
it, so nothing of the earlier coordinator's datasets, functions or variables stays behind.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid
from typing import Any, Callable

import torch

from stratagem._profiling import label
from stratagem.cluster.joined import mark_joined
from stratagem.metrics.base import Metric, worker_deltas
from stratagem.observe import flight
from stratagem.ps.closures import ClosureNotCachedError, ClosureUnpickler
from stratagem.ps.runtime import WorkerRuntime
from stratagem.rpc.auth import cluster_token
from stratagem.rpc.server import decodes_request, fast_lane, large_requests
from stratagem.values import map_structure

__all__ = ["WorkerService"]

CLOSURE_CACHE_VARIABLE = "STRATAGEM_WORKER_CLOSURE_CACHE"
DEFAULT_CLOSURE_CACHE_SIZE = 256


def _cache_size_from_environment() -> int:
    text = os.environ.get(CLOSURE_CACHE_VARIABLE, str(DEFAULT_CLOSURE_CACHE_SIZE))
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{CLOSURE_CACHE_VARIABLE} must be a positive integer (how many scheduled "
                         f"functions a worker keeps), got {text!r}")
    return size


class WorkerService:
    """The RPC handlers of a worker task (``task``: a :class:`~stratagem.ps.server.TaskInfo`)."""

    def __init__(self, task: Any, *, closure_cache_size: int | None = None):
        if closure_cache_size is None:
            closure_cache_size = _cache_size_from_environment()
        if closure_cache_size < 1:
            raise ValueError(f"closure_cache_size must be positive, got {closure_cache_size}")
        self.closure_cache_size = closure_cache_size
        self.name = getattr(task, "name", "worker")
        spec = task.cluster_spec
        ps = list(spec.job_tasks("ps")) if "ps" in spec.jobs else []
        workers = spec.num_tasks("worker") if "worker" in spec.jobs else 1
        self.incarnation = uuid.uuid4().hex
        self._new_runtime = lambda: WorkerRuntime(ps, cluster_token(), num_workers=workers,
                                                  worker_index=task.task_id)
        self.runtime = self._new_runtime()
        # key -> (function, the variables it mentions, the metrics it mentions); least recently used first
        self._closures: collections.OrderedDict[str, tuple[Callable, list[str], list[Metric]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._coordinators: collections.deque[str] = collections.deque(maxlen=16)   # ids seen, newest last
        self._swap = threading.Lock()

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        # A closure and its arguments, or a dataset function, may be large (captured tensors).
        return {"ping": self.ping, "run": fast_lane(large_requests(decodes_request(self.run))),
                "create_dataset": large_requests(decodes_request(self.create_dataset))}

    def ping(self, request: Any = None) -> dict:
        """Who this is (a new process has a new incarnation), and the sizes of its caches.
        A coordinator's ping names it (``{"coordinator": id}``): see :meth:`_meet`."""
        if isinstance(request, dict) and isinstance(request.get("coordinator"), str):
            self._meet(request["coordinator"])
        return {"kind": "worker", "incarnation": self.incarnation, "closures": len(self._closures),
                "datasets": len(self.runtime.datasets), "iterators": len(self.runtime.iterators)}

    def _meet(self, coordinator: str) -> None:
        """A coordinator pings before it sends work. One never seen before has taken the cluster
        over: what the earlier ones left here (datasets, iterators, functions, copies of
        variables whose ids the new one may reuse for other shapes) is dropped, in one swap;
        a run of an earlier one still going keeps the runtime it started with."""
        with self._swap:
            if coordinator in self._coordinators:
                return
            if self._coordinators:
                self.runtime, self._closures = self._new_runtime(), collections.OrderedDict()
            self._coordinators.append(coordinator)

    def _current(self) -> tuple[WorkerRuntime, collections.OrderedDict]:
        with self._swap:
            return self.runtime, self._closures

    def create_dataset(self, message: bytes) -> None:
        runtime, _ = self._current()
        request = ClosureUnpickler(message, runtime).load()
        with self._lock:
            runtime.create_dataset(request["dataset_id"], request["dataset_fn"])

    def run(self, message: bytes) -> Any:
        runtime, closures = self._current()
        unpickler = ClosureUnpickler(message, runtime)
        request = unpickler.load()
        key = request["key"]
        with self._lock:
            for dataset_id, iterator_id in request.get("release", ()):
                runtime.release(dataset_id, iterator_id)
            if request.get("fn") is not None:
                closures[key] = (request["fn"], unpickler.var_ids, unpickler.metrics)
            entry = closures.get(key)
            if entry is None:
                raise ClosureNotCachedError(f"closure {key} is not cached on this worker (evicted from its "
                                            f"cache of {self.closure_cache_size}, or the worker restarted)")
            closures.move_to_end(key)
            while len(closures) > self.closure_cache_size:
                closures.popitem(last=False)
        fn, closure_vars, closure_metrics = entry
        mark_joined(self.name)   # (for stratagem launch's check that the worker was used)
        args, kwargs = request["args"], request["kwargs"]
        flight.note_step()   # (a closure is a step of the worker)
        with self._lock, label("stratagem.ps.closure"):
            var_ids = closure_vars + unpickler.var_ids
            runtime.pull_dense(var_ids, writes=request.get("writes"))
            runtime.begin_closure(request.get("fence"))
            versions = runtime.buffer_versions(var_ids)
            metrics = list(dict.fromkeys(closure_metrics + unpickler.metrics))   # (one object per metric)
            worker_deltas(metrics)   # (empty them: a failed run may have left updates)
            with torch.enable_grad():
                result = fn(*args, **kwargs)
            written = runtime.buffers_written(versions)
            deltas = worker_deltas(metrics)
            traffic = runtime.traffic.take()   # (and a failed run's before it)
        return {"result": map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result),
                "buffers_written": written, "metrics": deltas, "traffic": traffic}
