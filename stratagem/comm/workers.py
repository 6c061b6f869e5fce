"""The hierarchical Collective: replica threads inside each worker, torch.distributed across.

A value is first combined among this process's replica threads (by the
:class:`~stratagem.comm.replicas.ReplicaCollective` the cross-device op configured),
then local replica 0 combines it with the other workers through the
:class:`~stratagem.comm.processes.WorkerGroup` (gloo on CPU, NCCL on CUDA), and the
result is handed back to the other local replicas. Gradients cross workers in packs
launched while backward still runs (:mod:`stratagem.comm.gradients`).

The replica-context collectives cross workers with one torch.distributed call of their
own kind (:mod:`stratagem.comm.worker_ops`): all-gather, reduce-scatter, broadcast,
all-to-all, scatter; ``reduce`` and ``gather`` are the all-reduce and the all-gather
kept by one replica. Collectives whose receivers must know what arrives (all but
all-reduce and reduce-scatter) first exchange the shapes (a small object collective),
which also lets every worker refuse a mismatch together instead of hanging.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm import worker_ops
from stratagem.comm.collective import Collective, check_gatherable
from stratagem.comm.gradients import GradientPacks
from stratagem.comm.options import CommunicationOptions
from stratagem.comm.processes import WorkerGroup
from stratagem.comm.replicas import ReplicaCollective, check_mean
from stratagem.comm.sync import ReplicaAborted
from stratagem.errors import InvalidArgumentError
from stratagem.values import ReduceOp


class WorkerCollective(Collective):
    """Replica threads of this worker (``local``) joined with the other workers (``group``)."""

    def __init__(self, local: ReplicaCollective, group: WorkerGroup, options: CommunicationOptions):
        super().__init__(local.devices)
        self.local = local
        self.group = group
        self.options = options
        self.num_workers = group.world_size
        self.worker_index = group.rank
        # Among local replicas nothing changes: bind the local primitives directly (the
        # gradient path then reaches the arithmetic without an extra call).
        self.exchange = local.exchange
        self.sum_exchanged = local.sum_exchanged
        self._packs: dict[int, GradientPacks] = {}

    def start_run(self) -> None:
        self.local.start_run()

    def abort(self) -> None:
        self.local.abort()

    def finish(self, local_id: int) -> None:
        self.local.finish(local_id)

    # ------------------------------------------------------ replica context

    def all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
        check_mean(tensors, op)
        if self.num_local == 1 and self.num_workers > 1:
            return self._all_reduce_alone(tensors, op)
        local = self.local.all_reduce(local_id, tensors, ReduceOp.SUM)
        if self.num_workers > 1:
            if local_id == 0 and local:
                if len({t.dtype for t in local}) == 1:  # one message for all of them
                    flat = torch.cat([t.reshape(-1) for t in local])
                    self.group.all_reduce(flat, "ReplicaContext.all_reduce")
                    offset = 0
                    for t in local:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                else:
                    for t in local:
                        self.group.all_reduce(t, "ReplicaContext.all_reduce")
            self._share_first(local_id, local, "all_reduce:workers")
        if op is ReduceOp.MEAN:
            n = self.num_replicas
            local = [t / n for t in local]
        return local

    def _all_reduce_alone(self, tensors: list[torch.Tensor], op: ReduceOp, destination: int | None = None
                          ) -> list[torch.Tensor] | None:
        """One local replica: copy into fresh buffers (the inputs stay untouched) and all-reduce
        them (``dist.reduce`` to worker ``destination`` when given; None on the others).

        One dtype: one flat buffer, the results are views of it. A large single tensor is
        copied in a few chunks, each sent on while the next is copied.
        """
        results: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        group = self.group

        def launch(buffer: torch.Tensor, async_op: bool) -> Any:
            if destination is None:
                return dist.all_reduce(buffer, group=group.group, async_op=async_op)
            return dist.reduce(buffer, dst=group.global_rank(destination), group=group.group, async_op=async_op)

        with group.guard("ReplicaContext.all_reduce" if destination is None else "ReplicaContext.reduce"):
            for indices in by_dtype.values():
                parts = [tensors[i].reshape(-1) for i in indices]
                flat = parts[0].new_empty(sum(p.numel() for p in parts), device=group.device)
                pieces = 4 if flat.numel() * flat.element_size() >= (4 << 20) and len(parts) == 1 else 1
                works, offset = [], 0
                for part in parts:
                    for chunk in torch.tensor_split(part, pieces):
                        target = flat[offset:offset + chunk.numel()]
                        target.copy_(chunk)
                        offset += chunk.numel()
                        if pieces > 1:
                            works.append(launch(target, True))
                if pieces == 1:
                    launch(flat, False)
                for work in works:
                    work.wait()
                if op is ReduceOp.MEAN:
                    flat.div_(self.num_replicas)
                flat = flat.to(tensors[indices[0]].device)
                offset = 0
                for i in indices:
                    results[i] = flat[offset:offset + tensors[i].numel()].view(tensors[i].shape)
                    offset += tensors[i].numel()
        return results if destination is None or destination == group.rank else None

    def reduce(self, local_id, tensors, op, destination):
        check_mean(tensors, op)
        if self.num_local == 1 and self.num_workers > 1:
            return self._all_reduce_alone(tensors, op, destination)
        return super().reduce(local_id, tensors, op, destination)

    def gather(self, local_id, tensors, axis, destination):
        if self.num_workers == 1:
            return self.local.gather(local_id, tensors, axis, destination)
        destination_worker, destination_local = divmod(destination, self.num_local)

        def work(local):
            meta = self._shapes(local, "ReplicaContext.gather (shapes)")
            shapes = [[m[0] for m in replica] for replica in meta]
            check_gatherable(shapes, [[m[1] for m in replica] for replica in meta], axis)
            results = [worker_ops.gather(self.group, [replica[i] for replica in local], [s[i] for s in shapes],
                                         axis, self.num_local, destination_worker) for i in range(len(tensors))]
            out: list[Any] = [None] * self.num_local
            if self.worker_index == destination_worker:
                out[destination_local] = [t.to(self.devices[destination_local].torch_device) for t in results]
            return out
        return self._on_first(local_id, tensors, "gather", work)

    # -------------------------------------- collectives that move tensors as they are

    def _on_first(self, local_id: int, tensors: Any, tag: str, work: Any) -> Any:
        """Local replica 0 runs ``work(every local replica's tensors)``, which returns one
        result per local replica; each replica gets its own."""
        local = self.local.exchange(local_id, tensors, tag)
        outcome = None
        if local_id == 0:
            try:
                outcome = (True, work(local))
            except BaseException as error:  # noqa: BLE001 - every local replica learns of it below
                outcome = (False, error)
        ok, value = self.local.exchange(local_id, outcome, f"{tag}:result")[0]
        if ok:
            return value[local_id]
        if local_id == 0:
            raise value
        if isinstance(value, InvalidArgumentError):  # misuse: every replica says so (each may catch it)
            raise InvalidArgumentError(str(value))
        raise ReplicaAborted()

    def _copies(self, result: Any) -> list[Any]:
        """``result`` (local replica 0's) and a copy of it on each other local replica's device."""
        def copy(x: Any, k: int) -> Any:
            return x.to(self.devices[k].torch_device, copy=True) if isinstance(x, torch.Tensor) else x
        return [result] + [[copy(x, k) for x in result] for k in range(1, self.num_local)]

    def _shapes(self, local: list[list[torch.Tensor]], what: str) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
        """Every replica's (shape, dtype) per tensor, in replica order."""
        mine = [[(tuple(t.shape), t.dtype) for t in replica] for replica in local]
        return [replica for worker in worker_ops.exchange_shapes(self.group, mine, what) for replica in worker]

    def _source_shapes(self, local: list[list[torch.Tensor]], source: int, what: str) -> tuple[Any, list]:
        """The source replica's tensors (on its worker; None elsewhere) and their (shape, dtype) everywhere."""
        source_worker, source_local = divmod(source, self.num_local)
        mine = local[source_local] if self.worker_index == source_worker else None
        described = None if mine is None else [[(tuple(t.shape), t.dtype) for t in mine]]
        return mine, worker_ops.broadcast_shapes(self.group, described, source_worker, what)[0]

    def all_gather_parts(self, local_id, tensors, axis):
        if self.num_workers == 1:
            return self.local.all_gather_parts(local_id, tensors, axis)

        def work(local):
            meta = self._shapes(local, "ReplicaContext.all_gather (shapes)")
            shapes = [[m[0] for m in replica] for replica in meta]
            check_gatherable(shapes, [[m[1] for m in replica] for replica in meta], axis)
            results = [worker_ops.gather(self.group, [replica[i] for replica in local], [s[i] for s in shapes],
                                         axis, self.num_local) for i in range(len(tensors))]
            sizes = [[s[i][axis] for s in shapes] for i in range(len(tensors))]
            return [(r, sizes) for r in self._copies(results)]
        return self._on_first(local_id, tensors, "all_gather", work)

    def reduce_scatter(self, local_id, tensor, op, axis, sizes=None):
        check_mean([tensor], op)
        if self.num_workers == 1:
            return self.local.reduce_scatter(local_id, tensor, op, axis, sizes)
        sizes = self.scatter_sizes(tensor.shape[axis], sizes)

        def work(local):
            meta = self._shapes([[t] for t in local], "ReplicaContext.reduce_scatter (shapes)")
            if any(m != meta[0] for m in meta):
                raise InvalidArgumentError(
                    f"reduce_scatter needs the same shape and dtype on every replica, got "
                    f"{[(list(m[0][0]), str(m[0][1])) for m in meta]}")
            total = self.local_sum(local) if len(local) > 1 else local[0]
            pieces = worker_ops.reduce_scatter(self.group, total, sizes, axis, self.worker_index, self.num_local)
            if op is ReduceOp.MEAN:
                pieces = [p / self.num_replicas for p in pieces]
            return [p.to(self.devices[k].torch_device) for k, p in enumerate(pieces)]
        return self._on_first(local_id, tensor, "reduce_scatter", work)

    def broadcast(self, local_id, tensors, source):
        if self.num_workers == 1:
            return self.local.broadcast(local_id, tensors, source)
        source_worker = source // self.num_local

        def work(local):
            mine, meta = self._source_shapes(local, source, "ReplicaContext.broadcast (shapes)")
            return self._copies(worker_ops.broadcast(self.group, mine, meta, source_worker,
                                                     self.devices[0].torch_device))
        return self._on_first(local_id, tensors, "broadcast", work)

    def all_to_all(self, local_id, tensors):
        if self.num_workers == 1:
            return self.local.all_to_all(local_id, tensors)

        def work(local):
            meta = self._shapes(local, "ReplicaContext.all_to_all (shapes)")
            if len({dtype for replica in meta for _, dtype in replica}) > 1:
                return [None] * self.num_local  # several dtypes: the general path below, every worker alike
            shapes = [[shape for shape, _ in replica] for replica in meta]
            results = worker_ops.all_to_all(self.group, local, shapes, self.worker_index, self.num_local)
            return [[t.to(self.devices[k].torch_device) for t in r] for k, r in enumerate(results)]
        results = self._on_first(local_id, tensors, "all_to_all", work)
        return super().all_to_all(local_id, tensors) if results is None else results

    def scatter(self, local_id, tensors, source):
        if self.num_workers == 1:
            return self.local.scatter(local_id, tensors, source)
        source_worker = source // self.num_local

        def work(local):
            mine, meta = self._source_shapes(local, source, "ReplicaContext.scatter (shapes)")
            if len({dtype for _, dtype in meta}) > 1:
                raise InvalidArgumentError(
                    f"scatter across workers needs tensors of one dtype, got {sorted({str(d) for _, d in meta})}")
            pieces = worker_ops.scatter(self.group, mine, [shape for shape, _ in meta], meta[0][1], source_worker,
                                        self.worker_index, self.num_local, self.devices[0].torch_device)
            return [p.to(self.devices[k].torch_device) for k, p in enumerate(pieces)]
        return self._on_first(local_id, tensors, "scatter", work)

    def local_sum(self, components):
        return self.local.local_sum(components)

    def _share_first(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> None:
        """Local replicas 1.. copy local replica 0's ``tensors`` (after it talked to the workers)."""
        if self.num_local > 1:
            first = self.local.exchange(local_id, tensors, tag)[0]
            if local_id != 0:
                for t, t0 in zip(tensors, first):
                    t.copy_(t0)
            self.local.exchange(local_id, None, f"{tag} done")

    def exchange_all(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> list[Any]:
        local = self.local.exchange(local_id, tensors, tag)
        if self.num_workers == 1:
            return local
        everyone = None
        if local_id == 0:
            per_worker = self.group.all_gather_object(
                [[t.detach().cpu() for t in replica] for replica in local], f"ReplicaContext.{tag}")
            everyone = [replica for worker in per_worker for replica in worker]
        return self.local.exchange(local_id, everyone, f"{tag}:workers")[0]

    def gradient_packs(self, params: list[torch.Tensor]) -> GradientPacks | None:
        if self.num_workers == 1:
            return None
        key = id(params[0]) if params else 0
        packs = self._packs.get(key)
        if packs is None or not packs.covers(params):
            packs = GradientPacks(params, self.group, bytes_per_pack=self.options.bytes_per_pack)
            self._packs[key] = packs
        return packs

    # -------------------------------------------------------- process level

    def worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.num_workers == 1:
            return tensor
        group = self.group
        result = tensor.contiguous().clone()
        carrier = result if result.device == group.device else result.to(group.device)
        with group.guard("strategy.reduce"):
            dist.all_reduce(carrier, group=group.group)
        if carrier is not result:
            result.copy_(carrier)
        return result

    def worker_gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self.num_workers == 1:
            return tensor
        parts = self.group.all_gather_object(tensor.detach().cpu(), "strategy.gather")
        return torch.cat([p.to(tensor.device) for p in parts], dim=axis)

    def broadcast_object(self, value: Any) -> Any:
        return self.group.broadcast_object(value, "broadcast from the chief")

    def all_gather_object(self, value: Any, what: str = "all_gather") -> list[Any]:
        return self.group.all_gather_object(value, what)

    def agree_on_modules(self, modules: list[nn.Module]) -> None:
        tensors, described = [], []
        for module in modules:
            for kind in ("_parameters", "_buffers"):
                for name, tensor in dict.items(module.__dict__[kind]):
                    if tensor is not None:
                        tensors.append(tensor)
                        described.append((f"{type(module).__name__}.{name}", tuple(tensor.shape),
                                          str(tensor.dtype)))
        everyone = self.group.all_gather_object(described, "start-up parameter check")
        chief = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs != chief:
                self._raise_mismatch(chief, theirs, rank)
        if tensors:
            with torch.no_grad():
                for dtype in dict.fromkeys(t.dtype for t in tensors):
                    same = [t for t in tensors if t.dtype == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    self.group.broadcast(flat, "broadcast of the chief's initial parameters")
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def _raise_mismatch(self, chief: list, theirs: list, rank: int) -> None:
        names = self.group.names
        for i, (a, b) in enumerate(zip(chief, theirs)):
            if a != b:
                raise InvalidArgumentError(
                    f"the workers created different models: tensor #{i} created in scope is {a[0]} "
                    f"of shape {list(a[1])} ({a[2]}) on {names[0]} but {b[0]} of shape {list(b[1])} "
                    f"({b[2]}) on {names[rank]}; every worker must build the same model")
        longer, shorter = (names[0], names[rank]) if len(chief) > len(theirs) else (names[rank], names[0])
        extra = (chief if len(chief) > len(theirs) else theirs)[min(len(chief), len(theirs))]
        raise InvalidArgumentError(
            f"the workers created different models: {longer} created {max(len(chief), len(theirs))} "
            f"tensors in scope but {shorter} only {min(len(chief), len(theirs))}; the first extra one "
            f"is {extra[0]} of shape {list(extra[1])}; every worker must build the same model")

    def close(self) -> None:
        self.group.close()

    def __repr__(self) -> str:
        return f"WorkerCollective({self.group.names[self.worker_index]} of {self.num_workers}, {self.local!r})"
