"""ZeRO stages 1 and 2 over the data axis of a pipeline's mesh: one optimizer's update cut in ranges.

Under ``PipelineStrategy(sharding="optimizer" | "gradients")`` the processes of one data-axis
group hold the same stages (and, with a model axis, the same shards). This process's own
parameters -- the local tensors: a tensor-parallel parameter's shard -- are laid end to end and
cut into one contiguous range per data rank. Data rank ``r`` keeps the optimizer state of range
``r`` only (an optimizer of the user's class over views of that range, with the user's
hyperparameters at every step) and updates only that range; the ranges are then all-gathered
over the data axis, so every process again holds its stages whole.

- ``"optimizer"`` (ZeRO-1): the gradients are summed over the data axis when the schedule ends
  (all-reduce, :mod:`~stratagem.placement.data_axis.gradient_sync`), as without sharding; each range's
  update reads its slice of the sum.
- ``"gradients"`` (ZeRO-2): the gradients are reduce-scattered instead when the schedule ends
  (:meth:`DataAxisZero.reduce`): each data rank receives the sum of its range only, added to the
  range kept since the last step (several ``forward_backward`` calls accumulate), and ``.grad``
  is dropped (None until the step, as under ``MultiWorkerMirroredStrategy(sharding="gradients")``).
  A pipeline accumulates every micro-batch's gradient before that, so each process holds its
  stages' whole (unsummed) gradient until the schedule ends: stage 2 saves the summed copy and
  half the all-reduce, not the local gradient.

The optimizer's state dict reads as one optimizer's over the whole model: the ranges are
gathered over the data axis, a shard's state made whole over the model axis (both
collectives); ``load`` keeps this process's range of a whole state.

The ranges are those of ZeRO over workers (:mod:`stratagem.placement.data_axis.zero`): a
:class:`~stratagem.placement.data_axis.sharded_update.ShardedUpdate`, its parameters and state gathered by
the same functions. What differs is what is cut (this process's local tensors, the stages held
elsewhere left out) and when stage 2 sums: once when the schedule ends, where
``MultiWorkerMirroredStrategy``'s packs leave during backward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping
from stratagem.placement.layout.dtensor_state import local_gradient, local_tensor
from stratagem.placement.scope.hooks import base_of
from stratagem.placement.data_axis.sharded_update import ShardedUpdate
from stratagem.placement.data_axis.zero import check_splittable, gather_ranges, gather_state

# (torch 2.13 names it *_single and deprecates the old name)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DataAxisZero:
    """One optimizer's own parameters, each data rank updating its range (see the module doc): the
    ranges of :class:`~stratagem.placement.data_axis.sharded_update.ShardedUpdate` over this process's local
    tensors, gathered as :mod:`stratagem.placement.data_axis.zero` gathers them over workers."""

    def __init__(self, optimizer: torch.optim.Optimizer, data: Collective, stage: str):
        self.data, self.stage = data, stage
        self.rank, size = data.worker_index, data.num_workers
        self.entries: list[tuple[int, int, torch.Tensor]] = []   # (index in the state dict, group, parameter)
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if not p.is_meta:
                    self.entries.append((index, g, p))
                index += 1
        # the memory each parameter's range views (a shard's), with its parameter's requires_grad
        self.locals = [local_tensor(p).requires_grad_(p.requires_grad) for _, _, p in self.entries]
        check_splittable(base_of(optimizer), self.locals, stage, "the data ranks", " or sharding=None / 'parameters'")
        self.sharded = ShardedUpdate(optimizer, lambda t: (t,), size,
                                     entries=[(g, t) for (_, g, _), t in zip(self.entries, self.locals)])
        self.offsets, self.bounds = self.sharded.offsets, self.sharded.bounds
        self.longest = max(self.bounds[r + 1] - self.bounds[r] for r in range(size))
        self.summed: tuple[torch.Tensor, list[bool]] | None = None   # stage 2: this range of the sum, kept

    # ---------------------------------------------------------------- step

    def step(self) -> None:
        """Update this data rank's range (from the summed gradients, or the reduce-scattered range),
        then every range reaches every data rank."""
        if self.stage == "gradients":
            if self.summed is not None and any(p.grad is not None for _, _, p in self.entries):
                raise InvalidArgumentError(
                    "gradients were accumulated into .grad (under strategy.no_sync(), or set by hand) after "
                    "this step's gradients were reduce-scattered over the data axis (sharding='gradients'); "
                    "run the step's last forward_backward outside no_sync (or call optimizer.zero_grad() "
                    "before a new step)")
            shard, exists = self.reduced()
            self.summed = None
            lo = self.bounds[self.rank]

            def grad_of(k: int, start: int, stop: int) -> torch.Tensor | None:
                begin = self.offsets[k] + start - lo
                return shard[begin:begin + stop - start] if exists[k] else None
        else:
            def grad_of(k: int, start: int, stop: int) -> torch.Tensor | None:
                param = self.entries[k][2]
                return None if param.grad is None else local_gradient(param).view(-1)[start:stop]
        self.sharded.step(self.rank, grad_of)   # the user's hooks fire once, outside
        if self.data.num_workers > 1:
            gather_ranges(self.data.group, self.sharded, self.rank, self.locals)

    def reduced(self) -> tuple[torch.Tensor, list[bool]]:
        """Stage 2: this data rank's range of the gradients summed over the data axis, and which
        parameters have a gradient on some data rank (reduced now if no schedule did: a collective)."""
        if self.summed is None:
            self.reduce()
        return self.summed

    def reduce(self) -> None:
        """Stage 2, when a step's schedule ends (every data rank): the gradients in ``.grad``
        reduce-scattered over the data axis, this data rank's range of the sum added to the one kept
        since the last step; ``.grad`` is dropped."""
        group = self.data.group
        present = torch.tensor([p.grad is not None for _, _, p in self.entries], dtype=torch.int32)
        if self.data.num_workers > 1:
            group.all_reduce(present, "optimizer.step (which gradients exist on the data axis)")
        exists = [bool(v) for v in present.tolist()]
        flat = self.locals[0].new_zeros(self.bounds[-1]) if self.locals else torch.zeros(0)
        for (_, _, p), offset in zip(self.entries, self.offsets):
            if p.grad is not None:
                grad = local_gradient(p)
                flat[offset:offset + grad.numel()].copy_(grad.reshape(-1))
        if self.data.num_workers == 1:
            shard = flat
        else:
            send = flat.new_zeros(self.data.num_workers * self.longest, device=group.device)
            for r in range(self.data.num_workers):
                a, b = self.bounds[r], self.bounds[r + 1]
                send[r * self.longest:r * self.longest + b - a].copy_(flat[a:b])
            out = flat.new_empty(self.longest, device=group.device)
            with group.guard("optimizer.step (gradients reduce-scattered over the data axis)"):
                _reduce_scatter(out, send, group=group.group)
            shard = out[:self.bounds[self.rank + 1] - self.bounds[self.rank]].to(flat.device)
        for _, _, p in self.entries:
            p.grad = None   # the sum lives in the ranges now
        if self.summed is not None:   # an earlier forward_backward of the step: accumulate
            kept, known = self.summed
            shard = kept.add_(shard)
            exists = [a or b for a, b in zip(known, exists)]
        self.summed = (shard, exists)

    def parts(self, params: list[torch.Tensor], counts: Callable[[torch.Tensor], bool]) -> clipping.GradientParts:
        """Clipping under stage 2: the pieces of this range of the summed gradients that belong to
        ``params`` (scaled in place, kept for the step); ``counts(parameter)``: whether this
        process counts its shard (not replicated along the model axis, or model rank 0)."""
        shard, exists = self.reduced()
        chosen = {id(p) for p in params}
        found = clipping.range_parts(shard, exists, [t.numel() for t in self.locals], self.offsets,
                                     self.bounds[self.rank], self.bounds[self.rank + 1],
                                     [id(p) in chosen for _, _, p in self.entries])
        tensors = [piece for _, piece in found]
        counted = [piece for k, piece in found if counts(self.entries[k][2])]
        return clipping.GradientParts(tensors, counted, None)

    def discard(self) -> None:
        """``zero_grad``: a range of the sum that no step used is dropped."""
        self.summed = None

    # ---------------------------------------------------------- state dicts

    def state(self) -> dict[int, dict]:
        """The state of this process's parameters, whole (a collective over the data and model axes),
        keyed by their index in the optimizer's state dict."""
        merged = gather_state(self.sharded, self.rank, self.data, "optimizer.state_dict (ranges over the data axis)")
        result = {}
        for k in sorted(merged):
            index, _, p = self.entries[k]
            result[index] = {key: DTensor.from_local(value.to(p.device), p.device_mesh, p.placements,
                                                     run_check=False).full_tensor()
                             if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
                             else value for key, value in merged[k].items()}
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


def _local_part(value: object, param: torch.Tensor) -> object:
    """This process's shard of a whole state tensor shaped as the DTensor ``param`` (else ``value``)."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    return value
