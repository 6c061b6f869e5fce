"""The order of one synchronous optimizer step, written once.

Every synchronous placement steps a scoped optimizer in this order whatever its update rule
(:mod:`.update_rule`: mirrored, central storage, ZeRO); only the rule's primitives differ. By
the time ``optimizer.step()`` runs, the gradients were summed over every replica and worker
when backward ended (:mod:`.gradient_sync`), or, under ZeRO stage 2, reduce-scattered during
backward:

1. ``prepare_gradients`` -- the summed gradients where the update reads them (central storage
   with GPU replicas: the parameter device; ZeRO stage 2: this worker's range of the sum);
2. the user's step pre-hooks, once (replica 0 while the others wait), seeing the summed
   gradients; gradients a hook changed reach the other replicas (``copy_changed``); without
   hooks the replicas meet all the same: no update reads gradients that another replica's code
   (a ``clip_grad_norm_`` between ``backward()`` and ``step()``) has yet to change;
3. ``update_call`` -- the update: this replica's range (split updates), replica 0's single
   update on shared memory, or this replica's twin on its own copy;
4. ``after_update`` -- the replicas meet; the new values reach every copy (central storage: its
   replicas' copies; ZeRO: the all-gather of the ranges);
5. the post-hooks, once, seeing the updated parameters; parameters a hook changed reach the
   other replicas;
6. ``buffers`` -- across workers, the floating buffers that forwards wrote (BatchNorm's running
   statistics) averaged over every replica (:mod:`.buffers`).

Called outside ``run`` (``replica`` None) the same order runs on the calling thread for every
local replica.

It is the step of every synchronous placement: :class:`~.axis.DataAxis` (a placement's data axis)
holds it as its ``step``, and the placement hands ``optimizer.step()`` to it. Where a process is
one replica whose optimizers are torch's own over the tensors it holds (tensor parallel, ZeRO-3,
a pipeline's stages), the primitives are :class:`~.local_update.LocalUpdate`'s (nothing to
spread), and a ``closure`` reaches torch's update, which the other rules refuse (``check_closure``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from stratagem._profiling import label
from stratagem.placement.scope.hooks import run_hooks, step_hooks


class UpdatePrimitives(Protocol):
    """What :func:`synchronous_step` asks of an update rule."""

    def check_closure(self, optimizer: torch.optim.Optimizer) -> None: ...
    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any: ...
    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any) -> Any: ...
    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any: ...
    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]: ...
    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None: ...


class SynchronousAxis(Protocol):
    """What :func:`synchronous_step` asks of a data axis (:class:`~.axis.DataAxis`): its replicas, and
    its update rule."""

    collective: Any
    num_replicas: int
    update: UpdatePrimitives
    buffers: Any   # a BufferSync, or None (one replica in all)

    def own_replica_context(self) -> Any: ...
    def record_updates(self) -> list[str]: ...


def synchronous_step(axis: SynchronousAxis, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
    """One logical step of ``optimizer``: the order above, on this replica's thread (or outside
    ``run``, for every replica)."""
    rule = axis.update
    if closure is not None:
        rule.check_closure(optimizer)
    ctx = axis.own_replica_context()
    replica = None if ctx is None else ctx.local_replica_id
    pre, post = step_hooks(optimizer)
    with label("stratagem.optimizer.step"):
        gradients = rule.prepare_gradients(optimizer, replica)
        if pre:
            _hooks_once(axis, pre, optimizer, replica, grads=True)   # (replica 0 runs them: the replicas meet)
        elif replica is not None and axis.num_replicas > 1:
            # a replica's update may read another's gradients (its range of replica 0's): every
            # replica's code between backward and step (clipping, unscaling) must have run first
            axis.collective.exchange(replica, None, "optimizer.step (gradients final)")
        with label("stratagem.optimizer.update"):
            result = rule.update_call(optimizer, replica, gradients, closure)
        result = rule.after_update(optimizer, replica, result)
        if post:
            _hooks_once(axis, post, optimizer, replica, grads=False)
        if axis.buffers is not None:
            axis.buffers.step(replica)
    if replica is None:
        axis.record_updates()
    return result


def _hooks_once(axis: SynchronousAxis, hooks: list, optimizer: torch.optim.Optimizer,
                replica: int | None, *, grads: bool) -> None:
    """Run ``hooks`` once (replica 0 while the others wait); spread what they changed."""
    def watched(p: torch.Tensor) -> Any:
        t = p.grad if grads else p
        return None if t is None else (id(t), t._version)

    tensors = axis.update.hooked_tensors(optimizer, 0 if replica is None else replica)
    changed = None
    if replica in (None, 0):
        before = [watched(p) for p in tensors]
        try:
            run_hooks(hooks, optimizer)
        finally:
            changed = [i for i, (p, b) in enumerate(zip(tensors, before)) if watched(p) != b]
    several = replica is not None and axis.num_replicas > 1
    if several:
        changed = axis.collective.exchange(replica, changed, "optimizer step hooks")[0]
    if changed:
        axis.update.copy_changed(optimizer, replica, changed, grads)
        if several:
            axis.collective.exchange(replica, None, "optimizer step hooks (copied)")

