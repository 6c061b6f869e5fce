"""How the replicas of one process combine tensors (TensorFlow's cross-device ops).

Every op is called on *every* replica's thread with that replica's list of tensors
and returns that replica's reduced tensors. All ops sum in replica order
(``((v0 + v1) + v2) + ...``) and divide once for MEAN, so on CPU they give
bit-identical results; they differ in who does the work:

- :class:`ReductionToOneDevice`: one thread sums everything on one device, then
  every replica copies the result.
- :class:`HierarchicalCopyAllReduce`: the flat concatenation of all tensors is cut
  into one range per replica; each replica's thread reduces its range for everyone
  (a reduce-scatter followed by an all-gather), so all threads work at once. The
  default on CPU.
- :class:`NcclAllReduce`: ``torch.cuda.nccl.all_reduce`` over the replicas' GPUs.
  CUDA only; the default when there are several GPUs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.comm.sync import ReplicaSync
from stratagem.devices import Device
from stratagem.errors import InvalidArgumentError
from stratagem.values import ReduceOp


class CrossDeviceOps:
    """Base class: ``all_reduce`` runs on every replica thread of one ``run``."""

    def validate(self, devices: Sequence[Device]) -> None:
        """Raise a clear error if this op cannot serve these devices."""

    def all_reduce(self, sync: ReplicaSync, replica_id: int, tensors: list[torch.Tensor],
                   op: ReduceOp, *, inplace: bool) -> list[torch.Tensor]:
        """Reduce ``tensors`` element-wise across replicas.

        With ``inplace=True`` the given tensors are overwritten with the result (the
        gradient path); otherwise the inputs are left alone and new tensors returned.
        """
        if not inplace:
            tensors = [t.clone() for t in tensors]
        everyone = sync.exchange(replica_id, tensors, f"all_reduce({len(tensors)} tensors)")
        self.reduce_exchanged(sync, replica_id, everyone, op)
        return tensors

    def reduce_exchanged(self, sync: ReplicaSync, replica_id: int,
                         everyone: list[list[torch.Tensor]], op: ReduceOp, *, copy_back: bool = True) -> None:
        """Reduce in place tensors that every replica has already deposited with ``sync``.

        With ``copy_back=False`` only replica 0's tensors are sure to hold the result.
        """
        if len(everyone) == 1:
            return
        first = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if len(theirs) != len(first) or any(a.shape != b.shape for a, b in zip(first, theirs)):
                raise InvalidArgumentError(
                    f"replica {r} passed tensors of shapes {[tuple(t.shape) for t in theirs]} to an "
                    f"all-reduce but replica 0 passed {[tuple(t.shape) for t in first]}; every "
                    f"replica must reduce tensors of the same shapes")
        try:
            self._reduce_all(everyone, replica_id, op, copy_back)
        finally:
            sync.exchange(replica_id, None, "all_reduce:done")

    def _reduce_all(self, everyone: list[list[torch.Tensor]], replica_id: int, op: ReduceOp,
                    copy_back: bool = True) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _sum_into(first: torch.Tensor, others: Sequence[torch.Tensor], op: ReduceOp, count: int) -> torch.Tensor:
    for other in others:
        first.add_(other.to(first.device, non_blocking=True))
    if op is ReduceOp.MEAN:
        if first.is_floating_point() or first.is_complex():
            first.div_(count)
        else:
            first.floor_divide_(count)
    return first


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, reduce there, copy the result back.

    ``reduce_to_device`` defaults to the first replica's device.

    Example::

        import stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.ReductionToOneDevice())
    """

    def __init__(self, reduce_to_device: "str | torch.device | None" = None):
        from stratagem.devices import parse_device

        self.reduce_to_device = None if reduce_to_device is None else parse_device(reduce_to_device)

    def _reduce_all(self, everyone, replica_id, op, copy_back=True):
        n = len(everyone)
        if replica_id == 0:
            target = self.reduce_to_device.torch_device if self.reduce_to_device else None
            for i, first in enumerate(everyone[0]):
                if first.is_sparse:
                    raise InvalidArgumentError("sparse tensors cannot be all-reduced across replicas; "
                                               "use dense gradients (e.g. nn.Embedding(sparse=False))")
                acc = first if target is None or first.device == target else first.to(target)
                _sum_into(acc, [everyone[r][i] for r in range(1, n)], op, n)
                for r in range(n) if copy_back else range(1):
                    if everyone[r][i] is not acc:
                        everyone[r][i].copy_(acc, non_blocking=True)
        # the other replicas wait for replica 0 at the "done" exchange

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device and str(self.reduce_to_device)!r})"


_PIECE_ELEMENTS = 1 << 18


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Each replica reduces one contiguous range of all tensors for everyone.

    The concatenation of every tensor is split into ``num_replicas`` ranges of equal
    size; the thread of replica ``r`` sums range ``r`` over all replicas (into replica
    0's tensor, in replica order) and copies the sum to the other replicas. All
    threads work at once and no temporary buffer is allocated.

    Example::

        import stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.HierarchicalCopyAllReduce())
    """

    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or num_packs < 1:
            raise InvalidArgumentError(f"num_packs must be a positive integer, got {num_packs!r}")
        self.num_packs = num_packs  # kept for TensorFlow compatibility; ranges replace packs
        self._plans: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}

    def _plan(self, numels: tuple[int, ...], n: int) -> list[list[tuple[int, int, int]]]:
        """For each replica, the (tensor index, start, stop) pieces of its range."""
        plan = self._plans.get((n,) + numels)
        if plan is None:
            total = sum(numels)
            bounds = [total * r // n for r in range(n + 1)]
            plan = [[] for _ in range(n)]
            offset = 0
            for i, numel in enumerate(numels):
                for r in range(n):
                    lo, hi = max(bounds[r], offset), min(bounds[r + 1], offset + numel)
                    # pieces small enough that the copy-back still finds the sum in cache
                    for start in range(lo, hi, _PIECE_ELEMENTS):
                        plan[r].append((i, start - offset, min(start + _PIECE_ELEMENTS, hi) - offset))
                offset += numel
            self._plans[(n,) + numels] = plan
        return plan

    def _reduce_all(self, everyone, replica_id, op, copy_back=True):
        n = len(everyone)
        mine = everyone[0]
        for t in mine:
            if t.is_sparse:
                raise InvalidArgumentError("sparse tensors cannot be all-reduced across replicas; "
                                           "use dense gradients (e.g. nn.Embedding(sparse=False))")
        plan = self._plan(tuple(t.numel() for t in mine), n)
        for i, start, stop in plan[replica_id]:
            if all(everyone[r][i].is_contiguous() for r in range(n)):
                pieces = [everyone[r][i].view(-1)[start:stop] for r in range(n)]
            elif start == 0:  # e.g. channels_last: no flat view, so reduce the whole tensor
                pieces = [everyone[r][i] for r in range(n)]
            else:
                continue  # the replica holding this tensor's first element reduces all of it
            acc = _sum_into(pieces[0], pieces[1:], op, n)
            if copy_back:
                for piece in pieces[1:]:
                    piece.copy_(acc, non_blocking=True)

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce over the replicas' GPUs with NCCL (``torch.cuda.nccl``).

    CUDA devices only: on CPU devices the strategy raises a clear error.

    Example::

        import stratagem as sg
        # on a machine with 2 GPUs:
        # s = sg.MirroredStrategy(["cuda:0", "cuda:1"], cross_device_ops=sg.NcclAllReduce())
    """

    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or num_packs < 1:
            raise InvalidArgumentError(f"num_packs must be a positive integer, got {num_packs!r}")
        self.num_packs = num_packs

    def validate(self, devices):
        if any(not d.is_cuda for d in devices):
            raise InvalidArgumentError(
                f"NcclAllReduce needs CUDA devices, but the replicas are on "
                f"{[str(d) for d in devices]}; on CPU use sg.HierarchicalCopyAllReduce() "
                f"(the default) or sg.ReductionToOneDevice()")
        if len(devices) > 1 and not torch.cuda.nccl.is_available(
                [torch.empty(1, device=d.torch_device) for d in devices]):
            raise InvalidArgumentError("NCCL is not available for these CUDA devices; use "
                                       "sg.HierarchicalCopyAllReduce() instead")

    def _reduce_all(self, everyone, replica_id, op, copy_back=True):
        if replica_id != 0:
            return
        n = len(everyone)
        for i in range(len(everyone[0])):
            inputs = [everyone[r][i] for r in range(n)]
            flat = [t if t.is_contiguous() else t.contiguous() for t in inputs]
            torch.cuda.nccl.all_reduce(flat)
            for t, f in zip(inputs, flat):
                if op is ReduceOp.MEAN:
                    f.div_(n) if f.is_floating_point() else f.floor_divide_(n)
                if f is not t:
                    t.copy_(f)

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"


def default_cross_device_ops(devices: Sequence[Device]) -> CrossDeviceOps:
    """NCCL between several GPUs where it works, else the parallel hierarchical copy."""
    if len(devices) > 1 and all(d.is_cuda for d in devices):
        try:
            op = NcclAllReduce()
            op.validate(devices)
            return op
        except InvalidArgumentError:
            pass
    return HierarchicalCopyAllReduce()
