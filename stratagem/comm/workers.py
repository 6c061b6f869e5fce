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
kept by one replica. Every one of them, and ``worker_sums`` / ``worker_gathers`` behind
``strategy.reduce`` / ``strategy.gather``, first exchanges one fixed-size message
(:mod:`stratagem.comm.agreement`): which call, its arguments, dtypes and shapes, so that every
worker refuses a mismatch together (never gloo's garbage or abort, never a hang), and the
receivers learn the shapes; a small sum rides in the message itself. The gradient packs skip
it: their layout follows from the parameters, which every worker checks at start-up
(``agree_on_modules``), and ``bytes_per_pack`` (the start-up configuration check).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.observe import record
from stratagem.comm import agreement, compression, worker_ops
from stratagem.comm.collective import Collective, check_axis, check_gatherable
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
        if self.num_workers > 1:   # the straggler table's sums per step (strategy.experimental_step_report)
            record.count_steps()

    def start_run(self) -> None:
        self.local.start_run()

    def abort(self) -> None:
        self.local.abort()

    def finish(self, local_id: int) -> None:
        self.local.finish(local_id)

    # ------------------------------------------------------ replica context

    def all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
        check_mean(tensors, op)
        return self._all_reduce(local_id, tensors, op, None)

    def reduce(self, local_id, tensors, op, destination):
        check_mean(tensors, op)
        return self._all_reduce(local_id, tensors, op, destination)

    def _all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp,
                    destination: int | None) -> list[torch.Tensor] | None:
        """Local replicas sum first (their cross-device op); local replica 0 sums over the workers
        (one local replica and a destination: ``dist.reduce`` to its worker); MEAN divides once."""
        if self.num_workers == 1:
            results = self.local.all_reduce(local_id, tensors, op)
            return results if destination is None or destination == local_id else None
        what = "ReplicaContext.all_reduce" if destination is None else "ReplicaContext.reduce"
        detail = f"with '{op.value.lower()}'" + ("" if destination is None else f" to replica {destination}")
        if self.num_local == 1:
            results = self.worker_sums(tensors, what, detail, destination)  # (one replica each: ids are workers)
        else:
            local = self.local.all_reduce(local_id, tensors, ReduceOp.SUM)
            results = self._on_first(local_id, local, "all_reduce:workers",
                                     lambda everyone: self._copies(self.worker_sums(everyone[0], what, detail)))
        if results is None or (destination is not None and self.replica_id(local_id) != destination):
            return None
        if op is ReduceOp.MEAN:
            results = [t.div_(self.num_replicas) for t in results]
        return results

    def _agree(self, local: list[list[torch.Tensor]], what: str, detail: str, rule: str, axis: int = 0,
               shapes: bool = True) -> list[list[tuple[tuple[int, ...], torch.dtype]]] | None:
        """One message with every worker (checked by ``rule``); every replica's (shape, dtype)
        per tensor, in replica order, when ``shapes``."""
        call = agreement.Call(what, f"{detail} {agreement.note()}".strip(),
                              [agreement.describe(replica) for replica in local], rule, axis)
        agreed = agreement.agree(self.group, call, shapes=shapes)
        return None if agreed.described is None else [r for worker in agreed.described for r in worker]

    def _gathered_shapes(self, local: list[list[torch.Tensor]], axis: int, what: str, detail: str) -> list:
        meta = self._agree(local, what, f"along axis {_axis(local, axis)}{detail}", "gather", axis)
        shapes = [[m[0] for m in replica] for replica in meta]
        check_gatherable(shapes, [[m[1] for m in replica] for replica in meta], axis)
        return shapes

    def gather(self, local_id, tensors, axis, destination):
        if self.num_workers == 1:
            return self.local.gather(local_id, tensors, axis, destination)
        destination_worker, destination_local = divmod(destination, self.num_local)

        def work(local):
            shapes = self._gathered_shapes(local, axis, "ReplicaContext.gather", f" to replica {destination}")
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

    def all_gather_parts(self, local_id, tensors, axis):
        if self.num_workers == 1:
            return self.local.all_gather_parts(local_id, tensors, axis)

        def work(local):
            shapes = self._gathered_shapes(local, axis, "ReplicaContext.all_gather", "")
            results = [worker_ops.gather(self.group, [replica[i] for replica in local], [s[i] for s in shapes],
                                         axis, self.num_local) for i in range(len(tensors))]
            sizes = [[s[i][axis] for s in shapes] for i in range(len(tensors))]
            return [(r, sizes) for r in self._copies(results)]
        return self._on_first(local_id, tensors, "all_gather", work)

    def reduce_scatter(self, local_id, tensor, op, axis, sizes=None):
        check_mean([tensor], op)
        if self.num_workers == 1:
            return self.local.reduce_scatter(local_id, tensor, op, axis, sizes)

        def work(local):
            self._agree([[t] for t in local], "ReplicaContext.reduce_scatter",
                        f"with '{op.value.lower()}' along axis {_axis([local], axis)}", "same", shapes=False)
            if any((t.shape, t.dtype) != (local[0].shape, local[0].dtype) for t in local):
                raise InvalidArgumentError(
                    f"reduce_scatter needs the same shape and dtype on every replica, got "
                    f"{[(list(t.shape), str(t.dtype)) for t in local]}")
            check_axis(local[0], axis, "reduce_scatter")
            cut = self.scatter_sizes(local[0].shape[axis], sizes)
            total = self.local_sum(local) if len(local) > 1 else local[0]
            pieces = worker_ops.reduce_scatter(self.group, total, cut, axis, self.worker_index, self.num_local)
            if op is ReduceOp.MEAN:
                pieces = [p / self.num_replicas for p in pieces]
            return [p.to(self.devices[k].torch_device) for k, p in enumerate(pieces)]
        return self._on_first(local_id, tensor, "reduce_scatter", work)

    def broadcast(self, local_id, tensors, source):
        if self.num_workers == 1:
            return self.local.broadcast(local_id, tensors, source)
        source_worker, source_local = divmod(source, self.num_local)

        def work(local):
            meta = self._agree(local, "ReplicaContext.broadcast", f"from replica {source}", "count")
            mine = local[source_local] if self.worker_index == source_worker else None
            return self._copies(worker_ops.broadcast(self.group, mine, meta[source], source_worker,
                                                     self.devices[0].torch_device))
        return self._on_first(local_id, tensors, "broadcast", work)

    def all_to_all(self, local_id, tensors):
        if self.num_workers == 1:
            return self.local.all_to_all(local_id, tensors)

        def work(local):
            meta = self._agree(local, "ReplicaContext.all_to_all", "", "count")
            if any(len(replica) != self.num_replicas for replica in meta):
                raise InvalidArgumentError(f"all_to_all needs one tensor per replica ({self.num_replicas}) "
                                           f"from every replica, got {[len(replica) for replica in meta]}")
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
        source_worker, source_local = divmod(source, self.num_local)

        def work(local):
            meta = self._agree(local, "ReplicaContext.scatter", f"from replica {source}", "none")[source]
            if len(meta) != self.num_replicas:
                raise InvalidArgumentError(
                    f"the source replica of scatter must pass one tensor per replica ({self.num_replicas}), "
                    f"but replica {source} passed {len(meta)}")
            if len({dtype for _, dtype in meta}) > 1:
                raise InvalidArgumentError(
                    f"scatter across workers needs tensors of one dtype, got {sorted({str(d) for _, d in meta})}")
            mine = local[source_local] if self.worker_index == source_worker else None
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
            options = self.options
            packs = GradientPacks(params, self.group, bytes_per_pack=options.bytes_per_pack,
                                  codec=compression.codec(options.compression, num_workers=self.num_workers,
                                                          powersgd_rank=options.powersgd_rank,
                                                          powersgd_start_step=options.powersgd_start_step))
            self._packs[key] = packs
        return packs

    # -------------------------------------------------------- process level

    def worker_sums(self, tensors: list[torch.Tensor], what: str = "strategy.reduce", detail: str = "",
                    destination: int | None = None) -> list[torch.Tensor] | None:
        """New tensors: ``tensors`` summed over the workers, after one message that every worker
        checks (the same dtypes and shapes everywhere, else every worker raises). Up to
        ``agreement.inline_bytes`` ride in that message, summed in worker order on every worker;
        larger ones are all-reduced (``dist.reduce`` to worker ``destination`` if given: None on
        the others)."""
        if self.num_workers == 1:
            return list(tensors)
        call = agreement.Call(what, f"{detail} {agreement.note()}".strip(), [agreement.describe(tensors)])
        agreed = agreement.agree(self.group, call, values=tensors)
        if agreed.inline:
            results = agreement.summed(agreed.values, tensors)
        else:
            results = worker_ops.all_reduce(self.group, tensors, what, destination)
        return results if destination is None or destination == self.worker_index else None

    def worker_sum(self, tensor: torch.Tensor, what: str = "strategy.reduce") -> torch.Tensor:
        return tensor if self.num_workers == 1 else self.worker_sums([tensor], what)[0]

    def worker_gathers(self, tensors: list[torch.Tensor], axis: int, what: str = "strategy.gather") -> list[torch.Tensor]:
        """Each of ``tensors`` concatenated over the workers along ``axis`` (checked as an all-gather)."""
        if self.num_workers == 1:
            return list(tensors)
        shapes = self._gathered_shapes([tensors], axis, what, "")
        return [worker_ops.gather(self.group, [t], [s[i] for s in shapes], axis, 1).to(t.device)
                for i, t in enumerate(tensors)]

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


def _axis(local: list[list[torch.Tensor]], axis: int) -> int:
    """``axis`` counted from the front, as the first tensor has it (so -1 and 1 agree on 2-D tensors)."""
    ndim = local[0][0].dim() if local and local[0] else 0
    return axis % ndim if -ndim <= axis < ndim and ndim else axis
