"""LocalUpdate: the update rule of the placements that keep torch's own optimizers over this process's tensors.

Under tensor parallelism (:mod:`~stratagem.placement.layout.tensor_parallel`) and ZeRO-3 (:mod:`~stratagem.placement.layout.fully_sharded`) each process
is one replica that holds its shards of the parameters (DTensors); the gradients were summed over
the data axis when backward ended (the gradient sync, or FSDP2). A scoped optimizer then steps in
the order of :mod:`.step` with this rule's primitives -- torch's update over the shards, nothing to
spread -- and its ``zero_grad``, state dicts and ``add_param_group`` are torch's, the state read
and written whole (:mod:`~stratagem.placement.dtensor_state`). The placement (a
:class:`~stratagem.placement.layout.roots.RootsPlacement`) hands every optimizer call to its data
axis (:class:`~.axis.DataAxis`), which hands them to this rule, as the mirrored placement's data
axis does to its own (:mod:`.update_rule`). A pipeline's stages have a rule of their own built on this one
(:class:`~stratagem.placement.data_axis.pipeline_optimizers.StageOptimizers`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from stratagem.placement.dtensor_state import full_optimizer_state, load_full_optimizer_state, local_state_bytes
from stratagem.placement.scope.hooks import base_of, unhooked_step
from stratagem.placement.data_axis.update_rule import params_of


class LocalUpdate:
    """torch's own update and optimizer methods over the tensors this process holds (see the module doc;
    :class:`~.axis.DataAxis` shows it as a data axis's rule, stepping).

    Example::

        import torch
        from stratagem.placement.scope.hooks import adopt
        from stratagem.placement.data_axis.local_update import LocalUpdate

        class OneProcess:   # what the rule reads of a placement
            kind, data_axis = "Local", None
            def finalize(self): pass

        placement = OneProcess()
        rule = LocalUpdate(placement)
        p = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([p], lr=0.5)
        adopt(optimizer, placement)
        p.grad = torch.ones(2)
        rule.update_call(optimizer, None, rule.prepare_gradients(optimizer, None))
        assert p.tolist() == [0.5, 0.5]
        rule.zero_grad(optimizer, set_to_none=True)
        assert p.grad is None
    """

    #: whether it lays optimizer state out over the data axis (ZeRO's ranges): then every process of the
    #: axis gathers it for a checkpoint
    spread_over_data = False

    def __init__(self, placement: Any):
        # (its finalize: the models placed before the update reads them; weakly, as a placement is
        # let go with its strategy, which clipping's routing notices)
        self._placement = weakref.ref(placement)

    def check_closure(self, optimizer: torch.optim.Optimizer) -> None:
        return None   # torch's own update calls it

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        self._placement().finalize()
        return None   # .grad holds the sum over the data axis since backward ended

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        return unhooked_step(base_of(optimizer))(optimizer, closure)

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        return result   # one copy of each tensor on this process: nothing to spread

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        return params_of(optimizer)

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        return None

    # the optimizer's other methods

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """``.grad`` cleared, and whatever the placement's gradient sync set aside forgotten."""
        axis = self._placement().data_axis
        gradients = None if axis is None else axis.gradients
        if gradients is not None:
            gradients.forget(params_of(optimizer))
        base_of(optimizer).zero_grad(optimizer, set_to_none)

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """One logical copy: the state of DTensor parameters made whole (collectives)."""
        return full_optimizer_state(optimizer, base_of(optimizer))

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """A whole state dict; each process keeps its shards."""
        load_full_optimizer_state(optimizer, base_of(optimizer), state_dict)

    def add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        base_of(optimizer).add_param_group(optimizer, param_group)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of per-element optimizer state this process holds for ``optimizer``: its shards."""
        return local_state_bytes(optimizer)

    def reduce_scattered(self, params: list[torch.Tensor]) -> list[Any]:
        """No ZeRO-2 ranges: clipping measures each ``.grad``'s local part (:meth:`~.axis.DataAxis.gradient_parts`)."""
        return []
