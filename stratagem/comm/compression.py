"""Gradient compression between workers: how a pack of gradients travels (opt-in, inexact).

:class:`~stratagem.comm.gradients.GradientPacks` sums each pack over the workers. A *codec*
says how: ``codec.rounds(pack)`` is a generator that yields the tensors to all-reduce (SUM, in
place), one per round, and reads each sum when it is resumed; when it ends, ``pack.buffer``
holds the (approximate) sum. Every worker runs the same rounds in the same order. The packs
launch the first round while backward runs and the others when it ends; a generator keeps the
codec's own frames off the stack while torch.distributed works (``tests/test_frames.py``).
A codec commits its state (PowerSGD's residual and ``Q``) only after its last round, so a pack
whose rounds are dropped after the first (a gradient that arrived after launch: the pack is
summed again) leaves no trace. What a codec reads of a pack: ``buffer`` (every gradient end to
end, then one presence flag per parameter: ``flags``), ``params``, ``offsets`` and ``slot(i)``
(parameter ``i``'s gradient in the buffer), ``index`` (its place among the packs); it keeps its
own state for the pack in ``coded``.

- :class:`Exact` (the default): the pack's buffer, as it is. One round.
- :class:`LowPrecision` (``"bf16"``, ``"fp16"``): a half-precision copy of the buffer is summed
  and cast back. bfloat16 has float32's range and 8 bits of mantissa: each worker's gradient
  is rounded once, and the sum is rounded at each addition of the collective (with 2 workers
  the result is exactly ``bf16(bf16(g0) + bf16(g1))``). float16 has 11 bits but overflows above
  65504: as DistributedDataParallel's ``fp16_compress_hook`` does, each gradient is divided by
  the number of workers before the cast (so the sum is an average, no larger than the largest
  gradient), and the sum is multiplied back in the pack's own dtype; values below float16's
  smallest subnormal (6e-8 after the division) become 0. Packs of float32 and float64 are
  compressed; others (half precision already, complex) travel exactly.
- :class:`PowerSGD` (``"powersgd"``, Vogels et al. 2019): each matrix-shaped gradient ``G``
  (``n x m``: the first dimension by the rest, a convolution's kernel flattened) for which
  rank ``r`` saves at least half the bytes, ``2 r (n + m) <= n m``, travels as two thin
  matrices. ``M = G + E`` (``E``, the residual: what earlier steps' approximations missed on
  this worker, the *error feedback*); round 1 sums ``P = M Q`` together with every
  uncompressed gradient of the pack (vectors, small matrices, the presence flags) exactly;
  ``P`` is orthonormalized (Gram-Schmidt, the same on every worker: its input is the sum);
  round 2 sums ``Q = M^T P``; the sum of the workers' gradients is approximated by ``P Q^T``,
  and ``E`` becomes ``M - P (M^T P)^T``, this worker's part that the approximation missed. The
  summed ``Q``, orthonormalized, is the next step's starting point (warm start: one step of
  subspace iteration per training step; not orthonormalized, its columns would all turn towards
  the first singular vector, rank 1 in effect); the first ``Q`` is drawn from a fixed seed per
  parameter and orthonormalized, so every worker starts alike.
  Where no worker has a gradient for a parameter, its residual is kept whole. With
  ``powersgd_start_step`` k, each pack's first k sums are exact (one round, as :class:`Exact`),
  as DistributedDataParallel's ``start_powerSGD_iter`` does: the residuals start at zero when
  PowerSGD does, and the first ``Q`` is the seeded one.

The residuals, ``Q`` and the count of exact sums live in the process only: a checkpoint does not
hold them, and a restored job starts with zero residuals and seeded ``Q`` (it forgets at most one
step's approximation error), and sums its first ``powersgd_start_step`` steps exactly again.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

#: the first ``Q`` of the matrix at position ``i`` of pack ``k`` is drawn from seed ``SEED + 1000 k + i``
SEED = 20191013
_COMPRESSIBLE = (torch.float32, torch.float64)


class Exact:
    """The sum as it is: the pack's buffer, one round."""

    def rounds(self, pack: Any) -> Iterator[torch.Tensor]:
        yield pack.buffer


class LowPrecision:
    """``"bf16"`` / ``"fp16"``: the buffer travels in half precision (module docstring)."""

    def __init__(self, name: str, num_workers: int):
        self.dtype = torch.bfloat16 if name == "bf16" else torch.float16
        # float16 overflows above 65504: divide by the number of workers first (DDP's fp16 hook)
        self.scale = 1 if name == "bf16" else num_workers

    def rounds(self, pack: Any) -> Iterator[torch.Tensor]:
        buffer = pack.buffer
        if buffer.dtype not in _COMPRESSIBLE:
            yield buffer
            return
        wire = pack.coded   # (the pack's half-precision buffer)
        if wire is None:
            wire = pack.coded = torch.empty(buffer.shape, dtype=self.dtype, device=buffer.device)
        if self.scale != 1:
            buffer.div_(self.scale)   # (the buffer is overwritten by the sum, or refilled)
        wire.copy_(buffer)
        yield wire
        buffer.copy_(wire)
        if self.scale != 1:
            buffer.mul_(self.scale)


class _Matrix:
    """One compressed gradient of a pack: its slot viewed as ``n x m``, and its state."""

    __slots__ = ("index", "n", "m", "rank", "q", "residual")

    def __init__(self, index: int, n: int, m: int, rank: int, seed: int, like: torch.Tensor):
        self.index, self.n, self.m, self.rank = index, n, m, rank
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(m, rank, generator=generator, dtype=torch.float64).to(like.device, like.dtype)
        _orthonormalize(self.q)
        self.residual: torch.Tensor | None = None


class _Plan:
    """Which gradients of a pack are compressed; where everything sits in the two rounds' tensors."""

    def __init__(self, pack: Any, rank: int):
        self.matrices: list[_Matrix] = []
        exact: list[tuple[int, int]] = []   # (start, stop) in pack.buffer, sent as they are
        buffer = pack.buffer
        for i in range(len(pack.params)):
            slot = pack.slot(i)
            start, size = pack.offsets[i], slot.numel()
            n = slot.shape[0] if slot.dim() >= 2 else 0
            m = size // n if n else 0
            r = min(rank, n, m)
            if buffer.dtype in _COMPRESSIBLE and n and 2 * r * (n + m) <= n * m:
                self.matrices.append(_Matrix(i, n, m, r, SEED + 1000 * pack.index + i, buffer))
            else:
                _extend(exact, start, start + size)
        _extend(exact, buffer.numel() - len(pack.params), buffer.numel())   # the presence flags
        self.exact = exact
        self.exact_numel = sum(b - a for a, b in exact)
        self.p_numel = sum(x.n * x.rank for x in self.matrices)
        self.q_numel = sum(x.m * x.rank for x in self.matrices)
        self.exact_sums = 0   # the sums made exactly before PowerSGD starts (``powersgd_start_step``)
        self.first = torch.empty(self.exact_numel + self.p_numel, dtype=buffer.dtype, device=buffer.device)
        self.second = torch.empty(self.q_numel, dtype=buffer.dtype, device=buffer.device)


class PowerSGD:
    """``"powersgd"``: rank-``rank`` approximations with error feedback (module docstring), after
    ``start_step`` exact sums of each pack."""

    def __init__(self, rank: int, start_step: int = 0):
        self.rank, self.start_step = rank, start_step

    def rounds(self, pack: Any) -> Iterator[torch.Tensor]:
        plan = pack.coded   # (its plan and state)
        if plan is None:
            plan = pack.coded = _Plan(pack, self.rank)
        if not plan.matrices:
            yield pack.buffer
            return
        if plan.exact_sums < self.start_step:
            yield pack.buffer
            plan.exact_sums += 1   # (once the sum is read: a pack summed again counts once)
            return
        buffer, first, second = pack.buffer, plan.first, plan.second
        ms, ps, qs = [], [], []
        offset, q_offset = plan.exact_numel, 0
        for x in plan.matrices:
            ms.append(pack.slot(x.index).view(x.n, x.m))
            ps.append(first[offset:offset + x.n * x.rank].view(x.n, x.rank))
            qs.append(second[q_offset:q_offset + x.m * x.rank].view(x.m, x.rank))
            offset += x.n * x.rank
            q_offset += x.m * x.rank
        _gather(buffer, plan.exact, first)
        for x, m, p in zip(plan.matrices, ms, ps):
            if x.residual is not None:
                m.add_(x.residual)   # M = G + E, in the pack (refilled from .grad if it is summed again)
            torch.matmul(m, x.q, out=p)
        yield first   # round 1: the exact part and every P
        _scatter(first, plan.exact, buffer)
        present = pack.flags.tolist()
        for x, m, p, q in zip(plan.matrices, ms, ps, qs):
            _orthonormalize(p)
            torch.matmul(m.T, p, out=q)
            if x.residual is None:
                x.residual = torch.empty_like(m)
            if present[x.index] == 0:   # no worker has a gradient: nothing is applied, keep all of it
                x.residual.copy_(m)
            else:
                torch.addmm(m, p, q.T, alpha=-1, out=x.residual)   # E = M - P (M^T P)^T, this worker's miss
        yield second   # round 2: every Q
        for x, m, p, q in zip(plan.matrices, ms, ps, qs):
            torch.matmul(p, q.T, out=m)
            x.q.copy_(q)   # the next step's warm start, the same on every worker, orthonormal: without it
            _orthonormalize(x.q)   # the power iteration turns every column to the first singular vector


def _extend(ranges: list[tuple[int, int]], start: int, stop: int) -> None:
    """Add ``[start, stop)`` to ``ranges``, merged with the last range where they touch."""
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], stop)
    elif stop > start:
        ranges.append((start, stop))


def _gather(buffer: torch.Tensor, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
    offset = 0
    for start, stop in ranges:
        out[offset:offset + stop - start].copy_(buffer[start:stop])
        offset += stop - start


def _scatter(source: torch.Tensor, ranges: list[tuple[int, int]], buffer: torch.Tensor) -> None:
    offset = 0
    for start, stop in ranges:
        buffer[start:stop].copy_(source[offset:offset + stop - start])
        offset += stop - start


def _orthonormalize(p: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``p``, in place; a zero column stays zero."""
    tiny = torch.finfo(p.dtype).tiny
    for j in range(p.shape[1]):
        column = p[:, j]
        if j:
            before = p[:, :j]
            column.sub_(before @ (before.T @ column))
        column.div_(column.norm().clamp_min(tiny))


def codec(compression: str | None, *, num_workers: int, powersgd_rank: int | None = None,
          powersgd_start_step: int | None = None) -> Any:
    """The codec of ``CommunicationOptions.compression`` (checked there)."""
    if compression is None:
        return Exact()
    if compression == "powersgd":
        return PowerSGD(powersgd_rank or 1, powersgd_start_step or 0)
    return LowPrecision(compression, num_workers)
