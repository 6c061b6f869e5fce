"""The optimizer half of :class:`~stratagem.placement.mirrored.MirroredPlacement`.

Each local replica has a *twin* of the user's optimizer over its own copies of the
parameters (replica 0's twin is the user's optimizer itself); twins are built when
the optimizer is finished and share its hyperparameters, which a scheduler changes
on the user's object and are copied to the twins before every step.

Gradients are summed over every replica and worker when backward ends
(:mod:`.gradient_sync`), so ``optimizer.step()``, called on every replica's thread inside
``run`` (:meth:`MirroredOptimizers.optimizer_step`), only applies them:

1. the user's step pre-hooks run once, on replica 0, seeing the summed gradients
   (gradients a hook changed are copied to the other replicas);
2. the update: for element-wise optimizers on several CPU replicas, each thread updates
   one range of replica 0's parameters (:mod:`.sharded_update`); otherwise, where the
   replicas' parameters share one memory (logical CPU devices), replica 0's optimizer
   applies it once while the others wait; else every twin applies it to its own copy
   (GPUs);
3. the post-hooks run once, on replica 0, after every copy is updated (parameters a
   hook changed are copied to the other replicas).

Without hooks, steps 1 and 3 cost nothing. Called in cross-replica context,
``step()`` updates every copy itself.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from stratagem import _context
from stratagem._profiling import label
from stratagem.errors import InvalidArgumentError
from stratagem.placement.hooks import run_hooks, step_hooks, unhooked_step
from stratagem.placement.sharded_update import ShardedUpdate


class MirroredOptimizers:
    """Optimizer operations of the mirrored placement (a mixin: one object, no extra frames)."""

    # --------------------------------------------------------------- twins

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        if optimizer._sg_twins is None:
            with self._build_lock:
                if optimizer._sg_twins is None:
                    if optimizer in self._pending_optimizers:
                        self._pending_optimizers.remove(optimizer)
                    self._build_twins(optimizer)
        return optimizer._sg_twins

    def _build_twins(self, optimizer: torch.optim.Optimizer) -> None:
        base = optimizer._sg_base
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
                twin.__dict__.update(optimizer.__dict__)
                twin.state = defaultdict(dict)
                twin.param_groups = [
                    {**group, "params": [self.all_copies(p)[r] for p in group["params"]]}
                    for group in optimizer.param_groups]
                twin._sg_twins = None
                if optimizer.state:
                    base.load_state_dict(twin, optimizer.state_dict())
                twins.append(twin)
        optimizer._sg_twins = twins

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers of ``optimizer`` when one update can be split between replicas."""
        sharded = optimizer.__dict__.get("_sg_sharded", False)
        if sharded is False:
            twins = self.twins(optimizer)  # parameters are mirrored by now
            with self._build_lock:  # every replica thread asks at the first step: build it once
                sharded = optimizer.__dict__.get("_sg_sharded", False)
                if sharded is False:
                    sharded = None
                    if self.collective.num_workers == 1 and ShardedUpdate.supports(optimizer, self.devices):
                        sharded = ShardedUpdate(optimizer, self.all_copies, len(twins))
                    optimizer._sg_sharded = sharded
        return sharded

    # ---------------------------------------------------------------- step

    def own_replica_context(self) -> Any:
        """The calling thread's replica context if it is a replica of this strategy, else None."""
        frame = _context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        return ctx if ctx is not None and ctx.strategy is self.strategy else None

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        refuse_closure(closure)
        twins = self.twins(optimizer)
        ctx = self.own_replica_context()
        if ctx is None:
            return self._cross_replica_step(optimizer, twins)
        local_id, collective = ctx.local_replica_id, self.collective
        twin = twins[local_id]
        params = [p for group in twin.param_groups for p in group["params"]]
        sharded = self.sharded(optimizer)
        shared = self.shares_parameters  # one memory: the update is applied once, from replica 0's gradients
        with label("stratagem.optimizer.step"):  # the gradients were summed when backward ended
            pre, post = step_hooks(optimizer)
            if pre:  # 1.
                self._run_hooks_once(pre, optimizer, local_id, params, grads=True)
            with label("stratagem.optimizer.update"):  # 2.
                if sharded is not None:
                    sharded.step(local_id)
                    collective.exchange(local_id, None, "optimizer.step (parameters updated)")
                    result = None
                elif shared:
                    result = unhooked_step(optimizer._sg_base)(optimizer) if local_id == 0 else None
                    collective.exchange(local_id, None, "optimizer.step (parameters updated)")
                else:
                    if twin is not optimizer:
                        _copy_hyperparameters(optimizer, twin)
                    result = unhooked_step(optimizer._sg_base)(twin)
            if post:  # 3.
                if sharded is None and not shared:
                    collective.exchange(local_id, None, "optimizer.step (parameters updated)")
                self._run_hooks_once(post, optimizer, local_id, params, grads=False)
        return result

    def _run_hooks_once(self, hooks: list, optimizer: torch.optim.Optimizer, local_id: int,
                        params: list[torch.Tensor], *, grads: bool) -> None:
        """Run ``hooks`` on replica 0 while the others wait; spread what they changed."""
        def watched(p: torch.Tensor) -> Any:
            t = p.grad if grads else p
            return None if t is None else (id(t), t._version)

        changed = None
        if local_id == 0:
            before = [watched(p) for p in params]
            try:
                run_hooks(hooks, optimizer)
            finally:
                changed = [i for i, (p, b) in enumerate(zip(params, before)) if watched(p) != b]
        changed = self.collective.exchange(local_id, changed, "optimizer step hooks")[0]
        if changed and local_id != 0 and not self.shares_parameters:  # (shared: nothing to copy)
            primaries = [p for group in optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                for i in changed:
                    source, target = primaries[i], params[i]
                    if grads:
                        target.grad = None if source.grad is None else source.grad.to(target.device, copy=True)
                    else:
                        target.copy_(source)
        if changed:
            self.collective.exchange(local_id, None, "optimizer step hooks (copied)")

    def _cross_replica_step(self, optimizer: torch.optim.Optimizer, twins: list) -> Any:
        """``step()`` outside ``run``: the gradients were summed when backward ended (a backward
        pass outside ``run`` reaches every replica's tensors)."""
        pre, post = step_hooks(optimizer)
        run_hooks(pre, optimizer)
        shared = self.shares_parameters
        if len(twins) > 1 and pre and not shared:  # a hook may have changed the primary gradients
            self._copy_from_primary(twins, grads=True)
        result = None
        sharded = self.sharded(optimizer)
        if sharded is not None:
            for replica in range(len(twins)):
                sharded.step(replica)
        else:
            step = unhooked_step(optimizer._sg_base)
            for twin in twins[:1] if shared else twins:
                if twin is not optimizer:
                    _copy_hyperparameters(optimizer, twin)
                result = step(twin)
        run_hooks(post, optimizer)
        if len(twins) > 1 and post and not shared:
            self._copy_from_primary(twins, grads=False)
        self.record_updates()
        return result

    def _copy_from_primary(self, twins: list, *, grads: bool) -> None:
        primaries = [p for g in twins[0].param_groups for p in g["params"]]
        with torch.no_grad():
            for twin in twins[1:]:
                for source, target in zip(primaries, [p for g in twin.param_groups for p in g["params"]]):
                    if not grads:
                        target.copy_(source)
                    elif source.grad is not None:
                        target.grad = source.grad.to(target.device, copy=True)

    # ------------------------------------------------------ everything else

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        twins = self.twins(optimizer)
        ctx = self.own_replica_context()
        mine = [twins[ctx.local_replica_id]] if ctx is not None else twins
        for twin in mine:
            if self.gradients is not None:
                self.gradients.forget([p for group in twin.param_groups for p in group["params"]])
            optimizer._sg_base.zero_grad(twin, set_to_none)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        result = optimizer._sg_base.state_dict(optimizer)  # replica 0's: one logical copy
        sharded = self.sharded(optimizer)
        if sharded is not None:
            result["state"] = sharded.state()
        return result

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        base = optimizer._sg_base
        sharded = self.sharded(optimizer)
        if sharded is not None:  # hyperparameters here, the state in the range optimizers
            base.load_state_dict(optimizer, {**state_dict, "state": {}})
            sharded.load_state(state_dict["state"])
            return
        base.load_state_dict(optimizer, state_dict)
        for twin in self.twins(optimizer)[1:]:
            base.load_state_dict(twin, state_dict)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        if optimizer.__dict__.get("_sg_sharded"):
            raise InvalidArgumentError(
                "add_param_group after the first step is not supported for an optimizer created in a "
                "multi-replica scope; pass every parameter group when creating the optimizer")
        optimizer._sg_sharded = False  # decided again at the next step
        optimizer._sg_base.add_param_group(optimizer, param_group)
        if optimizer.__dict__.get("_sg_twins"):
            optimizer._sg_twins = None
            self.twins(optimizer)


def refuse_closure(closure: Any) -> None:
    if closure is not None:
        raise InvalidArgumentError(
            "optimizer.step(closure) is not supported for optimizers created in a strategy's "
            "scope: compute the loss and call loss.backward() before optimizer.step()")


def _copy_hyperparameters(source: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Schedulers change the user's optimizer; its twins follow before every step."""
    for group, twin_group in zip(source.param_groups, twin.param_groups):
        for key, value in group.items():
            if key != "params":
                twin_group[key] = value
