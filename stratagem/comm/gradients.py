"""Cross-worker gradient summation: packs, launched while backward is still running.

Gradients are fused into packs (buckets) of about ``bytes_per_pack`` bytes, formed
in *reverse* parameter order because backward produces the last layers' gradients
first. ``ready(param)`` (called by the gradient sync's hook as soon as a parameter's
gradient is accumulated) copies it into its pack; when a pack is complete it is
all-reduced asynchronously. Packs are always launched in index order, so every
worker issues the same collectives in the same order (gloo and NCCL need that),
whatever order the hooks fire in.

``finish()`` (called when backward ends) launches the packs not yet launched, waits
only for what is still in flight, and makes each parameter's ``.grad`` the view of its
sum in the pack (no copy back, like DDP's ``gradient_as_bucket_view``). The gradient sync
copies such a view before the next backward refills the pack (``gradient_sync.py``).

Each pack carries one extra element per parameter: 1 where this worker has a
gradient. After the sum, a parameter whose flag is 0 had no gradient on any worker
and keeps ``grad=None``; elsewhere a missing gradient counts as zeros. A gradient
accumulated again after its pack was launched (several backward passes per step)
is noticed and its pack is reduced once more at ``finish()``, from the full local
gradient, so the result stays exact.

A DTensor parameter (tensor parallelism, summed over a mesh's data axis) takes the room of its
local shard in its pack; its gradient is laid out as the parameter first (torch gives a row-wise
Embedding's sharded weight a replicated gradient: this process's rows of it), and becomes a
DTensor over its slot of the sum (no copy: its ``.grad`` is a view of the pack, as a plain one is).

How a pack travels is its *codec*'s (:mod:`stratagem.comm.compression`): by default the buffer
itself, one all-reduce; with ``CommunicationOptions(compression=...)`` a half-precision copy, or
PowerSGD's two rounds. The first round leaves when the pack is complete, the others when
backward ends (``finish``), pack after pack in index order on every worker.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from stratagem.comm.compression import Exact
from stratagem.observe import flight
from stratagem.values import is_dtensor

DEFAULT_BYTES_PER_PACK = 25 << 20   # DistributedDataParallel's bucket_cap_mb
FIRST_PACK_BYTES = 1 << 20          # a small first pack starts communication early


class _Pack:
    __slots__ = ("params", "offsets", "slots", "buffer", "flags", "present", "filled", "work", "stale", "index",
                 "rounds", "coded", "seq")

    def __init__(self, params: list[torch.Tensor], index: int):
        self.params = params
        self.index = index
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += _local(p).numel()
        first = params[0]
        self.buffer = torch.zeros(offset + len(params), dtype=first.dtype, device=first.device)
        self.flags = self.buffer[offset:]
        #: each parameter's room in the buffer, shaped as its (local) gradient: made once
        self.slots = [self.buffer[start:start + local.numel()].view_as(local)
                      for start, local in zip(self.offsets, map(_local, params))]
        self.present = [0] * len(params)   # the flags, written into the buffer once, when it leaves
        self.filled = 0
        self.work: Any = None
        self.stale = False
        self.rounds: Any = None   # the codec's rounds once the first has left
        self.coded: Any = None    # the codec's own state for this pack
        self.seq = 0              # its record in the flight recorder, from launch to the end of its wait

    def slot(self, i: int) -> torch.Tensor:
        return self.slots[i]

    def fill(self, i: int) -> None:
        p = self.params[i]
        grad = p.grad
        if grad is None:
            self.slots[i].zero_()
            self.present[i] = 0
        else:
            if is_dtensor(grad):
                if grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                grad = grad.to_local()
            self.slots[i].copy_(grad)
            self.present[i] = 1

    def seal(self) -> None:
        """The flags into the buffer (one copy), before it leaves."""
        self.flags.copy_(torch.tensor(self.present, dtype=self.flags.dtype))

    def result(self, i: int) -> torch.Tensor:
        """The sum in slot ``i``, as the parameter's gradient."""
        p = self.params[i]
        if is_dtensor(p):
            from torch.distributed.tensor import DTensor   # (loaded: p is one)
            # over the slot itself, as a plain gradient is: one copy of the sum (the gradient sync copies
            # it, as it copies any view of a pack, before the next backward refills the pack)
            return DTensor.from_local(self.slots[i], p.device_mesh, p.placements, run_check=False)
        return self.slots[i]


class GradientPacks:
    """Sums the gradients of ``params`` over workers through ``group``."""

    def __init__(self, params: Sequence[torch.Tensor], group: Any, *, bytes_per_pack: int = 0,
                 codec: Any = None):
        self._group = group
        self._codec = Exact() if codec is None else codec
        cap = bytes_per_pack or DEFAULT_BYTES_PER_PACK
        first_cap = min(cap, FIRST_PACK_BYTES) if not bytes_per_pack else cap
        self.packs: list[_Pack] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (pack, index in pack)
        current: list[torch.Tensor] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                self._add_pack(current)
                current, size = [], 0
            current.append(p)  # like DDP: a pack closes once it reaches its size, not before
            size += _local(p).numel() * p.element_size()
            if size >= (first_cap if not self.packs else cap):
                self._add_pack(current)
                current, size = [], 0
        if current:
            self._add_pack(current)
        self._next_launch = 0

    def _add_pack(self, params: list[torch.Tensor]) -> None:
        for i, p in enumerate(params):
            self._where[id(p)] = (len(self.packs), i)
        self.packs.append(_Pack(params, len(self.packs)))

    def buffers(self) -> list[torch.Tensor]:
        """The packs' buffers (kept from step to step, as DDP's buckets are)."""
        return [pack.buffer for pack in self.packs]

    def covers(self, params: Sequence[torch.Tensor]) -> bool:
        return all(id(p) in self._where for p in params if p.requires_grad)

    # ---------------------------------------------------------------- backward

    def ready(self, param: torch.Tensor) -> None:
        k, i = self._where[id(param)]
        pack = self.packs[k]
        if pack.work is not None or k < self._next_launch:
            pack.stale = True  # accumulated again after launch: reduce again in finish()
            return
        pack.fill(i)
        pack.filled += 1
        if pack.filled == len(pack.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        group = self._group
        while self._next_launch < len(self.packs):
            pack = self.packs[self._next_launch]
            if pack.filled < len(pack.params):
                return
            pack.seal()
            pack.rounds = self._codec.rounds(pack)
            pack.seq = flight.begin("gradient all_reduce", pack.buffer.nbytes, group.peers)
            with group.guard("gradient all_reduce", record=False):
                pack.work = dist.all_reduce(next(pack.rounds), group=group.group, async_op=True)
            self._next_launch += 1

    # -------------------------------------------------------------------- step

    def finish(self) -> None:
        """Launch what backward did not, wait for everything, write the sums to ``.grad``."""
        group = self._group
        with group.guard("gradient all_reduce", record=False):
            for pack in self.packs[self._next_launch:]:  # in index order, like every worker
                for i in range(len(pack.params)):
                    pack.fill(i)
                pack.seal()
                pack.rounds = self._codec.rounds(pack)
                pack.seq = flight.begin("gradient all_reduce", pack.buffer.nbytes, group.peers)
                pack.work = dist.all_reduce(next(pack.rounds), group=group.group, async_op=True)
            for pack in self.packs:
                pack.work.wait()
                if pack.stale:   # the first round's sum is dropped: all of it again, from .grad
                    pack.rounds.close()
                    for i in range(len(pack.params)):
                        pack.fill(i)
                    pack.seal()
                    pack.rounds = self._codec.rounds(pack)
                for wire in pack.rounds:   # the codec's further rounds (or the first, summed again)
                    dist.all_reduce(wire, group=group.group)
                flight.end(pack.seq)
                present = pack.flags.tolist()
                for i, p in enumerate(pack.params):
                    if present[i] != 0:
                        # the sum becomes the gradient: a view of the pack, no copy back. The next
                        # backward sets it aside (a copy: the pack is refilled) or finds it None.
                        p.grad = pack.result(i)
                pack.work, pack.rounds, pack.filled, pack.stale = None, None, 0, False
        self._next_launch = 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor`` (a DTensor's local shard), outside autograd."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()
