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
3. returns the function's result, detached.

A ``run`` of a key this worker does not hold (it restarted) raises
:class:`~stratagem.ps.closures.ClosureNotCachedError`: the coordinator sends it again.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

import torch

from stratagem._profiling import label
from stratagem.ps.closures import ClosureNotCachedError, ClosureUnpickler
from stratagem.ps.runtime import WorkerRuntime
from stratagem.rpc.auth import cluster_token
from stratagem.rpc.server import decodes_request
from stratagem.values import map_structure

__all__ = ["WorkerService"]


class WorkerService:
    """The RPC handlers of a worker task (``task``: a :class:`~stratagem.ps.server.TaskInfo`)."""

    def __init__(self, task: Any):
        spec = task.cluster_spec
        ps = list(spec.job_tasks("ps")) if "ps" in spec.jobs else []
        workers = spec.num_tasks("worker") if "worker" in spec.jobs else 1
        self.incarnation = uuid.uuid4().hex
        self.runtime = WorkerRuntime(ps, cluster_token(), num_workers=workers, worker_index=task.task_id)
        self._closures: dict[str, Callable] = {}
        self._closure_vars: dict[str, list[str]] = {}   # the variables each closure mentions
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {"ping": self.ping, "run": decodes_request(self.run),
                "create_dataset": decodes_request(self.create_dataset)}

    def ping(self, request: Any = None) -> dict:
        return {"incarnation": self.incarnation}

    def create_dataset(self, message: bytes) -> None:
        request = ClosureUnpickler(message, self.runtime).load()
        with self._lock:
            self.runtime.create_dataset(request["dataset_id"], request["dataset_fn"])

    def run(self, message: bytes) -> Any:
        unpickler = ClosureUnpickler(message, self.runtime)
        request = unpickler.load()
        key = request["key"]
        if request.get("fn") is not None:
            self._closures[key] = request["fn"]
            self._closure_vars[key] = unpickler.var_ids
        fn = self._closures.get(key)
        if fn is None:
            raise ClosureNotCachedError(f"closure {key} is not cached on this worker (it restarted?)")
        args, kwargs = request["args"], request["kwargs"]
        with self._lock, label("stratagem.ps.closure"):
            self.runtime.pull_dense(self._closure_vars.get(key, []) + unpickler.var_ids)
            self.runtime.sparse = []
            with torch.enable_grad():
                result = fn(*args, **kwargs)
        return map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, result)
