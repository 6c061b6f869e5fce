"""The Collective among the replica threads of one process.

Every replica deposits its value with :class:`~stratagem.comm.sync.ReplicaSync`
and gets everyone's back (one barrier); the arithmetic then depends on the
cross-device op the strategy was configured with. All of them sum in replica order
(``((v0 + v1) + v2) + ...``) and divide once for MEAN, so on CPU they give
bit-identical results; they differ in who does the work:

- :class:`RangeCollective` (``HierarchicalCopyAllReduce``, the CPU default): the flat
  concatenation of all tensors is cut into ``num_packs`` packs and each pack into one
  range per replica, whose pieces are dealt to the replicas' threads by cost; each thread
  sums its pieces for everyone and copies the sums back (a reduce-scatter followed by an
  all-gather), so all threads work at once.
- :class:`OneDeviceCollective` (``ReductionToOneDevice``): local replica 0's thread
  sums everything on one device, then every replica's tensor receives a copy.
- :class:`NcclCollective` (``NcclAllReduce``): ``torch.cuda.nccl.all_reduce`` over the
  replicas' GPUs, tensors fused into ``num_packs`` flat buffers per dtype.
- :class:`~stratagem.comm.ring.RingCollective` (``RingAllReduce``): the ring, summing in
  ring order (bit-identical to the others for 1-2 replicas, within rounding beyond).
- :class:`~stratagem.comm.plugin.PluginCollective`: a user's ``CrossDeviceOps`` subclass.

``reduce_scatter`` is the same for all of them: each replica's thread sums its own slice
over every replica, in replica order (so it equals the matching slice of the all-reduce).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from stratagem.comm.collective import Collective, deal_pieces, range_bounds
from stratagem.comm.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                             ReductionToOneDevice)
from stratagem.comm.sync import ReplicaSync
from stratagem.devices import Device
from stratagem.errors import InvalidArgumentError
from stratagem.observe import flight
from stratagem.values import ReduceOp

_PIECE_ELEMENTS = 1 << 18  # pieces small enough that the copy-back still finds the sum in cache
_SMALL_ELEMENTS = 1 << 12  # an all-reduce this small is summed by every replica alone (``sums_small_alone``)


def sum_into(first: torch.Tensor, others: Sequence[torch.Tensor]) -> torch.Tensor:
    """``first += others``, in order."""
    for other in others:
        first.add_(other.to(first.device, non_blocking=True))
    return first


def _sum_in_order(everyone: list[list[torch.Tensor]], op: ReduceOp) -> list[torch.Tensor]:
    """Every replica's tensors summed in replica order (then divided once, for MEAN), as new tensors."""
    sums = []
    for i, first in enumerate(everyone[0]):
        acc = sum_into(first.clone(), [theirs[i] for theirs in everyone[1:]])
        if op is ReduceOp.MEAN:
            acc.div_(len(everyone))
        sums.append(acc)
    return sums


def check_mean(tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """A MEAN divides: it needs floating tensors (``ReplicaContext`` converts integers first)."""
    if op is ReduceOp.MEAN and any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
        raise InvalidArgumentError(
            "a MEAN all-reduce needs floating-point tensors; convert integers first (sg.get_replica_context()"
            ".all_reduce does, and returns a float)")


def nbytes_of(tensors: Sequence[torch.Tensor]) -> int:
    """How many bytes ``tensors`` hold (what the flight recorder says a sum moves)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class ReplicaCollective(Collective):
    """Replica threads of one process; subclasses hold one cross-device op's arithmetic
    (``reduce_in_place``), which :meth:`sum_exchanged` runs between the checks and the closing
    exchange that every op shares."""

    def __init__(self, devices: Sequence[Device], options: CrossDeviceOps):
        super().__init__(devices)
        self.options = options
        self.sync = ReplicaSync(self.num_local)
        self.peers = f"{self.num_local} replicas"   # how the flight recorder names them

    #: The cross-device op class this collective carries out (each subclass declares its own;
    #: ``CrossDeviceOps`` itself stands for every user subclass).
    serves: type | None = None
    #: whether a few values (a loss's row count, a metric) may be summed by every replica alone, on
    #: the CPU, in replica order -- what this op computes -- without a second meeting (no replica
    #: writes another's tensors, so none need wait for the others to finish reading its own)
    sums_small_alone = False

    @staticmethod
    def create(devices: Sequence[Device], options: CrossDeviceOps) -> "ReplicaCollective":
        """The collective that carries out ``options`` (a cross-device op) on ``devices``.

        Exactly one of stratagem's ops: its own arithmetic; any other subclass of
        ``CrossDeviceOps`` is a user's, carried by the collective that calls it. (The ring
        and the plug-in live in ``ring.py`` and ``plugin.py``, which ``stratagem.comm``
        imports.)
        """
        options.validate(tuple(devices))
        kinds = {}
        pending = list(ReplicaCollective.__subclasses__())
        while pending:
            kind = pending.pop()
            pending += kind.__subclasses__()
            if kind.serves is not None:
                kinds[kind.serves] = kind
        return kinds.get(type(options), kinds[CrossDeviceOps])(devices, options)

    # ------------------------------------------------------------ lifecycle

    def start_run(self) -> None:
        self.sync.reset()

    def abort(self) -> None:
        self.sync.abort()

    def finish(self, local_id: int) -> None:
        self.sync.finish(local_id)

    # ------------------------------------------------------------ primitives

    def exchange(self, local_id: int, value: Any, tag: str) -> list[Any]:
        return self.sync.exchange(local_id, value, tag)

    def exchange_all(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> list[Any]:
        return self.sync.exchange(local_id, tensors, tag)

    def all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
        check_mean(tensors, op)
        tensors = [t.clone() for t in tensors]
        everyone = self.sync.exchange(local_id, tensors, f"all_reduce({len(tensors)} tensors)")
        if self._sums_alone(everyone):
            self._check(everyone)   # (every replica checks the same lists: all raise alike)
            return _sum_in_order(everyone, op)
        self.sum_exchanged(local_id, everyone, op)
        return tensors

    def _sums_alone(self, everyone: list[list[torch.Tensor]]) -> bool:
        """Decided from replica 0's tensors, which every replica sees: the same answer on each."""
        first = everyone[0]
        return (self.sums_small_alone and len(everyone) > 1 and sum(t.numel() for t in first) <= _SMALL_ELEMENTS
                and all(t.device.type == "cpu" for e in everyone for t in e))

    def reduce_scatter(self, local_id: int, tensor: torch.Tensor, op: ReduceOp, axis: int,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        check_mean([tensor], op)
        everyone = self.sync.exchange(local_id, tensor, "reduce_scatter")
        self._check([[t] for t in everyone])
        sizes = self.scatter_sizes(tensor.shape[axis], sizes)
        start = sum(sizes[:local_id])
        device = self.devices[local_id].torch_device
        pieces = [t.narrow(axis, start, sizes[local_id]) for t in everyone]
        acc = pieces[0].to(device, copy=True)
        for piece in pieces[1:]:
            acc.add_(piece.to(device, non_blocking=True))  # in replica order, as the all-reduce
        if op is ReduceOp.MEAN:
            acc.div_(len(everyone))
        self.sync.exchange(local_id, None, "reduce_scatter:done")  # inputs stay untouched until all read
        return acc

    def sum_exchanged(self, local_id: int, everyone: list[list[torch.Tensor]], op: ReduceOp, *,
                      copy_back: bool = True) -> None:
        """The shapes checked, then this op's arithmetic; the replicas meet once more when it ends
        (the "done" exchange, reached even when the arithmetic fails), so no replica takes its
        tensors back while another still reads them. (The one shared frame that
        ``tests/test_frames.py`` allows on the way from backward to the sum.)"""
        if len(everyone) == 1:
            return
        self._check(everyone)
        seq = flight.begin("replica sum", nbytes_of(everyone[0]), self.peers) if local_id == 0 else 0
        try:
            self.reduce_in_place(local_id, everyone, op, copy_back)
        finally:
            self.sync.exchange(local_id, None, "all_reduce:done")
            if seq:
                flight.end(seq)

    def reduce_in_place(self, local_id: int, everyone: list[list[torch.Tensor]], op: ReduceOp,
                        copy_back: bool) -> None:
        """This replica's part of the sum (or MEAN) into the exchanged tensors (``copy_back=False``:
        replica 0's must hold it; the others' may)."""
        raise NotImplementedError

    def _check(self, everyone: list[list[torch.Tensor]]) -> None:
        first = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if len(theirs) != len(first) or any(a.shape != b.shape for a, b in zip(first, theirs)):
                raise InvalidArgumentError(
                    f"replica {r} passed tensors of shapes {[tuple(t.shape) for t in theirs]} to an "
                    f"all-reduce but replica 0 passed {[tuple(t.shape) for t in first]}; every "
                    f"replica must reduce tensors of the same shapes")
        if any(t.is_sparse for t in first):
            raise InvalidArgumentError("sparse tensors cannot be all-reduced across replicas; "
                                       "use dense gradients (e.g. nn.Embedding(sparse=False))")


class RangeCollective(ReplicaCollective):
    """``HierarchicalCopyAllReduce``: every replica thread reduces its own ranges."""

    serves = HierarchicalCopyAllReduce
    sums_small_alone = True

    def __init__(self, devices: Sequence[Device], options: HierarchicalCopyAllReduce):
        super().__init__(devices, options)
        self._plans: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}

    def _plan(self, numels: tuple[int, ...], n: int) -> list[list[tuple[int, int, int]]]:
        """For each replica, the (tensor index, start, stop) pieces of its ranges: each pack cut into
        one range per replica, each tensor's part of a range into pieces, and each pack's pieces dealt
        to the replicas by cost (:func:`~stratagem.comm.collective.deal_pieces`: a model's many small
        tensors spread over the threads), pack after pack."""
        plan = self._plans.get((n,) + numels)
        if plan is None:
            total, packs = sum(numels), self.options.num_packs
            pack_bounds = range_bounds(total, packs)
            plan = [[] for _ in range(n)]
            starts = list(itertools.accumulate(numels, initial=0))
            for pack_lo, pack_hi in zip(pack_bounds, pack_bounds[1:]):
                cut = range_bounds(pack_hi - pack_lo, n, pack_lo)
                pieces = [(i, start - offset, min(start + _PIECE_ELEMENTS, hi) - offset)
                          for i, (offset, numel) in enumerate(zip(starts, numels))
                          for range_lo, range_hi in zip(cut, cut[1:])
                          for lo, hi in [(max(range_lo, offset), min(range_hi, offset + numel))]
                          for start in range(lo, hi, _PIECE_ELEMENTS)]
                for piece, owner in zip(pieces, deal_pieces([stop - start for _, start, stop in pieces], n)):
                    plan[owner].append(piece)
            self._plans[(n,) + numels] = plan
        return plan

    def reduce_in_place(self, local_id, everyone, op, copy_back):
        n = len(everyone)
        groups = self._parts(local_id, everyone)
        if not groups:   # (its pieces all in tensors that other replicas reduce whole)
            return
        if all(part.device.type == "cpu" for parts in groups for part in parts):
            # the same additions in replica order, each one call over all of this thread's pieces
            # instead of one per piece: fewer turns at the GIL for the replica threads
            accs = [parts[0] for parts in groups]
            for r in range(1, n):
                torch._foreach_add_(accs, [parts[r] for parts in groups])
            if op is ReduceOp.MEAN:
                torch._foreach_div_(accs, n)
            if copy_back:
                for r in range(1, n):
                    torch._foreach_copy_([parts[r] for parts in groups], accs)
            return
        for pieces in groups:
            acc = pieces[0]
            for piece in pieces[1:]:
                acc.add_(piece.to(acc.device, non_blocking=True))
            if op is ReduceOp.MEAN:
                acc.div_(n)
            if copy_back:
                for piece in pieces[1:]:
                    piece.copy_(acc, non_blocking=True)

    def _parts(self, local_id: int, everyone: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Per piece of this replica's ranges, every replica's part of it."""
        n = len(everyone)
        groups = []
        for i, start, stop in self._plan(tuple(t.numel() for t in everyone[0]), n)[local_id]:
            if all(everyone[r][i].is_contiguous() for r in range(n)):
                groups.append([everyone[r][i].view(-1)[start:stop] for r in range(n)])
            elif start == 0:  # e.g. channels_last: no flat view, so reduce the whole tensor
                groups.append([everyone[r][i] for r in range(n)])
            # (else the replica holding this tensor's first element reduces all of it)
        return groups


class OneDeviceCollective(ReplicaCollective):
    """``ReductionToOneDevice``: one thread sums on one device; every replica gets a copy."""

    serves = ReductionToOneDevice
    sums_small_alone = True

    def reduce_in_place(self, local_id, everyone, op, copy_back):
        if local_id != 0:  # the others wait for replica 0 at the "done" exchange
            return
        n = len(everyone)
        target = self.options.reduce_to_device
        target = target.torch_device if target is not None else None
        for i, first in enumerate(everyone[0]):
            acc = first if target is None or first.device == target else first.to(target)
            for r in range(1, n):
                acc.add_(everyone[r][i].to(acc.device, non_blocking=True))
            if op is ReduceOp.MEAN:
                acc.div_(n)
            for r in range(n) if copy_back else range(1):
                if everyone[r][i] is not acc:
                    everyone[r][i].copy_(acc, non_blocking=True)


class NcclCollective(ReplicaCollective):
    """``NcclAllReduce``: ``torch.cuda.nccl.all_reduce`` over the replicas' GPUs.

    Tensors of one dtype are fused into ``num_packs`` flat buffers per GPU, each
    all-reduced with one NCCL call (the result is the same as tensor by tensor).
    """

    serves = NcclAllReduce

    def reduce_in_place(self, local_id, everyone, op, copy_back):
        if local_id != 0:  # one NCCL call drives every GPU
            return
        n = len(everyone)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(everyone[0]):
            by_dtype.setdefault(t.dtype, []).append(i)
        for indices in by_dtype.values():
            packs = self.options.num_packs
            for k in range(min(packs, len(indices))):
                chunk = indices[k * len(indices) // packs:(k + 1) * len(indices) // packs]
                flat = [torch.cat([everyone[r][i].reshape(-1) for i in chunk]) for r in range(n)]
                torch.cuda.nccl.all_reduce(flat)
                for r in range(n) if copy_back else range(1):
                    if op is ReduceOp.MEAN:
                        flat[r].div_(n)
                    offset = 0
                    for i in chunk:
                        t = everyone[r][i]
                        t.copy_(flat[r][offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
