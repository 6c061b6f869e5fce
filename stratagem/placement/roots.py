"""RootsPlacement: the base of placements that take whole models created in scope.

The model-parallel placements (tensor parallel, pipeline) cut each model created in
scope as a whole, so they wait for it to be complete: modules that register tensors
wait in a pending list, and :meth:`RootsPlacement.new_roots` (called by ``finalize``)
returns the root modules among them -- those that no other pending or placed module
holds, with parameters -- moved to this process's device, after every process checked
that all built the same modules and took the chief's initial values (so that every
process, and every data-parallel group, starts alike).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement import sync_batch_norm
from stratagem.placement.base import Placement


class RootsPlacement(Placement):
    """Collects modules created in scope; ``new_roots`` hands out the complete models."""

    #: set by the subclass: where modules go, and every process (the start-up agreement)
    device: torch.device
    everyone: Collective

    def _start_roots(self) -> None:
        self._pending: list[nn.Module] = []
        self._placed: list[nn.Module] = []

    def on_module_registered(self, module: nn.Module) -> None:
        sync_batch_norm.adopt(module)   # (synchronized or refused at its first training-mode forward)
        if not any(m is module for m in self._pending):
            self._pending.append(module)

    def on_submodule_registered(self, module: nn.Module) -> None:
        self.on_module_registered(module)

    def new_roots(self) -> list[nn.Module]:
        """The models completed since the last call, on this device, the same on every process."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        # modules inside another one, or placed already (placing may re-register parameters)
        inside = {id(child) for m in pending for child in m.modules() if child is not m}
        inside.update(id(m) for root in self._placed for m in root.modules())
        roots = [m for m in pending if id(m) not in inside and any(True for _ in m.parameters())]
        if not roots:
            return []
        for root in roots:
            root.to(self.device)
        # every process built the same modules (else all raise), and starts from the chief's values
        self.everyone.agree_on_modules([m for root in roots for m in root.modules()])
        self._placed.extend(roots)
        return roots

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        """The parameters of the models placed here (their gradients are split over processes)."""
        placed = {id(p) for root in self._placed for p in root.parameters()}
        return [id(p) in placed for p in params]

    def _forget_pending(self, modules: Any) -> None:
        """Modules that placing created in scope are not new models."""
        ids = {id(m) for m in modules}
        self._pending = [m for m in self._pending if id(m) not in ids]


def sum_gradients_over(axis: Collective, params: list[torch.Tensor]) -> None:
    """Sum the gradients of ``params`` over ``axis`` in place: one all-reduce per dtype, zeros
    where a peer has a gradient and this process none; a DTensor gradient's local shard is summed."""
    if not params or axis.num_workers == 1:   # (no parameters here: none on the axis peers either)
        return
    group = axis.group
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    group.all_reduce(present, "optimizer.step (which gradients exist on the data axis)")
    for p, count in zip(params, present.tolist()):
        if count and p.grad is None:
            p.grad = torch.zeros_like(p)
    with torch.no_grad():   # to_local() is then the shard's own memory: summed in place
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = group.all_reduce(torch.cat([g.reshape(-1) for g in same]),
                                    "optimizer.step (gradients over the data axis)")
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))


class DataAxisSum:
    """The sum of gradients over the data axis, once per step: in ``optimizer.step()``, or earlier
    when clipping needs the whole gradients (:meth:`now`), which the step then leaves as they are.

    A gradient summed early and then accumulated into by another backward before the step
    would need only the new part summed: the step refuses it instead. A hook on each parameter
    summed early sees each new gradient arrive: onto a ``.grad`` still there (refused at the
    step), or onto none (``zero_grad`` dropped the sum: a fresh gradient, summed in the step).
    """

    def __init__(self, axis: Collective):
        self.axis = axis
        self._hooks: dict[int, Any] = {}   # id(parameter summed early) -> its hook's handle
        self._mixed: set[int] = set()

    def now(self, params: list[torch.Tensor]) -> None:
        """Sum those of ``params`` not summed yet this step (a collective over the data axis)."""
        if self.axis.num_workers == 1:
            return
        fresh = [p for p in params if id(p) not in self._hooks]
        sum_gradients_over(self.axis, fresh)
        for p in fresh:
            self._hooks[id(p)] = p.register_hook(functools.partial(self._arriving, weakref.ref(p)))

    def _arriving(self, ref: Any, grad: torch.Tensor) -> None:
        param = ref()   # (before the new gradient is added to param.grad)
        if param is not None and id(param) in self._hooks:
            if param.grad is not None:
                self._mixed.add(id(param))
            else:
                self.forget([param])

    def before_step(self, params: list[torch.Tensor]) -> None:
        """Sum what clipping did not (a collective); then forget this step's sums."""
        mixed = [p for p in params if id(p) in self._mixed]
        if mixed:
            raise InvalidArgumentError(
                f"{len(mixed)} gradient(s) (shapes {[tuple(p.shape) for p in mixed[:4]]}) were summed over the "
                f"data axis by clip_grad_norm_/clip_grad_value_ and then accumulated into by another backward "
                f"before optimizer.step(); clip after the last backward of the step (or call "
                f"optimizer.zero_grad() before a new one)")
        sum_gradients_over(self.axis, [p for p in params if id(p) not in self._hooks])
        self.forget(params)

    def forget(self, params: list[torch.Tensor]) -> None:
        """Drop what is known about ``params``' sums (after the step, or ``zero_grad``)."""
        for p in params:
            handle = self._hooks.pop(id(p), None)
            if handle is not None:
                handle.remove()
            self._mixed.discard(id(p))
