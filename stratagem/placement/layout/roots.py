"""RootsPlacement: the base of placements that take whole models created in scope.

The model-parallel placements (tensor parallel, pipeline) cut each model created in
scope as a whole, so they wait for it to be complete: modules that register tensors
wait in a pending list, and :meth:`RootsPlacement.new_roots` (called by ``finalize``)
returns the root modules among them -- those that no other pending or placed module
holds, with parameters -- moved to this process's device, after every process checked
that all built the same modules and took the chief's initial values (so that every
process, and every data-parallel group, starts alike).

What a subclass's layout is, is a tuple of *layout parts* in mesh order (:attr:`RootsPlacement.parts`:
a pipeline's ``Stages``, ``TensorParallel``, ``FullyShard``), each answering the same questions: which
modules it spreads over processes, whether it lays state out over the data axis, along which axes it
keeps a tensor whole. From them this base answers a checkpoint's (:meth:`RootsPlacement.spread`,
:meth:`RootsPlacement.gathers`) and clipping's (:meth:`RootsPlacement.norm_axes`) questions once.

Their data axis (:class:`~stratagem.placement.data_axis.axis.DataAxis`, set by the subclass with
its update rule) sums the gradients over a mesh's data axis or the workers, and steps.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping, sync_batch_norm
from stratagem.placement.scope.base import Placement
from stratagem.placement.scope.hooks import adopt, placement_of
from stratagem.placement.data_axis.axis import DataAxis


class RootsPlacement(Placement):
    """Collects modules created in scope; ``new_roots`` hands out the complete models. One replica per
    process; the subclass sets its ``data_axis`` (:meth:`_start_roots`)."""

    #: set by the subclass: where modules go, and every process (the start-up agreement)
    device: torch.device
    everyone: Collective
    #: set by the subclass: the layout's parts in mesh order, the first holding the whole models (e.g. a
    #: pipeline's ``Stages``, then ``TensorParallel``, then ``FullyShard``). Each says which modules it
    #: ``spreads`` over processes, whether it lays state out over the data axis (``spread_over_data``),
    #: and the axes along which it keeps a tensor whole (``norm_axes``)
    parts: tuple[Any, ...] = ()
    #: set by the subclass: the group whose processes' parts make a gradient's global norm (clipping),
    #: and whether it spans the data axis (along which the gradients are the same once summed)
    norm_group: Any = None
    norm_spans_data = False
    num_replicas = 1
    #: ``sg.Checkpoint.save``: what the gathering is called while it runs (None: no guard), and the
    #: refusal of a save that did not gather, ``{name}`` the object's
    gathering = None
    ungathered = "{name} can only be saved by sg.Checkpoint.save called on every process"

    def own_replica_context(self) -> None:
        """The step runs on the calling thread, this process's one replica (nothing to meet)."""
        return None

    def record_updates(self) -> list[str]:
        return []   # no replica copies to watch

    def synced_models(self) -> list[nn.Module]:
        """The models whose DDP attribute ``require_backward_grad_sync`` the data axis reads."""
        return self._placed

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    def _start_roots(self, strategy: Any, data: Any, update: Any) -> None:
        """The lists of models, and the data axis: over ``data`` (a mesh's data axis, or the workers),
        with the update rule ``update``; torch's clipping routed through this placement while it lives."""
        self._strategy_ref = weakref.ref(strategy)   # (weakly: the models do not keep their strategy alive)
        self.data_axis = DataAxis(self, data, update)
        self._pending: list[nn.Module] = []
        self._placed: list[nn.Module] = []
        # id(parameter before placing) -> (it, its replacement: a DTensor): an optimizer given the
        # parameters taken before the model was placed gets the replacements
        self._replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # id(module or optimizer) -> its whole state, gathered for the chief's checkpoint
        self.gathered: dict[int, dict] = {}
        clipping.register(self)

    def _take_replacements(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer created in scope: the replacements of the parameters it was given."""
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), (p, p))[1] for p in group["params"]]

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer created in scope: over the parameters the layout put in place of those it was
        given, its methods answered by this placement (its data axis)."""
        self._take_replacements(optimizer)
        adopt(optimizer, self)

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

    def norm_axes(self) -> tuple[Any, dict[str, int]]:
        """Clipping: the norm's group, and the axes along which the layout's parts keep a tensor whole
        (and, where the group spans it, the data axis: the gradients were summed over it)."""
        axes = {name: rank for part in self.parts for name, rank in part.norm_axes().items()}
        if self.norm_spans_data:
            axes["data"] = self.data_axis.collective.worker_index
        return self.norm_group, axes

    # ---------------------------------------------------------- checkpoints

    def spread(self, obj: Any) -> bool:
        """Whether ``obj`` has its state spread over processes by this placement, so that its state dict
        gathers it (a collective): an optimizer created in its scope, or a model that the layout's first
        part placed (it holds the whole models; the parts after it place what it kept here)."""
        if isinstance(obj, torch.optim.Optimizer):
            return placement_of(obj) is self
        return isinstance(obj, nn.Module) and self.parts[0].spreads(obj)

    def gathers(self) -> bool:
        """Whether this process takes part in gathering the state for a checkpoint: the first process of
        the data axis (the others hold the same values), or every process where a layout part or the
        update rule lays state out over the data axis (FSDP2's units, ZeRO's ranges)."""
        return (self.data_axis.collective.worker_index == 0 or self.update.spread_over_data
                or any(part.spread_over_data for part in self.parts))

    @contextlib.contextmanager
    def prepare_checkpoint(self, objects: dict[str, Any]) -> Iterator[None]:
        """Every process, around the chief's writing: the processes that :meth:`gathers` gather the
        whole state of each spread module and optimizer (the others hold the same values); the
        chief keeps it for :meth:`write_checkpoint_state`, dropped on exit."""
        if self.gathers():
            chief = self.everyone.worker_index == 0
            guard = contextlib.nullcontext() if self.gathering is None else self.everyone.group.guard(self.gathering)
            with guard:
                for obj in objects.values():
                    if self.spread(obj):
                        state = obj.state_dict()
                        if chief:
                            self.gathered[id(obj)] = state
        try:
            yield
        finally:
            self.gathered.clear()

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> Any:
        """The whole state that :meth:`prepare_checkpoint` gathered: one logical copy, no other files."""
        if not self.spread(obj):
            return None
        if id(obj) not in self.gathered:
            raise InvalidArgumentError(self.ungathered.format(name=name))
        return self.gathered[id(obj)], {}

    @contextlib.contextmanager
    def keeping_pending(self) -> Iterator[None]:
        """The modules created in scope meanwhile (a tracer's copies of a model) are no new models."""
        pending = list(self._pending)
        try:
            yield
        finally:
            self._pending = pending

    def _forget_pending(self, modules: Any) -> None:
        """Modules that placing created in scope are not new models."""
        ids = {id(m) for m in modules}
        self._pending = [m for m in self._pending if id(m) not in ids]
