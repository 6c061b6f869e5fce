"""``RingAllReduce``: the bandwidth-optimal ring among the replica threads of one process.

The tensors every replica deposited are seen as one flat buffer cut into ``N`` chunks
(a tensor that has no flat view, e.g. channels-last, is one indivisible piece of the
chunk holding its first element). Replica ``r``'s neighbour on the left is ``r - 1``
(mod ``N``); "receiving" from it means reading its buffer, which the threads share.

1. reduce-scatter, steps ``s = 0 .. N-2``: replica ``r`` adds its left neighbour's
   chunk ``r - 1 - s`` into its own. No chunk is written by one replica and read by
   another in the same step, so one barrier per step suffices. Replica ``r`` ends
   holding the full sum of chunk ``r + 1``, accumulated in ring order starting at
   replica ``r + 1``; a MEAN divides it there, once.
2. all-gather, steps ``s = 0 .. N-2``: replica ``r`` copies chunk ``r - s`` from its
   left neighbour.

Each replica reads ``2 (N - 1) / N`` of the data, the lower bound for an all-reduce.
"""

from __future__ import annotations

import torch

from stratagem.comm.collective import range_bounds
from stratagem.comm.cross_device_ops import RingAllReduce
from stratagem.comm.replicas import ReplicaCollective, nbytes_of
from stratagem.observe import flight
from stratagem.values import ReduceOp

Piece = tuple[int, "int | None", "int | None"]  # (tensor index, start, stop); None: the whole tensor


def _piece(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    _, start, stop = piece
    return t if start is None else t.view(-1)[start:stop]


class RingCollective(ReplicaCollective):
    """The ring: a reduce-scatter then an all-gather, ``N - 1`` neighbour steps each."""

    serves = RingAllReduce

    def __init__(self, devices, options):
        super().__init__(devices, options)
        self._plans: dict[tuple, list[list[Piece]]] = {}

    def _plan(self, everyone: list[list[torch.Tensor]]) -> list[list[Piece]]:
        n = len(everyone)
        flat = tuple(all(e[i].is_contiguous() for e in everyone) for i in range(len(everyone[0])))
        key = (n, flat) + tuple(t.numel() for t in everyone[0])
        plan = self._plans.get(key)
        if plan is None:
            numels = tuple(t.numel() for t in everyone[0])
            total = sum(numels)
            bounds = range_bounds(total, n)
            plan = [[] for _ in range(n)]
            offset = 0
            for i, numel in enumerate(numels):
                if numel and not flat[i]:
                    owner = max(c for c in range(n) if bounds[c] <= offset)
                    plan[owner].append((i, None, None))
                else:
                    for c in range(n):
                        lo, hi = max(bounds[c], offset), min(bounds[c + 1], offset + numel)
                        if lo < hi:
                            plan[c].append((i, lo - offset, hi - offset))
                offset += numel
            self._plans[key] = plan
        return plan

    def sum_exchanged(self, local_id, everyone, op, *, copy_back=True):
        """Not the shared frame: the ring's own exchanges close it (the last all-gather step is
        the final barrier), and a replica that fails leaves the others to the abort."""
        n = len(everyone)
        if n == 1:
            return
        self._check(everyone)
        exchange = self.sync.exchange
        seq = flight.begin("replica sum (ring)", nbytes_of(everyone[0]), self.peers) if local_id == 0 else 0
        chunks = self._plan(everyone)
        mine, left = everyone[local_id], everyone[(local_id - 1) % n]
        for step in range(n - 1):
            last = step == n - 2
            for piece in chunks[(local_id - 1 - step) % n]:  # at the last step: the chunk this replica owns
                target = _piece(mine[piece[0]], piece)
                target.add_(_piece(left[piece[0]], piece).to(target.device, non_blocking=True))
                if last and op is ReduceOp.MEAN:
                    target.div_(n)
            exchange(local_id, None, "ring reduce-scatter")
        for step in range(n - 1):
            for piece in chunks[(local_id - step) % n]:
                _piece(mine[piece[0]], piece).copy_(_piece(left[piece[0]], piece), non_blocking=True)
            exchange(local_id, None, "ring all-gather")
        if seq:
            flight.end(seq)
