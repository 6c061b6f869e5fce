"""The optimizer half of :class:`~stratagem.placement.mirrored.MirroredPlacement`.

Each local replica has a *twin* of the user's optimizer over its own copies of the
parameters (replica 0's twin is the user's optimizer itself); twins are built when
the optimizer is finished and share its hyperparameters, which a scheduler changes
on the user's object and are copied to the twins before every step.

Gradients are summed over every replica and worker when backward ends
(:mod:`.gradient_sync`); ``optimizer.step()`` follows the order of :mod:`.step` (hooks once,
the update, hooks once) with this placement's primitives. The update: for element-wise
optimizers on several CPU replicas, each thread updates one range of replica 0's parameters
(:mod:`.sharded_update`); otherwise, where the replicas' parameters share one memory (logical
CPU devices), replica 0's optimizer applies it once while the others wait; else every twin
applies it to its own copy (GPUs). Called in cross-replica context, ``step()`` updates every
copy itself.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch

from stratagem import _context
from stratagem.errors import InvalidArgumentError
from stratagem._record import ATTRIBUTE, attach, record
from stratagem.placement.hooks import base_of, unhooked_step
from stratagem.placement.sharded_update import ShardedUpdate
from stratagem.placement.step import synchronous_step


class MirroredOptimizers:
    """Optimizer operations of the mirrored placement (a mixin: one object, no extra frames)."""

    # --------------------------------------------------------------- twins

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        mine = record(optimizer)
        if mine.twins is None:
            with self._build_lock:
                if mine.twins is None:
                    if optimizer in self._pending_optimizers:
                        self._pending_optimizers.remove(optimizer)
                    self._build_twins(optimizer)
        return mine.twins

    def _build_twins(self, optimizer: torch.optim.Optimizer) -> None:
        base = base_of(optimizer)
        twins = [optimizer]
        if self.num_replicas > 1:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if self.all_copies(p) is None:
                        raise InvalidArgumentError(
                            f"an optimizer created in the scope of {self.strategy!r} was given a "
                            f"parameter of shape {tuple(p.shape)} that was not created in that scope, "
                            f"so it has no copy per replica. Create the model inside "
                            f"`with strategy.scope():` too")
            for r in range(1, self.num_replicas):
                twin = object.__new__(base)
                twin.__dict__.update((k, v) for k, v in optimizer.__dict__.items() if k != ATTRIBUTE)
                twin.state = defaultdict(dict)
                twin.param_groups = [
                    {**group, "params": [self.all_copies(p)[r] for p in group["params"]]}
                    for group in optimizer.param_groups]
                attach(twin, placement=self)   # its own record: a twin is ours, and has no twins
                if optimizer.state:
                    base.load_state_dict(twin, optimizer.state_dict())
                twins.append(twin)
        record(optimizer).twins = twins

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers of ``optimizer`` when one update can be split between replicas."""
        mine = record(optimizer)
        sharded = mine.sharded
        if sharded is False:
            twins = self.twins(optimizer)  # parameters are mirrored by now
            with self._build_lock:  # every replica thread asks at the first step: build it once
                sharded = mine.sharded
                if sharded is False:
                    sharded = None
                    if self.collective.num_workers == 1 and ShardedUpdate.supports(optimizer, self.devices):
                        sharded = ShardedUpdate(optimizer, self.all_copies, len(twins))
                    mine.sharded = sharded
        return sharded

    # ---------------------------------------------------------------- step

    def own_replica_context(self) -> Any:
        """The calling thread's replica context if it is a replica of this strategy, else None."""
        frame = _context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        return ctx if ctx is not None and ctx.strategy is self.strategy else None

    #: one logical step, in the order of placement/step.py (a function of this placement: no extra frame)
    optimizer_step = synchronous_step

    # the primitives of placement/step.py

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        return None   # every replica's .grad holds the sum since backward ended

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any) -> Any:
        """This replica's share of the update: its range (split updates), replica 0's one update
        where the replicas share one memory, else its twin on its own copy."""
        twins, sharded = self.twins(optimizer), self.sharded(optimizer)
        if replica is None:
            return functools.partial(self._update_every_copy, optimizer, twins, sharded)
        if sharded is not None:
            return functools.partial(sharded.step, replica)
        if self.shares_parameters:
            return functools.partial(unhooked_step(base_of(optimizer)), optimizer) if replica == 0 else _nothing
        twin = twins[replica]
        if twin is not optimizer:
            _copy_hyperparameters(optimizer, twin)
        return functools.partial(unhooked_step(base_of(optimizer)), twin)

    def _update_every_copy(self, optimizer: torch.optim.Optimizer, twins: list, sharded: Any) -> Any:
        if sharded is not None:
            for replica in range(len(twins)):
                sharded.step(replica)
            return None
        result = None
        for twin in twins[:1] if self.shares_parameters else twins:
            if twin is not optimizer:
                _copy_hyperparameters(optimizer, twin)
            result = unhooked_step(base_of(optimizer))(twin)
        return result

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        if replica is not None and self.num_replicas > 1:
            self.collective.exchange(replica, None, "optimizer.step (parameters updated)")
        return result

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        twin = self.twins(optimizer)[replica]
        return [p for group in twin.param_groups for p in group["params"]]

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        """Replica 0's gradients or parameters that a hook changed, copied to ``replica`` (None:
        every other replica). Shared memory: parameters need nothing, and the update reads replica
        0's gradients."""
        if self.shares_parameters or replica == 0:
            return
        primaries = self.hooked_tensors(optimizer, 0)
        targets = range(1, self.num_replicas) if replica is None else (replica,)
        with torch.no_grad():
            for r in targets:
                params = self.hooked_tensors(optimizer, r)
                for i in changed:
                    source, target = primaries[i], params[i]
                    if grads:
                        target.grad = None if source.grad is None else source.grad.to(target.device, copy=True)
                    else:
                        target.copy_(source)

    # ------------------------------------------------------ everything else

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        twins = self.twins(optimizer)
        ctx = self.own_replica_context()
        mine = [twins[ctx.local_replica_id]] if ctx is not None else twins
        for twin in mine:
            if self.gradients is not None:
                self.gradients.forget([p for group in twin.param_groups for p in group["params"]])
            base_of(optimizer).zero_grad(twin, set_to_none)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        result = base_of(optimizer).state_dict(optimizer)  # replica 0's: one logical copy
        sharded = self.sharded(optimizer)
        if sharded is not None:
            result["state"] = sharded.state()
        return result

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        base = base_of(optimizer)
        sharded = self.sharded(optimizer)
        if sharded is not None:  # hyperparameters here, the state in the range optimizers
            base.load_state_dict(optimizer, {**state_dict, "state": {}})
            sharded.load_state(state_dict["state"])
            return
        base.load_state_dict(optimizer, state_dict)
        for twin in self.twins(optimizer)[1:]:
            base.load_state_dict(twin, state_dict)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        mine = record(optimizer)
        if mine.sharded:
            raise InvalidArgumentError(
                "add_param_group after the first step is not supported for an optimizer created in a "
                "multi-replica scope; pass every parameter group when creating the optimizer")
        mine.sharded = False  # decided again at the next step
        base_of(optimizer).add_param_group(optimizer, param_group)
        if mine.twins:
            mine.twins = None
            self.twins(optimizer)


def _nothing() -> None:
    return None


def _copy_hyperparameters(source: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Schedulers change the user's optimizer; its twins follow before every step."""
    for group, twin_group in zip(source.param_groups, twin.param_groups):
        for key, value in group.items():
            if key != "params":
                twin_group[key] = value
