"""One optimizer update per process, split between the replica threads.

For optimizers that act element by element (SGD, Adam, ...) one update can be split
between the replica threads of a CPU strategy: replica 0's flattened parameters are cut
into one range per thread, each tensor's part of a range is a piece, and thread ``r``
updates its pieces with the summed gradient, using one optimizer over views of them, then
copies their new values to the replicas whose parameters do not share replica 0's memory
(on logical CPU devices they all do, and nothing is copied). The optimizer state exists
once, and the threads share the work. Between threads (``balance=True``) the pieces are
dealt by cost, elements plus a fixed cost per piece (:func:`~stratagem.comm.collective.deal_pieces`):
a model's small tensors (biases, norm weights) sit at the end of its parameter groups, where
a cut into equal ranges of elements gives them all to the last thread. The cut stays where
it is and an element's update does not depend on which thread applies it, so dealing changes
no value. Across workers (ZeRO) thread ``r``'s pieces are range ``r``, the one its worker's
gradients were reduce-scattered to.

The user's optimizer keeps its hyperparameters (schedulers change them there); its
``state_dict()`` is assembled from the range optimizers, in the usual layout.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from stratagem.comm.collective import deal_pieces, range_bounds
from stratagem.placement.scope.hooks import base_of, internal_optimizers, unhooked_step

#: Optimizers whose update of an element depends only on that element's history.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adamax", "RMSprop", "NAdam", "RAdam", "Adadelta", "ASGD")
    if hasattr(torch.optim, name))

class ShardedUpdate:
    """Range optimizers of one distributed optimizer, one per local replica."""

    def __init__(self, optimizer: torch.optim.Optimizer, copies: Any, num_replicas: int, *,
                 entries: list[tuple[int, torch.Tensor]] | None = None, balance: bool = False):
        # (weakly: a pipeline keeps its ranges in a WeakKeyDictionary keyed by the optimizer)
        self._optimizer = weakref.ref(optimizer)
        base = base_of(optimizer)
        if entries is None:   # (group, parameter): every parameter; else those given
            entries = [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
        #: the tensors laid end to end: where each starts, the ranges' bounds
        self.offsets = list(itertools.accumulate((p.numel() for _, p in entries), initial=0))[:-1]
        self.bounds = bounds = range_bounds(sum(p.numel() for _, p in entries), num_replicas)
        self.pieces: list[list[tuple[int, int, nn.Parameter, int, int]]] = [[] for _ in range(num_replicas)]
        self.optimizers: list[torch.optim.Optimizer | None] = []
        self._copies = [copies(p) for _, p in entries]
        cut: list[tuple[int, tuple[int, int, nn.Parameter, int, int]]] = []   # (its range, piece), in order
        for index, ((g, p), offset) in enumerate(zip(entries, self.offsets)):
            for r in range(num_replicas):
                lo, hi = max(bounds[r], offset), min(bounds[r + 1], offset + p.numel())
                if lo < hi:
                    view = nn.Parameter(p.data.view(-1)[lo - offset:hi - offset], requires_grad=p.requires_grad)
                    cut.append((r, (index, g, view, lo - offset, hi - offset)))
        owners = deal_pieces([piece[4] - piece[3] for _, piece in cut], num_replicas) if balance else \
            [r for r, _ in cut]
        for owner, (_, piece) in zip(owners, cut):
            self.pieces[owner].append(piece)
        with internal_optimizers():  # range optimizers are not the user's: never adopted
            for r in range(num_replicas):
                groups: dict[int, list[nn.Parameter]] = {}
                for _, g, view, _, _ in self.pieces[r]:
                    groups.setdefault(g, []).append(view)
                self.optimizers.append(base([{**hyperparameters(optimizer.param_groups[g]), "params": views}
                                             for g, views in groups.items()]) if groups else None)
        self._base = base
        # copies that share replica 0's memory (logical CPU devices) need no copy back
        self._copies = [(c[0],) + tuple(t for t in c[1:] if t.data_ptr() != c[0].data_ptr())
                        for c in self._copies]
        self._group_of = [[g for g in dict.fromkeys(g for _, g, _, _, _ in self.pieces[r])]
                          for r in range(num_replicas)]

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer, devices: tuple) -> bool:
        if len(devices) < 2 or any(d.type == "cuda" for d in devices) or base_of(optimizer) not in ELEMENTWISE:
            return False
        return all(p.is_contiguous() and not p.is_sparse
                   for group in optimizer.param_groups for p in group["params"])

    def step(self, replica: int, grads: Any = None) -> None:
        """Update thread ``replica``'s pieces from replica 0's (summed) gradients; copy them to every replica.

        ``grads(index, start, stop)``, when given, supplies the gradient of each piece instead
        (a worker's shard of a reduce-scattered gradient)."""
        range_optimizer = self.optimizers[replica]
        if range_optimizer is None:
            return
        for group, g in zip(range_optimizer.param_groups, self._group_of[replica]):
            group.update(hyperparameters(self._optimizer().param_groups[g]))
        pieces = self.pieces[replica]
        for index, _, view, start, stop in pieces:
            if grads is not None:
                view.grad = grads(index, start, stop)
                continue
            grad = self._copies[index][0].grad
            view.grad = None if grad is None else grad.view(-1)[start:stop]
        unhooked_step(self._base)(range_optimizer)  # no user hooks: the logical step fires them once
        with torch.no_grad():
            for index, _, view, start, stop in pieces:
                view.grad = None
                for copy in self._copies[index][1:]:
                    copy.view(-1)[start:stop].copy_(view)

    # ------------------------------------------------------------ state dicts

    def state(self) -> dict[int, dict]:
        """The optimizer state per parameter index, as one optimizer would hold it."""
        return self.merge(self.parts(range(len(self.optimizers))))

    def parts(self, replicas: Any) -> dict[int, list[tuple[int, dict]]]:
        """The state of ranges ``replicas``: per parameter index, (start, state) pieces."""
        per_param: dict[int, list[tuple[int, dict]]] = {}
        for r in replicas:
            range_optimizer = self.optimizers[r]
            for index, _, view, start, _ in self.pieces[r]:
                state = range_optimizer.state.get(view) if range_optimizer is not None else None
                if state:
                    per_param.setdefault(index, []).append((start, state))
        return per_param

    def merge(self, per_param: dict[int, list[tuple[int, dict]]]) -> dict[int, dict]:
        """One optimizer's state per parameter index (in index order, as one optimizer's state dict
        lists it) from the pieces of every range."""
        result = {}
        for index, parts in sorted(per_param.items()):
            parts.sort(key=lambda part: part[0])
            shape = self._copies[index][0].shape
            merged = {}
            for key, first in parts[0][1].items():
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    merged[key] = torch.cat([state[key].reshape(-1) for _, state in parts]).view(shape).clone()
                else:
                    merged[key] = first.clone() if isinstance(first, torch.Tensor) else first
            result[index] = merged
        return result

    def load_state(self, state: dict, replicas: Any = None) -> None:
        """Give ranges ``replicas`` (default: all) their slices of one optimizer's ``state``."""
        for r, range_optimizer in enumerate(self.optimizers):
            if range_optimizer is None or (replicas is not None and r not in replicas):
                continue
            for index, _, view, start, stop in self.pieces[r]:
                entry = state.get(index, state.get(str(index)))
                if entry is None:
                    range_optimizer.state.pop(view, None)
                    continue
                range_optimizer.state[view] = {
                    key: (value.reshape(-1)[start:stop].to(view.device, copy=True) if isinstance(value, torch.Tensor)
                          and value.dim() > 0 else (value.clone() if isinstance(value, torch.Tensor) else value))
                    for key, value in entry.items()}


def hyperparameters(group: dict) -> dict:
    """An optimizer's parameter group without its parameters (what a range optimizer copies)."""
    return {k: v for k, v in group.items() if k != "params"}
