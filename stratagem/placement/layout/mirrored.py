"""MirroredPlacement: a copy of every variable on each local replica's device.

Modules: a module that registers a tensor in scope joins the pending list; when it
is finished (at the latest when an optimizer is created, ``run`` starts, or the
outermost scope is left) its tensors move to the first replica's device and, with
several local replicas, one copy per replica is made and the module keeps its
tensors in a :class:`~stratagem.placement.layout.mirrored_dict.MirroredDict`. Across
workers, the collective then checks that every worker built the same tensors and
gives everyone the chief's initial values.

Optimizers: an optimizer created in scope steps in the order of :mod:`~stratagem.placement.data_axis.step`, with
gradients summed when backward ends (:mod:`~stratagem.placement.data_axis.gradient_sync`). How its update is applied and
its state kept is the placement's *update rule* (:mod:`~stratagem.placement.data_axis.update_rule`): by default
:class:`~stratagem.placement.data_axis.mirrored_update.MirroredUpdate` (a twin optimizer per local
replica over its own copies, the same update applied to every copy); central storage's
:class:`~stratagem.placement.data_axis.central.CentralUpdate` (the primaries and the optimizer state
once, on the parameter device); ZeRO's :class:`~stratagem.placement.data_axis.zero.ZeroUpdate` (the
update and its state split over the workers). The rule also says where the primaries live
(:meth:`~stratagem.placement.data_axis.update_rule.UpdateRule.storage`).

On logical CPU devices (``"cpu:0"``, ``"cpu:1"``: one memory), the replicas' parameters
share the primary's memory instead of copying it: every replica keeps its own
``Parameter`` object and gradient, the update is applied once, and the weights sit in the
caches once. Buffers (running statistics) stay one copy per replica.

With one device this placement only moves tensors to that device.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

from stratagem import _context
from stratagem.comm.collective import Collective
from stratagem.devices import Topology
from stratagem.placement.scope import sync_batch_norm
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.placement.scope.base import Placement
from stratagem.placement.data_axis.axis import DataAxis
from stratagem.placement.data_axis.buffers import BufferSync
from stratagem.placement.data_axis.gradient_sync import GradientSync
from stratagem.placement.scope.hooks import adopt
from stratagem.placement.layout.mirrored_dict import MirroredDict
from stratagem.placement.data_axis.mirrored_update import MirroredUpdate
from stratagem.placement.scope.unscoped import refuse_optimizer_over, unscoped_check
from stratagem.placement.data_axis.update_rule import UpdateRule


class MirroredPlacement(Placement):
    """Variables mirrored on the local replicas' devices (one device: just placed there); an
    optimizer's update applied by ``update``, the placement's update rule (default: one twin
    optimizer per replica, :class:`~stratagem.placement.data_axis.mirrored_update.MirroredUpdate`).

    Example::

        import torch, stratagem as sg
        from stratagem.placement.data_axis.mirrored_update import MirroredUpdate
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        assert isinstance(strategy.placement.update, MirroredUpdate)
        with strategy.scope():
            optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        assert type(optimizer).__name__ == "MirroredSGD"
    """

    kind = "Mirrored"
    synchronizes_batch_norm = True

    def __init__(self, strategy: Any, topology: Topology, collective: Collective, *,
                 update: UpdateRule | None = None):
        self._strategy_ref = weakref.ref(strategy)
        self.devices = topology.torch_devices
        self.num_replicas = topology.num_local_replicas
        self.collective = collective
        update = MirroredUpdate() if update is None else update
        self.kind = update.kind
        #: where the primaries (the tensors the module's dicts hold) live; replicas below
        #: ``first_copy`` compute with the primary itself, the others with copies; whether the
        #: replicas' parameters share the primary's memory (several logical CPU devices)
        self.home, self.first_copy, self.shares_parameters = update.storage(self.devices)
        #: the data axis: the gradient sync, the step, the update rule (how an optimizer's update is
        #: applied and its state kept: :mod:`~stratagem.placement.data_axis.update_rule`)
        self.data_axis = DataAxis(self, collective, update, num_replicas=self.num_replicas)
        update.bind(self)
        self._pending_modules: list[nn.Module] = []
        self._dicts: list[MirroredDict] = []
        # id(primary) -> (primary, every local replica's tensor)
        self._copies: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        # id(parameter) -> it, for every parameter placed with its module (its initial value agreed
        # between workers, its gradient summed): what `holds` answers
        self._held: dict[int, torch.Tensor] = {}
        self._placed: list[nn.Module] = []   # in placing order (the same on every worker)
        self._owners: list[nn.Module] = []   # placed modules and their parents: DDP's sync attribute
        self._layout = 0   # bumped whenever the placed parameters change
        self._hooked: tuple[int, list, Any] = (-1, [], None)   # (layout, primaries, their requires_grad)
        if collective.num_replicas > 1:
            if update.sums_gradients:   # sums gradients when backward ends
                self.data_axis.gradients = GradientSync(self.data_axis, collective)
            #: averages the buffers over the workers at each step and checkpoint
            self.data_axis.buffers = BufferSync(strategy, collective, self._placed.copy, self.all_copies)

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    # ---------------------------------------------------------------- modules

    def on_module_registered(self, module: nn.Module) -> None:
        sync_batch_norm.adopt(module)
        if self.num_replicas > self.first_copy:  # some replica computes with copies
            for attr, is_buffers in (("_parameters", False), ("_buffers", True)):
                current = module.__dict__[attr]
                if not isinstance(current, MirroredDict):
                    mirrored = MirroredDict(self, is_buffers, dict.items(current))
                    module.__dict__[attr] = mirrored
                    self._dicts.append(mirrored)
                elif current.placement is not self:
                    raise InvalidArgumentError(
                        f"module {type(module).__name__} already belongs to {current.placement.strategy!r}")
        if not self._pending_modules or self._pending_modules[-1] is not module:
            self._pending_modules.append(module)

    def finalize(self) -> None:
        if self._pending_modules:
            modules, self._pending_modules = self._pending_modules, []
            unique = list({id(m): m for m in modules}.values())
            for module in unique:
                self._place_module(module)
            self.collective.agree_on_modules(unique)
            self._hook_gradients()
        self.update.finalize()

    def on_submodule_registered(self, module: nn.Module) -> None:
        if self.gradients is not None and all(m is not module for m in self._owners):
            self._owners.append(module)

    def _place_module(self, module: nn.Module) -> None:
        if all(m is not module for m in self._placed):
            self._placed.append(module)
            self._owners.append(module)
        self._layout += 1
        first = self.home
        for attr in ("_parameters", "_buffers"):
            entries = module.__dict__[attr]
            for key, tensor in dict.items(entries):
                if tensor is not None and tensor.device != first:
                    with torch.no_grad():
                        tensor.data = tensor.data.to(first)
                if attr == "_parameters" and tensor is not None:
                    self._held[id(tensor)] = tensor
            if isinstance(entries, MirroredDict):
                for key in dict.keys(entries):
                    self.mirror_entry(entries, key)
                entries.finalized = True
                entries.record_versions()

    def mirror_entry(self, entries: MirroredDict, key: str) -> None:
        """(Re)make every replica's copy of one primary entry."""
        primary = dict.__getitem__(entries, key)
        if primary is None:
            for copies in entries.copies[self.first_copy:]:
                copies[key] = None
            return
        if primary.device != self.home:
            with torch.no_grad():
                primary.data = primary.data.to(self.home)
        known = self._copies.get(id(primary))
        if known is not None and known[0] is primary:   # a tied tensor: one copy per replica, shared too
            for r in range(self.first_copy, self.num_replicas):
                entries.set_copy(r, key, known[1][r])
            entries.versions[key] = primary._version
            return
        all_copies = [primary] * self.first_copy
        for r in range(self.first_copy, self.num_replicas):
            if isinstance(primary, nn.Parameter):
                # .data: the same memory with a version counter of its own (writes are told apart)
                data = primary.data if entries.shared else primary.detach().to(self.devices[r], copy=True)
                copy = nn.Parameter(data, requires_grad=primary.requires_grad)
            else:
                with torch.no_grad():
                    copy = primary.detach().to(self.devices[r], copy=True)
            entries.set_copy(r, key, copy)
            all_copies.append(copy)
        self._copies[id(primary)] = (primary, tuple(all_copies))
        entries.versions[key] = primary._version
        self._layout += 1

    def all_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        entry = self._copies.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Placed with its module; or, in one process, mirrored when assigned to a placed module
        after the scope (no other process needs to agree on its value)."""
        return self._held.get(id(tensor)) is tensor or (
            self.collective.num_workers == 1 and self.all_copies(tensor) is not None)

    def unheld(self, module: nn.Module) -> list[str]:
        if any(m is module for m in self._pending_modules):
            return []   # created in the scope, placed at the next finalize
        return [name for name, p in dict.items(module.__dict__["_parameters"]) if p is not None and not self.holds(p)]

    def replica_copy(self, tensor: torch.Tensor, local_id: int) -> torch.Tensor:
        if not self._copies:
            return tensor
        copies = self.all_copies(tensor)
        return tensor if copies is None else copies[local_id]

    # -------------------------------------------------------------- gradients

    def _hook_gradients(self) -> None:
        """Give the gradient sync every replica's tensor of every placed parameter (again when a
        parameter was added, replaced, frozen or unfrozen: only tensors requiring grad are hooked,
        and each replica's copy follows its primary's ``requires_grad``)."""
        if self.gradients is None:
            return
        if self._hooked[0] != self._layout:
            primaries = list({id(p): p for m in self._placed for p in dict.values(m.__dict__["_parameters"])
                              if p is not None}.values())
            self._hooked = (self._layout, primaries, None)
        _, primaries, flags = self._hooked
        now = [p.requires_grad for p in primaries]
        if now != flags:
            replicas = [[self.replica_copy(p, r) for p in primaries] for r in range(self.num_replicas)]
            for p, *copies in zip(primaries, *replicas):
                for copy in copies:
                    if copy.requires_grad != p.requires_grad:
                        copy.requires_grad_(p.requires_grad)
            self._hooked = (self._layout, primaries, now)
            self.gradients.update((self._layout, tuple(now)), replicas)

    def synced_models(self) -> list[nn.Module]:
        """The models whose DDP attribute ``require_backward_grad_sync`` the data axis reads: the
        placed modules and their parents."""
        return self._owners

    # -------------------------------------------------------------------- run

    def before_run(self) -> None:
        self.finalize()
        for entries in self._dicts:
            if not entries.holds_nothing():
                entries.push_modified()
        if self.gradients is not None:
            self._hook_gradients()
            self.gradients.in_run = True
        if self.num_replicas > self.first_copy:  # some replica computes with copies
            unscoped_check.acquire()

    def after_run(self, failed: bool = False) -> None:
        if self.gradients is not None:
            self.gradients.in_run = False
        if self.num_replicas > self.first_copy:
            unscoped_check.release()
        written = self.record_updates()
        if written and not failed:
            why = ("the replicas' parameters share one memory, so every replica's write would land on it"
                   if self.shares_parameters else "each replica computes with a copy of the parameters, "
                   "so the write would reach that copy only, and be lost at the next optimizer step")
            raise ContextError(
                f"a replica function wrote to the parameters {sorted(set(written))} in place; on "
                f"{self.strategy!r} {why}. Update parameters with an optimizer created in the scope "
                f"(its step sums the gradients and applies the update once), or write them outside "
                f"strategy.run")

    def record_updates(self) -> list[str]:
        """Note the versions of every copy (buffers may need averaging); return the names of
        shared parameters that a replica other than the first wrote in place."""
        written = []
        for entries in self._dicts:
            if not entries.holds_nothing():
                written += entries.after_run()
        return written

    # ------------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        if self.collective.num_replicas > 1:
            refuse_optimizer_over(
                optimizer, [p for group in optimizer.param_groups for p in group["params"] if not self.holds(p)],
                repr(self.strategy), f"their initial values are not agreed between the "
                f"{self.collective.num_replicas} replicas in sync and their gradients are not summed")
        adopt(optimizer, self)
        self.update.add(optimizer)

    def own_replica_context(self) -> Any:
        """The calling thread's replica context if it is a replica of this strategy, else None."""
        frame = _context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        return ctx if ctx is not None and ctx.strategy is self.strategy else None

    # the step, zero_grad, state dicts, add_param_group: the data axis's (Placement's defaults)

    def grad_scaler_refusal(self) -> str | None:
        return self.update.grad_scaler_refusal()

    def prepare_checkpoint(self, objects: dict[str, Any]) -> contextlib.AbstractContextManager:
        if self.buffers is not None:   # every worker is here: the file gets the averaged buffers
            self.buffers.average(None)
        return self.update.prepare_checkpoint(objects)

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        return self.update.splits_gradients(params)

    def norm_axes(self) -> tuple[Any, dict[str, int]]:
        """Clipping (ZeRO-2 over the workers): each worker's range of the sum, over the workers."""
        return self.collective.group, {"data": self.collective.group.rank}
