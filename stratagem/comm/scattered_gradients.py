"""Gradients summed over workers into each worker's range only, in packs launched during backward (ZeRO-2).

The parameters of a sharded optimizer are laid end to end; worker ``r`` owns the range
``[bounds[r], bounds[r + 1])`` of that concatenation. Packs are formed as in
:mod:`stratagem.comm.gradients` (reverse parameter order, about ``bytes_per_pack`` bytes,
a small first pack), so each pack is one contiguous span ``[lo, hi)`` of the concatenation.

During backward, a hook on each parameter adds its fresh gradient into its pack's buffer
and frees ``param.grad`` at once. When every parameter of a pack has a gradient, the pack
is launched: for each worker whose range meets the span, one asynchronous ``reduce`` of
that part to that worker. Before a new pack's buffer is made, the packs in flight are
waited for, so one pack travels while the next one fills. Packs launch in index order on every worker (gloo and NCCL need
the same collectives in the same order). A finished pack's own part is added to this
worker's range of the sum (``shard``) and the pack's buffer is dropped; so at any time a
worker holds the gradients of the packs still filling or in flight, and its range of the sum.

``finish()`` (the optimizer step) launches the packs backward did not complete (a parameter
unused on this worker, or gradients set by hand), waits, and all-reduces one flag per
parameter (which workers had a gradient) and one per pack (a gradient that arrived after its
pack was launched: several backward passes in one step). Late gradients are reduced once more,
on every worker alike, so the sum stays exact. ``discard()`` (``zero_grad``) drops a step's
gradients without updating.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from stratagem.comm.gradients import DEFAULT_BYTES_PER_PACK, FIRST_PACK_BYTES
from stratagem.errors import InvalidArgumentError


class _Span:
    __slots__ = ("indices", "lo", "hi", "fired", "buffer", "late", "works", "launched")

    def __init__(self, indices: list[int], lo: int, hi: int):
        self.indices = indices          # parameter positions, in the concatenation's order
        self.lo, self.hi = lo, hi
        self.fired = [False] * len(indices)
        self.buffer: torch.Tensor | None = None
        self.late: torch.Tensor | None = None
        self.works: list[tuple[int, int, int, Any]] = []
        self.launched = False


class ScatteredGradients:
    """Reduce-scatters the gradients of ``params`` (laid at ``offsets``) into worker ranges ``bounds``."""

    def __init__(self, params: Sequence[torch.Tensor], offsets: Sequence[int], bounds: Sequence[int],
                 rank: int, group: Any, *, bytes_per_pack: int = 0):
        self._params = list(params)
        self._offsets = list(offsets)
        self._bounds = list(bounds)
        self._rank = rank
        self._group = group
        first = self._params[0]
        self._dtype, self._device = first.dtype, first.device
        cap = bytes_per_pack or DEFAULT_BYTES_PER_PACK
        first_cap = min(cap, FIRST_PACK_BYTES) if not bytes_per_pack else cap
        self.spans: list[_Span] = []
        self._where: dict[int, tuple[int, int]] = {}   # id(param) -> (span, position in span)
        current: list[int] = []
        size = 0
        for index in reversed(range(len(self._params))):
            current.append(index)
            size += self._params[index].numel() * self._params[index].element_size()
            if size >= (first_cap if not self.spans else cap):
                self._add_span(current)
                current, size = [], 0
        if current:
            self._add_span(current)
        self._next_launch = 0
        self._shard: torch.Tensor | None = None
        self._reset()
        #: the most bytes of gradient buffers (packs filling or in flight, late ones, the range of
        #: the sum) held at once during the last step
        self.peak_bytes = 0
        self._peak = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self._params if p.requires_grad]
        self.closed = False

    def _add_span(self, reversed_indices: list[int]) -> None:
        indices = sorted(reversed_indices)
        lo = self._offsets[indices[0]]
        hi = self._offsets[indices[-1]] + self._params[indices[-1]].numel()
        for position, index in enumerate(indices):
            self._where[id(self._params[index])] = (len(self.spans), position)
        self.spans.append(_Span(indices, lo, hi))

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self._dtype, device=self._device)

    def _add(self, target: torch.Tensor, span: _Span, index: int, grad: torch.Tensor) -> None:
        start = self._offsets[index] - span.lo
        target[start:start + grad.numel()].add_(grad.reshape(-1))

    # ---------------------------------------------------------------- backward

    def _on_grad(self, param: torch.Tensor) -> None:
        k, position = self._where[id(param)]
        span = self.spans[k]
        index = span.indices[position]
        grad = param.grad
        if grad is None:
            return
        self._present[index] = 1
        if span.launched:   # accumulated again after its pack left: reduced once more in finish()
            if span.late is None:
                span.late = self._zeros(span.hi - span.lo)
            self._add(span.late, span, index, grad)
        else:
            if span.buffer is None:
                # before a new buffer, the packs in flight arrive and are dropped: at most one pack
                # travels while the next one fills (memory stays one pack + the range of the sum)
                for launched in self.spans[:self._next_launch]:
                    if launched.buffer is not None:
                        self._harvest(launched)
                span.buffer = self._zeros(span.hi - span.lo)
            self._add(span.buffer, span, index, grad)
            span.fired[position] = True
        param.grad = None   # the local gradient lives on in the pack only
        self._note_peak()
        if not span.launched and all(span.fired):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.spans) and all(self.spans[self._next_launch].fired):
            self._launch(self.spans[self._next_launch])
            self._next_launch += 1
        self._harvest_arrived()

    def _harvest_arrived(self) -> None:
        for span in self.spans[:self._next_launch]:
            if span.buffer is not None and all(w.is_completed() for *_, w in span.works):
                self._harvest(span)

    def _launch(self, span: _Span, buffer: torch.Tensor | None = None) -> None:
        if buffer is None:
            if span.buffer is None:
                span.buffer = self._zeros(span.hi - span.lo)
            buffer = span.buffer
        if self._shard is None:
            self._shard = self._zeros(self._bounds[self._rank + 1] - self._bounds[self._rank])
        group = self._group
        with group.guard("gradient reduce (sharding='gradients')"):
            for worker in range(len(self._bounds) - 1):
                a, b = max(span.lo, self._bounds[worker]), min(span.hi, self._bounds[worker + 1])
                if a < b:
                    work = dist.reduce(buffer[a - span.lo:b - span.lo], dst=group.global_rank(worker),
                                       group=group.group, async_op=True)
                    span.works.append((worker, a, b, work))
        span.launched = True

    def _harvest(self, span: _Span, buffer: torch.Tensor | None = None) -> None:
        """Wait for the span's reduces; add this worker's part to its range of the sum; drop the buffer."""
        buffer = span.buffer if buffer is None else buffer
        base = self._bounds[self._rank]
        with self._group.guard("gradient reduce (sharding='gradients')"):
            for worker, a, b, work in span.works:
                work.wait()
                if worker == self._rank:
                    self._shard[a - base:b - base].add_(buffer[a - span.lo:b - span.lo])
        span.works = []
        span.buffer = None

    def _note_peak(self) -> None:
        held = [s.buffer for s in self.spans] + [s.late for s in self.spans] + [self._shard]
        self._peak = max(self._peak, sum(t.numel() * t.element_size() for t in held if t is not None))

    # -------------------------------------------------------------------- step

    def finish(self) -> tuple[torch.Tensor, list[int]]:
        """This worker's range of the summed gradients, and for each parameter whether some
        worker had a gradient (a collective: every worker calls it once per step)."""
        if self.closed:
            raise InvalidArgumentError(
                "another optimizer was created in scope over these parameters since this one, and under "
                "sharding='gradients' the newest one takes their gradients during backward; step that "
                "one, or create one optimizer per parameter")
        for span in self.spans[self._next_launch:]:   # in index order, like every worker
            for position, index in enumerate(span.indices):
                grad = self._params[index].grad
                if not span.fired[position] and grad is not None:   # set by hand, not by backward
                    if span.buffer is None:
                        span.buffer = self._zeros(span.hi - span.lo)
                    self._add(span.buffer, span, index, grad)
                    self._present[index] = 1
                    self._params[index].grad = None
            self._note_peak()
            self._launch(span)
        for span in self.spans:
            self._harvest(span)
        flags = torch.tensor(self._present + [int(s.late is not None) for s in self.spans], dtype=torch.int32)
        self._group.all_reduce(flags, "optimizer.step (which gradients exist)")
        flags = flags.tolist()
        for k, span in enumerate(self.spans):   # late gradients: every worker reduces these spans again
            if flags[len(self._params) + k]:
                late = span.late if span.late is not None else self._zeros(span.hi - span.lo)
                self._launch(span, late)
                self._harvest(span, late)
        shard = self._shard if self._shard is not None else \
            self._zeros(self._bounds[self._rank + 1] - self._bounds[self._rank])
        self._note_peak()
        self.peak_bytes, self._peak = self._peak, 0
        self._reset()
        return shard, flags[:len(self._params)]

    def takes(self, param: torch.Tensor) -> bool:
        """Whether this (open) set of packs takes ``param``'s gradients during backward."""
        where = self._where.get(id(param))
        return not self.closed and where is not None and \
            self._params[self.spans[where[0]].indices[where[1]]] is param

    def pending(self) -> bool:
        """Whether gradients arrived since the last ``finish`` (on this worker: ask every worker)."""
        return any(self._present) or any(span.launched or span.buffer is not None or span.late is not None
                                          for span in self.spans) or any(p.grad is not None for p in self._params)

    def discard(self) -> None:
        """Drop this step's gradients (``zero_grad`` before a step): the other workers, which
        have gradients pending too, run the same collectives as ``finish``; nothing is kept."""
        if not self.closed and any(span.launched or span.buffer is not None for span in self.spans):
            self.finish()

    def _reset(self) -> None:
        for span in self.spans:
            span.fired = [not self._params[i].requires_grad for i in span.indices]
            span.buffer = span.late = None
            span.works, span.launched = [], False
        self._present = [0] * len(self._params)
        self._next_launch = 0
        self._shard = None

    def close(self) -> None:
        """Remove the hooks (a newer optimizer over the same parameters takes their gradients)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.closed = True
