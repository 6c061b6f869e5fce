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
   [var_id, ...], "metrics": {metric_id: delta}}``): a worker's buffers stay on the worker,
   and the coordinator warns when its copy of one of these is read; the metrics' deltas are
   merged into the coordinator's metrics when it accepts the result, so each run counts once.

The closure cache is bounded: an LRU of ``closure_cache_size`` functions (default 256, or
the ``STRATAGEM_WORKER_CLOSURE_CACHE`` environment variable). A ``run`` of a key this
worker does not hold (evicted, or the worker restarted) raises
:class:`~stratagem.ps.closures.ClosureNotCachedError`, and the coordinator sends the
function again. A ``run`` request also carries the per-worker datasets and iterators
the coordinator's program dropped (``release``): the runtime forgets them.
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
from stratagem.ps.closures import ClosureNotCachedError, ClosureUnpickler
from stratagem.ps.runtime import WorkerRuntime
from stratagem.rpc.auth import cluster_token
from stratagem.rpc.server import decodes_request, large_requests
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
        self.runtime = WorkerRuntime(ps, cluster_token(), num_workers=workers, worker_index=task.task_id)
        # key -> (function, the variables it mentions, the metrics it mentions); least recently used first
        self._closures: collections.OrderedDict[str, tuple[Callable, list[str], list[Metric]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        # A closure and its arguments, or a dataset function, may be large (captured tensors).
        return {"ping": self.ping, "run": large_requests(decodes_request(self.run)),
                "create_dataset": large_requests(decodes_request(self.create_dataset))}

    def ping(self, request: Any = None) -> dict:
        """Who this is (a new process has a new incarnation), and the sizes of its caches."""
        return {"kind": "worker", "incarnation": self.incarnation, "closures": len(self._closures),
                "datasets": len(self.runtime.datasets), "iterators": len(self.runtime.iterators)}

    def create_dataset(self, message: bytes) -> None:
        request = ClosureUnpickler(message, self.runtime).load()
        with self._lock:
            self.runtime.create_dataset(request["dataset_id"], request["dataset_fn"])

    def run(self, message: bytes) -> Any:
        unpickler = ClosureUnpickler(message, self.runtime)
        request = unpickler.load()
        key = request["key"]
        with self._lock:
            for dataset_id, iterator_id in request.get("release", ()):
                self.runtime.release(dataset_id, iterator_id)
            if request.get("fn") is not None:
                self._closures[key] = (request["fn"], unpickler.var_ids, unpickler.metrics)
            entry = self._closures.get(key)
            if entry is None:
                raise ClosureNotCachedError(f"closure {key} is not cached on this worker (evicted from its "
                                            f"cache of {self.closure_cache_size}, or the worker restarted)")
            self._closures.move_to_end(key)
            while len(self._closures) > self.closure_cache_size:
                self._closures.popitem(last=False)
        fn, closure_vars, closure_metrics = entry
        mark_joined(self.name)   # (for stratagem launch's check that the worker was used)
        args, kwargs = request["args"], request["kwargs"]
        with self._lock, label("stratagem.ps.closure"):
            var_ids = closure_vars + unpickler.var_ids
            self.runtime.pull_dense(var_ids)
            self.runtime.begin_closure(request.get("fence"))
            versions = self.runtime.buffer_versions(var_ids)
            metrics = list(dict.fromkeys(closure_metrics + unpickler.metrics))   # (one object per metric)
            worker_deltas(metrics)   # (empty them: a failed run may have left updates)
            with torch.enable_grad():
                result = fn(*args, **kwargs)
            written = self.runtime.buffers_written(versions)
            deltas = worker_deltas(metrics)
        return {"result": map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result),
                "buffers_written": written, "metrics": deltas}
