"""MirroredUpdate: the update rule of the mirrored placement (the default).

Each local replica has a *twin* of the user's optimizer over its own copies of the
parameters (replica 0's twin is the user's optimizer itself); twins are built when
the optimizer is finished and share its hyperparameters, which a scheduler changes
on the user's object and are copied to the twins before every step.

Gradients are summed over every replica and worker when backward ends
(:mod:`.gradient_sync`); ``optimizer.step()`` follows the order of :mod:`.step` (hooks once,
the update, hooks once) with this rule's primitives. The update: for element-wise
optimizers on several CPU replicas, each thread updates one range of replica 0's parameters
(:mod:`.sharded_update`); otherwise, where the replicas' parameters share one memory (logical
CPU devices), replica 0's optimizer applies it once while the others wait; else every twin
applies it to its own copy (GPUs). Called in cross-replica context, ``step()`` updates every
copy itself.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from stratagem._record import ATTRIBUTE, attach, record
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope.hooks import base_of, unhooked_step
from stratagem.placement.data_axis.sharded_update import ShardedUpdate
from stratagem.placement.data_axis.update_rule import UpdateRule


class MirroredUpdate(UpdateRule):
    """A twin optimizer per local replica over its copies, or one update split by ranges
    between the replica threads where the replicas share one memory."""

    kind = "Mirrored"

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        record(optimizer).twins = None   # built when the optimizer is finished
        super().add(optimizer)

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        self._build_twins(optimizer)

    # --------------------------------------------------------------- twins

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        mine = record(optimizer)
        if mine.twins is None:
            with self._lock:
                if mine.twins is None:
                    self._claim(optimizer)
                    self._build_twins(optimizer)
        return mine.twins

    def _build_twins(self, optimizer: torch.optim.Optimizer) -> None:
        base = base_of(optimizer)
        twins = [optimizer]
        all_copies = self.placement.all_copies
        if self.num_replicas > 1:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if all_copies(p) is None:
                        raise InvalidArgumentError(
                            f"an optimizer created in the scope of {self.placement.strategy!r} was given a "
                            f"parameter of shape {tuple(p.shape)} that was not created in that scope, "
                            f"so it has no copy per replica. Create the model inside "
                            f"`with strategy.scope():` too")
            for r in range(1, self.num_replicas):
                twin = object.__new__(base)
                twin.__dict__.update((k, v) for k, v in optimizer.__dict__.items() if k != ATTRIBUTE)
                twin.state = defaultdict(dict)
                twin.param_groups = [
                    {**group, "params": [all_copies(p)[r] for p in group["params"]]}
                    for group in optimizer.param_groups]
                attach(twin, placement=self.placement)   # its own record: a twin is ours, and has no twins
                if optimizer.state:
                    base.load_state_dict(twin, optimizer.state_dict())
                twins.append(twin)
        record(optimizer).twins = twins

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers of ``optimizer`` when one update can be split between replicas."""
        sharded = record(optimizer).sharded
        if sharded is False:
            twins = self.twins(optimizer)  # parameters are mirrored by now
            with self._lock:  # every replica thread asks at the first step: build it once
                sharded = record(optimizer).sharded
                if sharded is False:
                    sharded = None
                    if self.collective.num_workers == 1 and ShardedUpdate.supports(optimizer,
                                                                                   self.placement.devices):
                        sharded = ShardedUpdate(optimizer, self.placement.all_copies, len(twins), balance=True)
                    record(optimizer).sharded = sharded
        return sharded

    # ---------------------------------------------------------------- step

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        """This replica's share of the update: its range (split updates), replica 0's one update
        where the replicas share one memory, else its twin on its own copy (outside ``run``, every
        replica's share on this thread)."""
        twins, sharded = self.twins(optimizer), self.sharded(optimizer)
        if sharded is not None:
            for r in range(len(twins)) if replica is None else (replica,):
                sharded.step(r)
            return None
        mine = twins[:1] if self.shares_parameters else twins   # twins[0]: the optimizer itself
        result = None
        for twin in mine if replica is None else mine[replica:replica + 1]:
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

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        twins = self.twins(optimizer)
        ctx = self.placement.own_replica_context()
        mine = [twins[ctx.local_replica_id]] if ctx is not None else twins
        gradients = self.placement.gradients
        for twin in mine:
            if gradients is not None:
                gradients.forget([p for group in twin.param_groups for p in group["params"]])
            base_of(optimizer).zero_grad(twin, set_to_none)

    # state dicts and add_param_group: UpdateRule's, over the twins or the range optimizers


def _copy_hyperparameters(source: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Schedulers change the user's optimizer; its twins follow before every step."""
    for group, twin_group in zip(source.param_groups, twin.param_groups):
        for key, value in group.items():
            if key != "params":
                twin_group[key] = value
