"""The worker side of parameter-server training: what runs a closure on a worker task.

``stratagem server`` with a worker TF_CONFIG serves :class:`WorkerService`. A closure
arrives once (cloudpickle) and is cached under its key; each ``run`` then:

1. pulls the latest value of every dense variable this worker knows, one request per
   parameter server, all in flight at once;
2. calls the user's function; inside it an embedding reads only the rows its batch
   uses (``pull_rows``) and ``optimizer.step()`` pushes the gradients (dense ones per
   shard, an embedding's only for the rows used) to the parameter servers;
3. returns the function's result.

While the closure is unpickled, the model's parameter dicts turn into this worker's
local parameters (:func:`worker_parameters`), the optimizer into a
:class:`WorkerOptimizer` and per-worker iterators into this worker's live iterator.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.data.input import InputContext
from stratagem.errors import InvalidArgumentError
from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.variables import RemoteVariable, gradients_by_ps, remote_of
from stratagem.rpc.auth import cluster_token

_RUNTIME: "WorkerRuntime | None" = None
_seen = threading.local()  # variable ids met while this thread decoded its current request


def _take_seen() -> list[str]:
    ids = getattr(_seen, "ids", [])
    _seen.ids = []
    return ids


def runtime() -> "WorkerRuntime | None":
    """This process's worker runtime, or None outside a worker task."""
    return _RUNTIME


class WorkerRuntime:
    """Local copies of remote variables, and the clients that refresh and update them."""

    def __init__(self, ps_addresses: list[str], token: str, *, num_workers: int, worker_index: int,
                 timeout: float = 60.0):
        self.ps = [ParameterServerClient(address, token, task=f"ps {i}", default_timeout=timeout)
                   for i, address in enumerate(ps_addresses)]
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.params: dict[str, nn.Parameter] = {}
        self.remotes: dict[str, RemoteVariable] = {}
        self.sparse: list[tuple[RemoteVariable, torch.Tensor, torch.Tensor]] = []
        self.datasets: dict[str, Any] = {}
        self.iterators: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------ variables

    def local_parameter(self, remote: RemoteVariable, is_parameter: bool) -> torch.Tensor:
        local = self.params.get(remote.var_id)
        if local is None:
            data = torch.zeros(remote.shape if not remote.row_sparse else (0, *remote.shape[1:]),
                               dtype=remote.dtype)
            local = nn.Parameter(data, requires_grad=remote.trainable) if is_parameter else data
            local._sg_remote = remote
            self.params[remote.var_id] = local
            self.remotes[remote.var_id] = remote
        return local

    def pull_dense(self, var_ids: Iterable[str]) -> None:
        """Refresh these dense variables from the parameter servers, all servers at once."""
        wanted: dict[int, list[str]] = {}
        var_ids = list(dict.fromkeys(var_ids))
        for remote in (self.remotes[v] for v in var_ids):
            if not remote.row_sparse:
                for shard in remote.shards:
                    wanted.setdefault(shard.ps, []).append(shard.shard_id)
        values: dict[str, torch.Tensor] = {}
        calls = [(self.ps[ps], "pull", {"var_ids": ids}) for ps, ids in wanted.items()]
        for pulled in call_each(calls, writable_reply=False):   # only copied into params below
            values.update(pulled)
        with torch.no_grad():
            for var_id in var_ids:
                local, remote = self.params[var_id], self.remotes[var_id]
                if remote.row_sparse:
                    continue
                for shard in remote.shards:
                    shard.of(local.data).copy_(values[shard.shard_id].reshape(shard.of(local.data).shape))

    def pull_rows(self, remote: RemoteVariable, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty((rows.numel(), *remote.shape[1:]), dtype=remote.dtype)
        pieces = remote.shard_of_rows(rows)
        pulled = call_each([(self.ps[shard.ps], "pull_rows", {"var_id": shard.shard_id, "row_ids": local})
                            for shard, _, local in pieces], writable_reply=False)
        for (_, positions, _), values in zip(pieces, pulled):
            out[positions] = values
        return out

    def push_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Send dense gradients (split per shard) and recorded embedding row gradients: one
        push per ps, all servers at once."""
        requests: dict[int, dict[str, Any]] = {
            ps: {"grads": grads, "rows": []} for ps, grads in gradients_by_ps(params).items()}
        for ps, update in self._row_updates():
            requests.setdefault(ps, {"grads": {}, "rows": []})["rows"].append(update)
        call_each([(self.ps[ps], "push", request) for ps, request in requests.items()])

    def _row_updates(self) -> list[tuple[int, tuple[str, torch.Tensor, torch.Tensor]]]:
        """(ps, (shard id, row ids, row gradients)) for the embedding rows this step looked up."""
        merged: dict[str, tuple[RemoteVariable, list, list]] = {}
        for remote, rows, small in self.sparse:
            if small.grad is None:
                continue
            entry = merged.setdefault(remote.var_id, (remote, [], []))
            entry[1].append(rows)
            entry[2].append(small.grad)
        self.sparse = []
        updates = []
        for remote, rows_list, grads in merged.values():
            rows, inverse = torch.cat(rows_list).unique(return_inverse=True)
            grad = torch.zeros((rows.numel(), *remote.shape[1:]), dtype=grads[0].dtype)
            grad.index_add_(0, inverse, torch.cat(grads))
            for shard, positions, local in remote.shard_of_rows(rows):
                updates.append((shard.ps, (shard.shard_id, local, grad[positions])))
        return updates

    def lookup(self, remote: RemoteVariable, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``ids`` use, as a small leaf whose gradient becomes a row update; and the
        positions of ``ids`` in it."""
        rows, inverse = ids.reshape(-1).unique(return_inverse=True)
        small = self.pull_rows(remote, rows).requires_grad_(remote.trainable)
        self.sparse.append((remote, rows, small))
        return small, inverse.reshape(ids.shape)

    # ------------------------------------------------------------- datasets

    def iterator(self, dataset_id: str, iterator_id: str) -> Any:
        key = (dataset_id, iterator_id)
        if key not in self.iterators:
            if dataset_id not in self.datasets:
                raise InvalidArgumentError(
                    f"per-worker dataset {dataset_id} was not created on this worker; create it with "
                    f"coordinator.create_per_worker_dataset(dataset_fn) before scheduling steps that use it")
            self.iterators[key] = iter(self.datasets[dataset_id])
        return self.iterators[key]

    def create_dataset(self, dataset_id: str, dataset_fn: Callable) -> None:
        import inspect

        try:
            takes_context = len(inspect.signature(dataset_fn).parameters) >= 1
        except (TypeError, ValueError):
            takes_context = True
        context = InputContext(self.num_workers, self.worker_index, self.num_workers)
        self.datasets[dataset_id] = dataset_fn(context) if takes_context else dataset_fn()
        for key in [k for k in self.iterators if k[0] == dataset_id]:
            del self.iterators[key]


# --------------------------------------------------------- unpickled forms

def worker_parameters(entries: tuple, plain_values: dict | None = None) -> dict:
    """What a scoped module's parameter dict becomes when a closure is unpickled on a worker."""
    rt = runtime()
    if rt is None:  # unpickled elsewhere (a copy on the coordinator): plain tensors
        return dict(plain_values or {})
    seen = getattr(_seen, "ids", None)
    if seen is None:
        seen = _seen.ids = []
    seen.extend(remote.var_id for _, remote, _ in entries if remote is not None)
    return {name: (None if remote is None else rt.local_parameter(remote, is_parameter))
            for name, remote, is_parameter in entries}


class WorkerOptimizer:
    """The optimizer of a scoped model, on a worker: ``step()`` sends the gradients to the
    parameter servers, where the real optimizer (one per shard) applies them."""

    def __init__(self, var_ids: list[str]):
        self._var_ids = var_ids

    def _params(self) -> list[torch.Tensor]:
        rt = runtime()
        return [rt.params[v] for v in self._var_ids if v in rt.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None
        runtime().sparse = []

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported in parameter-server training")
        runtime().push_gradients(self._params())

    @property
    def param_groups(self) -> list[dict]:
        return [{"params": self._params()}]


def worker_optimizer(var_ids: list[str]) -> WorkerOptimizer:
    return WorkerOptimizer(var_ids)


def worker_iterator(dataset_id: str, iterator_id: str) -> Any:
    rt = runtime()
    if rt is None:
        raise InvalidArgumentError("a per-worker iterator can only be read inside a scheduled function")
    return rt.iterator(dataset_id, iterator_id)


def embedding_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """nn.Embedding's forward for a table on parameter servers: only the rows used travel."""
    rt = runtime()
    remote = remote_of(module.weight)
    if rt is None or remote is None or not remote.row_sparse:
        return F.embedding(ids, module.weight, module.padding_idx, module.max_norm, module.norm_type,
                           module.scale_grad_by_freq, module.sparse)
    small, positions = rt.lookup(remote, ids)
    return F.embedding(positions, small, None, module.max_norm, module.norm_type, module.scale_grad_by_freq)


# ---------------------------------------------------------------- service

class WorkerService:
    """The RPC handlers of a worker task."""

    def __init__(self, task: Any):
        global _RUNTIME
        spec = task.cluster_spec
        ps = list(spec.job_tasks("ps")) if "ps" in spec.jobs else []
        workers = spec.num_tasks("worker") if "worker" in spec.jobs else 1
        self.incarnation = uuid.uuid4().hex
        self._runtime = WorkerRuntime(ps, cluster_token(), num_workers=workers, worker_index=task.task_id)
        _RUNTIME = self._runtime
        self._closures: dict[str, Callable] = {}
        self._closure_vars: dict[str, list[str]] = {}   # the variables each closure mentions
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {"ping": self.ping, "run": self.run, "create_dataset": self.create_dataset}

    def ping(self, request: Any = None) -> dict:
        return {"incarnation": self.incarnation}

    def create_dataset(self, request: dict) -> None:
        _take_seen()
        with self._lock:
            self._runtime.create_dataset(request["dataset_id"], request["dataset_fn"])

    def run(self, request: dict) -> Any:
        # the request was decoded on this thread: the variables it mentioned were noted
        seen = _take_seen()
        key = request["key"]
        if request.get("fn") is not None:
            self._closures[key] = request["fn"]
            self._closure_vars[key] = seen
        fn = self._closures.get(key)
        if fn is None:
            raise LookupError(f"closure {key} is not cached on this worker (it restarted?)")
        args, kwargs = request["args"], request["kwargs"]
        with self._lock:
            self._runtime.pull_dense(self._closure_vars.get(key, []) + seen)
            self._runtime.sparse = []
            with torch.enable_grad():
                result = fn(*args, **kwargs)
        return _detached(result)


def _detached(value: Any) -> Any:
    from stratagem.values import map_structure

    return map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def worker_service(task: Any) -> WorkerService:
    """The service factory of task type "worker" for ``stratagem server``."""
    return WorkerService(task)
