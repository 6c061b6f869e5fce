"""ZeRO's ranges over a data axis: one optimizer's update and state cut in one range per rank.

This process's parameters of an optimizer -- their local tensors: a tensor-parallel parameter's
shard; a pipeline's stages held elsewhere (``meta`` here) left out -- are laid end to end and cut
into one contiguous range per rank of the axis (the workers of ``MultiWorkerMirroredStrategy``,
the data axis of a ``PipelineStrategy``'s mesh). Rank ``r`` keeps the optimizer state of range
``r`` only (an optimizer of the user's class over views of that range, with the user's
hyperparameters at every step: :class:`~stratagem.placement.data_axis.sharded_update.ShardedUpdate`)
and updates only that range; the ranges are then all-gathered over the axis, so every rank again
holds its parameters whole.

- stage 1 (``"optimizer"``): each range's update reads its slice of ``.grad``, summed over the
  axis when backward ended (:mod:`~stratagem.placement.data_axis.gradient_sync`);
- stage 2 (``"gradients"``): each rank only receives the sum of its own range, either in packs
  launched during backward (``packs=True``: :mod:`stratagem.comm.scattered_gradients`, over
  workers) or reduce-scattered once when a pipeline's schedule ends (:meth:`ZeroRanges.reduce`,
  added to the range kept since the last step: several ``forward_backward`` calls accumulate);
  ``.grad`` is None until the step.

The state reads as one optimizer's: the ranges gathered over the axis, a DTensor's state made
whole over its own mesh (both collectives); ``load`` keeps this rank's range of a whole state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from stratagem.comm import worker_ops
from stratagem.comm.collective import Collective
from stratagem.comm.scattered_gradients import ScatteredGradients
from stratagem.errors import InvalidArgumentError
from stratagem.placement.data_axis.sharded_update import ELEMENTWISE, ShardedUpdate
from stratagem.placement.dtensor_state import local_gradient, local_tensor
from stratagem.placement.scope.hooks import base_of
from stratagem.values import is_dtensor

# (torch 2.13 names it *_single and deprecates the old name)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ZeroRanges:
    """One optimizer's own parameters over ``axis``, each rank updating its range (see the module doc).

    Example::

        import torch, stratagem as sg
        strategy = sg.MultiWorkerMirroredStrategy(sharding="optimizer")   # no cluster: one worker
        with strategy.scope():
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        ranges = strategy.placement.update.ranges(optimizer)   # ZeroUpdate's, built at first use
        assert ranges.bounds == [0, 3] and len(ranges.params) == 2 and ranges.scattered is None
    """

    def __init__(self, optimizer: torch.optim.Optimizer, axis: Collective, stage: str, *, between: str,
                 instead: str, packs: bool = False, bytes_per_pack: int = 0):
        self.axis, self.stage = axis, stage
        self.rank, size = axis.worker_index, axis.num_workers
        self.entries: list[tuple[int, int, torch.Tensor]] = []   # (index in the state dict, group, parameter)
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if not p.is_meta:
                    self.entries.append((index, g, p))
                index += 1
        self.params = [p for _, _, p in self.entries]
        # the memory each parameter's range views (a shard's), with its parameter's requires_grad
        self.locals = [local_tensor(p).requires_grad_(p.requires_grad) for p in self.params]
        check_splittable(base_of(optimizer), self.locals, stage, between, instead)
        self.sharded = ShardedUpdate(optimizer, lambda t: (t,), size,
                                     entries=[(g, t) for (_, g, _), t in zip(self.entries, self.locals)])
        self.offsets, self.bounds = self.sharded.offsets, self.sharded.bounds
        self.longest = max(self.bounds[r + 1] - self.bounds[r] for r in range(size))
        #: stage 2 over several ranks, in packs during backward (else reduced when a schedule ends)
        self.scattered = ScatteredGradients(self.params, self.offsets, self.bounds, self.rank, axis.group,
                                            bytes_per_pack=bytes_per_pack) \
            if packs and stage == "gradients" and size > 1 else None
        self.summed: tuple[torch.Tensor, list] | None = None   # stage 2: this range of the sum, kept

    # ---------------------------------------------------------------- step

    def step(self, reduced: bool) -> None:
        """Update this rank's range (from its range of the sum if ``reduced``, else from ``.grad``),
        then every range reaches every rank."""
        self.update(self.gradients(reduced))
        self.gather()

    def gradients(self, reduced: bool) -> Callable[[int, int, int], torch.Tensor | None]:
        """The gradient of each piece of this rank's range: ``grad_of(k, start, stop)``."""
        if not reduced:
            def grad_of(k: int, start: int, stop: int) -> torch.Tensor | None:
                param = self.params[k]
                return None if param.grad is None else local_gradient(param).view(-1)[start:stop]
            return grad_of
        if self.scattered is None and self.summed is not None and any(p.grad is not None for p in self.params):
            raise InvalidArgumentError(
                "gradients were accumulated into .grad (under strategy.no_sync(), or set by hand) after "
                "this step's gradients were reduce-scattered over the data axis (sharding='gradients'); "
                "run the step's last forward_backward outside no_sync (or call optimizer.zero_grad() "
                "before a new step)")
        shard, exists = self.reduced()
        self.summed = None
        lo = self.bounds[self.rank]

        def piece(k: int, start: int, stop: int) -> torch.Tensor | None:
            begin = self.offsets[k] + start - lo
            return shard[begin:begin + stop - start] if exists[k] else None
        return piece

    def update(self, grad_of: Callable[[int, int, int], torch.Tensor | None]) -> None:
        """This rank's range of the update (the user's hooks fire once, outside)."""
        self.sharded.step(self.rank, grad_of)

    def gather(self) -> None:
        """Every rank's updated range reaches every rank (an all-gather)."""
        if self.axis.num_workers > 1:
            gather_ranges(self.axis.group, self.sharded, self.rank, self.locals)

    def reduced(self) -> tuple[torch.Tensor, list]:
        """Stage 2: this rank's range of the gradients summed over the axis, and which parameters have
        a gradient on some rank (a collective). Packs: finished at the first ask of the step (clipping,
        else the step), kept until the step uses them; a later ask first adds what backward reduced
        since, if any rank has some. Else reduced now if no schedule did."""
        if self.scattered is None:
            if self.summed is None:
                self.reduce()
            return self.summed
        if self.summed is None:
            self.summed = self.scattered.finish()
            return self.summed
        pending = torch.tensor([int(self.scattered.pending())], dtype=torch.int32)
        if self.axis.group.all_reduce(pending, "gradients since clipping (sharding='gradients')").item():
            shard, exists = self.scattered.finish()
            self.summed[0].add_(shard)
            self.summed = (self.summed[0], [max(a, b) for a, b in zip(self.summed[1], exists)])
        return self.summed

    def reduce(self) -> None:
        """Stage 2 without packs, when a step's schedule ends (every rank): the gradients in ``.grad``
        reduce-scattered over the axis, this rank's range of the sum added to the one kept since the
        last step; ``.grad`` is dropped."""
        group = self.axis.group
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        if self.axis.num_workers > 1:
            group.all_reduce(present, "optimizer.step (which gradients exist on the data axis)")
        exists = [bool(v) for v in present.tolist()]
        flat = self.locals[0].new_zeros(self.bounds[-1]) if self.locals else torch.zeros(0)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                grad = local_gradient(p)
                flat[offset:offset + grad.numel()].copy_(grad.reshape(-1))
        if self.axis.num_workers == 1:
            shard = flat
        else:
            send = flat.new_zeros(self.axis.num_workers * self.longest, device=group.device)
            for r in range(self.axis.num_workers):
                a, b = self.bounds[r], self.bounds[r + 1]
                send[r * self.longest:r * self.longest + b - a].copy_(flat[a:b])
            out = flat.new_empty(self.longest, device=group.device)
            with group.guard("optimizer.step (gradients reduce-scattered over the data axis)"):
                _reduce_scatter(out, send, group=group.group)
            shard = out[:self.bounds[self.rank + 1] - self.bounds[self.rank]].to(flat.device)
        for p in self.params:
            p.grad = None   # the sum lives in the ranges now
        if self.summed is not None:   # an earlier forward_backward of the step: accumulate
            kept, known = self.summed
            shard = kept.add_(shard)
            exists = [a or b for a, b in zip(known, exists)]
        self.summed = (shard, exists)

    def pieces(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Clipping under stage 2: the pieces of this rank's range of the summed gradients that belong
        to ``params`` (scaled in place, kept for the step), each with its parameter; those of a
        parameter with no gradient on any rank left out (a collective: the packs finished now)."""
        shard, exists = self.reduced()
        chosen = {id(p) for p in params}
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        found = []
        for k, (p, offset) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, offset), min(hi, offset + self.locals[k].numel())
            if id(p) in chosen and exists[k] and a < b:
                found.append((p, shard[a - lo:b - lo]))
        return found

    def discard(self) -> None:
        """``zero_grad``: a range of the sum that no step used is dropped (and what packs reduced
        during a backward that no step followed)."""
        self.summed = None
        if self.scattered is not None:
            self.scattered.discard()

    # ---------------------------------------------------------- state dicts

    def state(self, what: str = "optimizer.state_dict (ranges over the data axis)") -> dict[int, dict]:
        """The state of this process's parameters, whole (a collective over the axis, and a DTensor's
        mesh), keyed by their index in the optimizer's state dict."""
        merged = gather_state(self.sharded, self.rank, self.axis, what)
        result = {}
        for k in sorted(merged):
            index, _, p = self.entries[k]
            result[index] = {key: _whole(value, p) for key, value in merged[k].items()}
        return result

    def load(self, state: dict) -> None:
        """Give this range its slices of one optimizer's whole ``state`` (keyed by index)."""
        held = {}
        for k in dict.fromkeys(k for k, _, _, _, _ in self.sharded.pieces[self.rank]):
            index, _, p = self.entries[k]
            entry = state.get(index, state.get(str(index)))
            if entry is not None:
                held[k] = {key: _local_part(value, p) for key, value in entry.items()}
        self.sharded.load_state(held, replicas=[self.rank])

    def state_bytes(self) -> int:
        """Bytes of per-element state (moments, momentum) this process holds: its range's."""
        range_optimizer = self.sharded.optimizers[self.rank]
        if range_optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for s in range_optimizer.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _whole(value: object, param: torch.Tensor) -> object:
    """A whole state tensor from this process's shard of the DTensor ``param``'s (else ``value``)."""
    if is_dtensor(param) and isinstance(value, torch.Tensor) and value.dim() > 0:
        from torch.distributed.tensor import DTensor   # (loaded: param is one)
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                  run_check=False).full_tensor()
    return value


def _local_part(value: object, param: torch.Tensor) -> object:
    """This process's shard of a whole state tensor shaped as the DTensor ``param`` (else ``value``)."""
    if is_dtensor(param) and isinstance(value, torch.Tensor) and value.dim() > 0:
        from torch.distributed.tensor import distribute_tensor   # (loaded: param is a DTensor)
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    return value


def check_splittable(base: type, tensors: list[torch.Tensor], stage: str, between: str, instead: str) -> None:
    """Refuse an optimizer class or tensors that ranges cannot split (``instead``: the other choices)."""
    if base not in ELEMENTWISE:
        raise InvalidArgumentError(
            f"sharding={stage!r} splits the update element-wise between {between}, which {base.__name__} does "
            f"not allow; use one of {sorted(c.__name__ for c in ELEMENTWISE)}{instead}")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1 or any(t.is_sparse or not t.is_contiguous() for t in tensors):
        raise InvalidArgumentError(
            f"sharding={stage!r} needs dense contiguous parameters of one dtype and device, got "
            f"{sorted(str(k) for k in kinds)}; use one dtype for the model{instead if between == 'workers' else ''}")


def gather_ranges(group: Any, sharded: ShardedUpdate, rank: int, tensors: list[torch.Tensor]) -> None:
    """Every rank's updated range of ``tensors`` (laid end to end as ``sharded``'s ranges cut them;
    ``rank`` updated its own) reaches every rank of ``group`` (an all-gather)."""
    views = [view.detach().reshape(-1) for _, _, view, _, _ in sharded.pieces[rank]]
    mine = torch.cat(views) if views else tensors[0].new_empty(0) if tensors else torch.empty(0)
    sizes = [(b - a,) for a, b in zip(sharded.bounds, sharded.bounds[1:])]
    full = worker_ops.gather(group, [mine], sizes, 0, 1)
    with torch.no_grad():
        for t, offset in zip(tensors, sharded.offsets):
            t.view(-1).copy_(full[offset:offset + t.numel()])


def gather_state(sharded: ShardedUpdate, rank: int, collective: Any, what: str) -> dict[int, dict]:
    """Every rank's range of the optimizer state (``rank``'s own here), merged as one optimizer's, by
    position in ``sharded``'s tensors (a collective over ``collective``'s workers)."""
    mine = {index: [(start, {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                             for k, v in state.items()}) for start, state in pieces]
            for index, pieces in sharded.parts([rank]).items()}
    everyone = [mine] if collective.num_workers == 1 else collective.all_gather_object(mine, what)
    merged: dict[int, list] = {}
    for worker in everyone:
        for index, pieces in worker.items():
            merged.setdefault(index, []).extend(pieces)
    return sharded.merge(merged)
