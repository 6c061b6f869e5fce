"""The optimizers of a pipelined model: each process updates its own stages, on any mesh.

:class:`StageOptimizers` answers :class:`~stratagem.placement.layout.pipeline.PipelinePlacement`'s
optimizer primitives and is its update rule (the placement places the modules, and finalizes them
before handing an optimizer call over). An optimizer created in scope keeps
every parameter of the model in its parameter groups, those of the stages held elsewhere as
``meta`` placeholders (no gradient, no state, no update), so that its state dict numbers
parameters as a plain optimizer over the whole model does. ``step`` runs in the order of
:mod:`stratagem.placement.data_axis.step`, whose update:

- runs the user's update over this process's parameters (their tensor-parallel shards included:
  torch's own update over DTensors), whose gradients were summed over the data axis when the
  schedule ended (:meth:`~stratagem.placement.layout.pipeline.PipelinePlacement.summing_gradients`;
  each data group's loss is already weighted by its share of the global batch);
- ``sharding="optimizer"`` / ``"gradients"``: the update is ZeRO's
  (:class:`~stratagem.placement.data_axis.zero.ZeroUpdate`, bound to the data axis instead of the
  workers), cut in ranges over the data axis; under ``"gradients"`` the schedule's end
  reduce-scattered the gradients into those ranges;
- ``sharding="parameters"``: FSDP2 summed the gradients during the schedule's backward; the
  update is torch's over this process's shards.

``clip_grad_norm_`` over the model's parameters measures the whole model's gradients
(:mod:`stratagem.placement.scope.clipping`).

State dicts read as one optimizer's over the whole model: shards made whole over the model
(and, under ZeRO, data) axis, then each stage's entries gathered over the pipe axis; every
process calls them. ``load_state_dict`` takes the whole state; each process keeps its part.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from stratagem._record import record
from stratagem.errors import InvalidArgumentError
from stratagem.placement.data_axis.zero import ZeroUpdate
from stratagem.placement.data_axis.zero_ranges import ZeroRanges
from stratagem.comm.collective import Collective
from stratagem.placement.scope.hooks import adopt, base_of, step_hooks, unhooked_step
from stratagem.placement.dtensor_state import full_value, local_state_bytes, shard_like
from stratagem.placement.data_axis.local_update import LocalUpdate


class StageOptimizers(LocalUpdate):
    """The optimizers created in a pipeline's scope: their steps' primitives (the update rule of
    :mod:`stratagem.placement.data_axis.step`), ZeRO's ranges (clipping's pieces too) and state dicts."""

    def __init__(self, placement: Any, *, pipe: Collective, data: Collective, sharding: str | None):
        super().__init__(placement)
        self.pipe, self.data = pipe, data
        self.sharding = sharding   # ZeRO over the data axis: None, "optimizer", "gradients" or "parameters"
        self.refs: list[weakref.ref] = []   # the optimizers (a traced model's first trace trims them)
        #: sharding="optimizer" / "gradients": ZeRO's update rule over the data axis (each optimizer's
        #: ranges built at first use), else None
        self.zero: ZeroUpdate | None = None
        if self.sharding in ("optimizer", "gradients"):
            self.zero = ZeroUpdate(self.sharding)
            self.zero.bind(placement, data)
            self.spread_over_data = True

    def created(self, optimizer: torch.optim.Optimizer, placement: Any) -> None:
        """An optimizer created in ``placement``'s scope: its parameter groups keep every parameter
        of the model (those of other stages as meta placeholders)."""
        adopt(optimizer, placement)
        self.refs.append(weakref.ref(optimizer))

    def _zero_of(self, optimizer: torch.optim.Optimizer) -> ZeroRanges | None:
        return None if self.zero is None else self.zero.ranges(optimizer)

    # the primitives of placement/data_axis/step.py (LocalUpdate's others: nothing to spread)

    def check_closure(self, optimizer: torch.optim.Optimizer) -> None:
        if self.sharding in ("optimizer", "gradients"):   # (checked before the modules are placed)
            raise InvalidArgumentError(
                f"with sharding={self.sharding!r} the update runs in ranges over the data axis: call "
                f"optimizer.step() without a closure, or use sharding=None")

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        """The modules placed; under ZeRO, the gradients of the optimizer's range over the data axis."""
        self._placement().finalize()
        if self.zero is None:
            return None
        if self.sharding == "gradients" and step_hooks(optimizer)[0]:
            raise InvalidArgumentError(
                f"with sharding={self.sharding!r} the update runs in ranges over the data axis, where no "
                f"whole gradient exists for a step pre-hook: remove the step pre-hook, or use sharding=None")
        return self.zero.prepare_gradients(optimizer, replica)

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        """This data rank's range (ZeRO: no closure, refused before), else torch's update over this
        process's parameters."""
        if self.zero is not None:
            return self.zero.update_call(optimizer, replica, gradients)
        return self._own_update(optimizer, closure)

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        """ZeRO: every data rank's updated range reaches every data rank."""
        return result if self.zero is None else self.zero.after_update(optimizer, replica, result)

    def _own_update(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """torch's update over the parameters of this process's stages (the meta placeholders of the
        stages held elsewhere left out of the groups meanwhile)."""
        groups = optimizer.param_groups
        every = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, every):
                group["params"] = [p for p in params if not p.is_meta]
            return unhooked_step(base_of(optimizer))(optimizer, closure)
        finally:
            for group, params in zip(groups, every):
                group["params"] = params

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if self.zero is not None:
            self.zero.zero_grad(optimizer, set_to_none)   # (and a range of the sum that no step used)
        else:
            base_of(optimizer).zero_grad(optimizer, set_to_none)

    def reduce_scattered(self, params: list[torch.Tensor]) -> list[ZeroRanges]:
        """Under ``sharding="gradients"``: the ranges of the optimizers that hold some of ``params``
        (their gradients are reduce-scattered into them when a schedule ends; clipping measures their
        pieces); else none."""
        return self._zeros_holding(params) if self.sharding == "gradients" else []

    def _zeros_holding(self, params: list[torch.Tensor]) -> list[ZeroRanges]:
        ids = {id(p) for p in params}
        optimizers = [ref() for ref in self.refs]
        return [self._zero_of(optimizer) for optimizer in optimizers if optimizer is not None and
                any(id(p) in ids for group in optimizer.param_groups for p in group["params"])]

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole model's optimizer state: shards made whole, each stage's gathered over the pipe
        axis (every process calls it)."""
        state = base_of(optimizer).state_dict(optimizer)
        zero = self._zero_of(optimizer)
        if zero is not None:
            state["state"] = zero.state()
        else:   # (the state of DTensor parameters made whole)
            state["state"] = {k: {n: full_value(v) for n, v in entry.items()} for k, entry in state["state"].items()}
        if self.pipe.num_workers > 1:
            mine = {k: {n: v.detach().cpu() if isinstance(v, torch.Tensor) else v for n, v in entry.items()}
                    for k, entry in state["state"].items()}
            merged = {}
            for part in self.pipe.all_gather_object(mine, "optimizer.state_dict (the stages of the pipeline)"):
                merged.update(part)
            state["state"] = {k: merged[k] for k in sorted(merged)}
        return state

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Load the whole model's optimizer state; this process keeps its own parameters' entries (its
        shards of them, its range under ZeRO)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ids = [i for group in state_dict.get("param_groups", []) for i in group.get("params", [])]
        held = {i: p for i, p in zip(ids, params) if not p.is_meta}
        state = dict(state_dict)
        state["state"] = {k: v for k, v in state_dict.get("state", {}).items() if k in held}
        zero = self._zero_of(optimizer)
        if zero is not None:
            base_of(optimizer).load_state_dict(optimizer, {**state, "state": {}})
            zero.load(state["state"])
            return
        state["state"] = {k: {n: shard_like(v, held[k]) for n, v in entry.items()}
                          for k, entry in state["state"].items()}
        base_of(optimizer).load_state_dict(optimizer, state)

    def add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        if record(optimizer).zero is not None or self.sharding == "parameters":
            raise InvalidArgumentError(
                f"add_param_group is not supported with sharding={self.sharding!r} (the parameters are laid "
                f"out over the data axis already); create the optimizer with all its parameter groups")
        base_of(optimizer).add_param_group(optimizer, param_group)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of per-element optimizer state (moments, momentum) this process holds for ``optimizer``."""
        zero = self._zero_of(optimizer)
        if zero is not None:
            return zero.state_bytes()
        return local_state_bytes(optimizer)
