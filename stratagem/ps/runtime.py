"""WorkerRuntime: what a worker task holds between steps of parameter-server training.

One per worker process, made by :class:`~stratagem.ps.worker.WorkerService` and handed to
whatever needs it: the unpickler of each closure (:mod:`stratagem.ps.closures`) resolves a
closure's references against it -- a scoped module's variables become this runtime's local
copies, its optimizer a :class:`WorkerOptimizer` bound to it, a per-worker iterator this
worker's live iterator -- and the local copy of an embedding table carries it
(in its record, :mod:`stratagem._record`) so that a lookup pulls only the rows it uses.

Prefetch: a push asks each ps to send back the values of the closure's dense variables it
holds, read just after it applied the update; the worker's next closure starts from them
instead of pulling (one round trip a step saved). They hold this worker's own updates (read
after its last push), and they are used only when the coordinator has changed no value since
(``writes``, the count of its restores, loads and own steps, comes with every closure);
other workers' updates that landed between that push and the next closure are seen a step
later, as any asynchronous read may see them.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from stratagem._profiling import label
from stratagem._record import attach
from stratagem.data.input import InputContext
from stratagem.errors import InvalidArgumentError
from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.traffic import PsTraffic
from stratagem.ps.variables import RemoteVariable, gradients_by_ps

__all__ = ["WorkerOptimizer", "WorkerRuntime"]


class WorkerRuntime:
    """Local copies of remote variables, the clients that refresh and update them, and the
    worker's datasets."""

    def __init__(self, ps_addresses: list[str], token: str, *, num_workers: int, worker_index: int,
                 timeout: float = 60.0):
        self.traffic = PsTraffic()   # what this worker's calls to the ps move (stratagem.ps.traffic)
        self.ps = [ParameterServerClient(address, token, task=f"ps {i}", default_timeout=timeout,
                                         traffic=self.traffic) for i, address in enumerate(ps_addresses)]
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.params: dict[str, torch.Tensor] = {}
        self.remotes: dict[str, RemoteVariable] = {}
        self.sparse: list[tuple[RemoteVariable, torch.Tensor, torch.Tensor]] = []
        self.datasets: dict[str, Any] = {}
        self.iterators: dict[tuple[str, str], Any] = {}
        self.fence: dict[str, Any] | None = None   # of the closure running now (see begin_closure)
        self.metrics: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._pushes = 0
        self._dense: dict[int, list[str]] = {}   # the running closure's dense shard ids, per ps
        self._writes: Any = None                 # the coordinator's write count it was sent with
        self._prefetched: dict[int, dict[str, torch.Tensor]] = {}   # ps -> values read after a push

    def begin_closure(self, fence: dict[str, Any] | None) -> None:
        """A closure starts: its pushes carry ``fence`` (coordinator, closure, attempt, floor;
        see :mod:`stratagem.ps.fencing`), numbered from 0, so that each of its updates is
        applied at most once whichever execution of it sends it."""
        self.fence, self._pushes = fence, 0
        self.sparse = []

    # ------------------------------------------------------------ variables

    def local_parameter(self, remote: RemoteVariable, is_parameter: bool) -> torch.Tensor:
        """This worker's copy of ``remote`` (made on first use; an embedding table's is empty
        and carries this runtime, see :mod:`stratagem.ps.embedding`)."""
        local = self.params.get(remote.var_id)
        if local is None:
            data = torch.zeros(remote.shape if not remote.row_sparse else (0, *remote.shape[1:]),
                               dtype=remote.dtype)
            local = nn.Parameter(data, requires_grad=remote.trainable) if is_parameter else data
            attach(local, remote=remote, runtime=self if remote.row_sparse else None)
            self.params[remote.var_id] = local
            self.remotes[remote.var_id] = remote
        return local

    def pull_dense(self, var_ids: Iterable[str], writes: Any = None) -> None:
        """Refresh these dense variables from the parameter servers, all servers at once, or from
        the values the last push prefetched (when ``writes`` is the count they were read under)."""
        wanted: dict[int, list[str]] = {}
        var_ids = list(dict.fromkeys(var_ids))
        for remote in (self.remotes[v] for v in var_ids):
            if not remote.row_sparse:
                for shard in remote.shards:
                    wanted.setdefault(shard.ps, []).append(shard.shard_id)
        values: dict[str, torch.Tensor] = {}
        prefetched = self._prefetched if writes is not None and writes == self._writes else {}
        self._dense, self._writes, self._prefetched = wanted, writes, {}
        calls = []
        for ps, ids in wanted.items():
            have = prefetched.get(ps, {})
            if all(i in have for i in ids):
                values.update(have)
            else:
                calls.append((self.ps[ps], "pull", {"var_ids": ids}))
        with label("stratagem.ps.pull"):
            for pulled in call_each(calls, writable_reply=False):   # only copied into params below
                values.update(pulled)
            with torch.no_grad():
                for var_id in var_ids:
                    local, remote = self.params[var_id], self.remotes[var_id]
                    if remote.row_sparse:
                        continue
                    for shard in remote.shards:
                        shard.of(local.data).copy_(values[shard.shard_id].reshape(shard.of(local.data).shape))

    def buffer_versions(self, var_ids: Iterable[str]) -> dict[str, int]:
        """The version counters of the local copies of the buffers among ``var_ids`` (an
        in-place write bumps one; see :meth:`buffers_written`)."""
        return {v: self.params[v]._version for v in dict.fromkeys(var_ids)
                if not isinstance(self.params[v], nn.Parameter) and not self.remotes[v].row_sparse}

    def buffers_written(self, versions: dict[str, int]) -> list[str]:
        """The buffers of ``versions`` written in place since: they stay on this worker
        (nothing sends a buffer back), which the coordinator tells its user about."""
        return [v for v, version in versions.items() if self.params[v]._version != version]

    def pull_rows(self, remote: RemoteVariable, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty((rows.numel(), *remote.shape[1:]), dtype=remote.dtype)
        pieces = remote.shard_of_rows(rows)
        pulled = call_each([(self.ps[shard.ps], "pull_rows", {"var_id": shard.shard_id, "row_ids": local})
                            for shard, _, local in pieces], writable_reply=False)
        for (_, positions, _), values in zip(pieces, pulled):
            out[positions] = values
        return out

    def push_gradients(self, params: Iterable[torch.Tensor], var_ids: Iterable[str] | None = None) -> None:
        """Send dense gradients (split per shard) and the gradients of the embedding rows
        looked up for the tables in ``var_ids`` (all tables when None): one push per ps, all
        servers at once."""
        requests: dict[int, dict[str, Any]] = {
            ps: {"grads": grads, "rows": []} for ps, grads in gradients_by_ps(params).items()}
        for ps, update in self._row_updates(var_ids):
            requests.setdefault(ps, {"grads": {}, "rows": []})["rows"].append(update)
        if self.fence is not None:
            fence = {**self.fence, "index": self._pushes}
            self._pushes += 1
            for request in requests.values():
                request["fence"] = fence
        for ps, request in requests.items():   # the values after this update come back (see Prefetch)
            self._prefetched.pop(ps, None)
            if self._writes is not None and self._dense.get(ps):   # (None: a caller that never prefetches)
                request["pull"] = self._dense[ps]
        pushed = list(requests)
        replies = call_each([(self.ps[ps], "push", requests[ps]) for ps in pushed], writable_reply=False)
        self._prefetched.update((ps, values) for ps, values in zip(pushed, replies) if values is not None)

    def _row_updates(self, var_ids: Iterable[str] | None = None
                     ) -> list[tuple[int, tuple[str, torch.Tensor, torch.Tensor]]]:
        """(ps, (shard id, row ids, row gradients)) for the embedding rows looked up whose small
        tensors hold a gradient. Like a dense ``step()``, this leaves the gradients (and so the
        record) in place: only ``zero_grad`` or the next closure clears them."""
        wanted = None if var_ids is None else set(var_ids)
        merged: dict[str, tuple[RemoteVariable, list, list]] = {}
        for remote, rows, small in self.sparse:
            if small.grad is None or (wanted is not None and remote.var_id not in wanted):
                continue
            entry = merged.setdefault(remote.var_id, (remote, [], []))
            entry[1].append(rows)
            entry[2].append(small.grad)
        updates = []
        for remote, rows_list, grads in merged.values():
            rows, inverse = torch.cat(rows_list).unique(return_inverse=True)
            grad = torch.zeros((rows.numel(), *remote.shape[1:]), dtype=grads[0].dtype)
            grad.index_add_(0, inverse, torch.cat(grads))
            for shard, positions, local in remote.shard_of_rows(rows):
                updates.append((shard.ps, (shard.shard_id, local, grad[positions])))
        return updates

    def zero_row_gradients(self, var_ids: Iterable[str]) -> None:
        """``zero_grad`` for the embedding rows looked up from the tables ``var_ids``.

        Drops the gradients of the lookups' small tensors but keeps the record of the
        lookups: ``zero_grad`` between forward and backward is the usual PyTorch order, and
        the backward still to come fills the small tensors of lookups made before it. The
        record lasts one closure (the worker clears it before running the next).
        """
        wanted = set(var_ids)
        for remote, _, small in self.sparse:
            if remote.var_id in wanted:
                small.grad = None

    def lookup(self, remote: RemoteVariable, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``ids`` use, as a small leaf whose gradient becomes a row update; and the
        positions of ``ids`` in it."""
        rows, inverse = ids.reshape(-1).unique(return_inverse=True)   # sorted
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= remote.shape[0]):
            bad = int(rows[0]) if int(rows[0]) < 0 else int(rows[-1])
            raise InvalidArgumentError(   # no shard holds it: its row would be left unset
                f"embedding id {bad} is out of range for {remote.var_id.split('/', 1)[-1]}, which has "
                f"{remote.shape[0]} rows: ids must be in [0, {remote.shape[0]}).")
        small = self.pull_rows(remote, rows).requires_grad_(remote.trainable)
        self.sparse.append((remote, rows, small))
        return small, inverse.reshape(ids.shape)

    def metric(self, metric_id: str, copy: Any) -> Any:
        """This worker's copy of the metric ``metric_id`` (``copy`` the first time it arrives):
        every closure that mentions the metric updates the same object, kept while one does."""
        return self.metrics.setdefault(metric_id, copy)

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

    def release(self, dataset_id: str, iterator_id: str | None) -> None:
        """Forget an iterator, or (``iterator_id`` None) a dataset and all its iterators: the
        coordinator's program no longer references them."""
        if iterator_id is not None:
            self.iterators.pop((dataset_id, iterator_id), None)
            return
        self.datasets.pop(dataset_id, None)
        for key in [k for k in self.iterators if k[0] == dataset_id]:
            del self.iterators[key]

    def input_context(self) -> InputContext:
        """What this worker's dataset functions are told: one input pipeline per worker, this
        worker's index, one replica per worker."""
        return InputContext(self.num_workers, self.worker_index, self.num_workers)

    def create_dataset(self, dataset_id: str, dataset_fn: Callable) -> None:
        try:
            takes_context = len(inspect.signature(dataset_fn).parameters) >= 1
        except (TypeError, ValueError):
            takes_context = True
        context = self.input_context()
        self.datasets[dataset_id] = dataset_fn(context) if takes_context else dataset_fn()
        for key in [k for k in self.iterators if k[0] == dataset_id]:
            del self.iterators[key]


class WorkerOptimizer:
    """The optimizer of a scoped model, on a worker: ``step()`` sends the gradients to the
    parameter servers, where the real optimizer (one per shard) applies them."""

    def __init__(self, runtime: WorkerRuntime, var_ids: list[str]):
        self._runtime = runtime
        self._var_ids = var_ids

    def _params(self) -> list[torch.Tensor]:
        params = self._runtime.params
        return [params[v] for v in self._var_ids if v in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None
        self._runtime.zero_row_gradients(self._var_ids)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported in parameter-server training")
        with label("stratagem.ps.push"):
            self._runtime.push_gradients(self._params(), self._var_ids)

    @property
    def param_groups(self) -> list[dict]:
        return [{"params": self._params()}]
