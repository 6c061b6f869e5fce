"""MirroredPlacement: a copy of every variable on each local replica's device.

Modules: a module that registers a tensor in scope joins the pending list; when it
is finished (at the latest when an optimizer is created, ``run`` starts, or the
outermost scope is left) its tensors move to the first replica's device and, with
several local replicas, one copy per replica is made and the module keeps its
tensors in a :class:`~stratagem.placement.mirrored_dict.MirroredDict`. Across
workers, the collective then checks that every worker built the same tensors and
gives everyone the chief's initial values.

Optimizers (:mod:`stratagem.placement.mirrored_optimizers`): each local replica gets
a twin optimizer over its own copies; one logical step sums the gradients and
applies the same update to every copy.

On logical CPU devices (``"cpu:0"``, ``"cpu:1"``: one memory), the replicas' parameters
share the primary's memory instead of copying it: every replica keeps its own
``Parameter`` object and gradient, the update is applied once, and the weights sit in the
caches once. Buffers (running statistics) stay one copy per replica.

With one device this placement only moves tensors to that device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stratagem import _context
from stratagem.comm.collective import Collective
from stratagem.devices import Topology
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.placement.base import Placement
from stratagem.placement.gradient_sync import GradientSync
from stratagem.placement.hooks import adopt, placement_of
from stratagem.placement.mirrored_dict import MirroredDict
from stratagem.placement.mirrored_optimizers import MirroredOptimizers


class MirroredPlacement(MirroredOptimizers, Placement):
    """Variables mirrored on the local replicas' devices (one device: just placed there)."""

    kind = "Mirrored"

    def __init__(self, strategy: Any, topology: Topology, collective: Collective):
        self._strategy_ref = weakref.ref(strategy)
        self.devices = topology.torch_devices
        self.num_replicas = topology.num_local_replicas
        #: where the primaries (the tensors the module's dicts hold) live
        self.home = self.devices[0]
        #: replicas below it compute with the primary itself; the others with copies
        self.first_copy = 1
        #: replicas' parameters share the primary's memory (several logical CPU devices)
        self.shares_parameters = self.num_replicas > 1 and all(d.type == "cpu" for d in self.devices)
        self.collective = collective
        self._pending_modules: list[nn.Module] = []
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._dicts: list[MirroredDict] = []
        # id(primary) -> (primary, every local replica's tensor)
        self._copies: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._build_lock = threading.Lock()  # replica threads share one set of twins
        self._unscoped_check: Any = None
        self._placed: list[nn.Module] = []   # in placing order (the same on every worker)
        self._owners: list[nn.Module] = []   # placed modules and their parents: DDP's sync attribute
        self._layout = 0   # bumped whenever the placed parameters change
        self._hooked: tuple[int, list, Any] = (-1, [], None)   # (layout, primaries, their requires_grad)
        #: sums gradients when backward ends (None: one replica in all, nothing to sum)
        self.gradients = GradientSync(self) if self.syncs_gradients() else None

    def syncs_gradients(self) -> bool:
        return self.collective.num_replicas > 1

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    # ---------------------------------------------------------------- modules

    def on_module_registered(self, module: nn.Module) -> None:
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
        if self._pending_optimizers:
            optimizers, self._pending_optimizers = self._pending_optimizers, []
            for optimizer in optimizers:
                self._prepare_optimizer(optimizer)

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

    def requires_sync(self) -> bool:
        """False while a user set DistributedDataParallel's ``require_backward_grad_sync = False``
        on a model created in scope (nanoGPT's accumulation idiom)."""
        return all(m.__dict__.get("require_backward_grad_sync", True) for m in self._owners)

    def no_sync(self) -> Any:
        if self.gradients is None:
            return contextlib.nullcontext()
        ctx = self.own_replica_context()
        return self.gradients.no_sync(None if ctx is None else ctx.local_replica_id)

    # -------------------------------------------------------------------- run

    def before_run(self) -> None:
        self.finalize()
        for entries in self._dicts:
            entries.push_modified()
        if self.gradients is not None:
            self._hook_gradients()
            self.gradients.in_run = True
        if self.num_replicas > self.first_copy:  # some replica computes with copies
            _unscoped_check.acquire()

    def after_run(self, failed: bool = False) -> None:
        if self.gradients is not None:
            self.gradients.in_run = False
        if self.num_replicas > self.first_copy:
            _unscoped_check.release()
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
            written += entries.after_run()
        return written

    # ------------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        adopt(optimizer, self)   # its record's twins: built when the optimizer is finished
        self._pending_optimizers.append(optimizer)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._build_twins(optimizer)

    def grad_scaler_refusal(self) -> str | None:
        return None   # every replica's copy has its .grad (also under CentralPlacement)


class _UnscopedModuleCheck:
    """While multi-replica runs are active, refuse modules whose parameters are not mirrored,
    and optimizers created outside the scope over mirrored parameters.

    Such a module (created outside the scope) would be shared by every replica thread: the
    replicas would silently diverge, or race inside autograd. Such an optimizer would be
    stepped by every replica on the primary copy, and its ``zero_grad`` on one replica's
    thread would clear gradients another replica's backward is writing (a crash, not just a
    wrong result). Both are refused at their first use inside ``run``: the forward pre-hook,
    torch's global optimizer step pre-hook, and ``Optimizer.zero_grad`` wrapped while such
    runs are active (torch has no zero_grad hook).

    The forward pre-hook, once installed, stays (outside such runs it returns at once):
    ``torch.compile`` guards on the keys of torch's global hook dict, and a hook registered
    anew at every run would make a compiled model recompile at every step, then silently
    fall back to eager once ``torch._dynamo.config.recompile_limit`` is reached.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handles: list[Any] = []
        self._module_hook: Any = None

    def acquire(self) -> None:
        with self._lock:
            if self._module_hook is None:
                self._module_hook = nn.modules.module.register_module_forward_pre_hook(_forbid_unscoped)
            if self._users == 0:
                self._handles = [register_optimizer_step_pre_hook(_forbid_unscoped_optimizer)]
                torch.optim.Optimizer.zero_grad = _checked_zero_grad
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                torch.optim.Optimizer.zero_grad = _original_zero_grad
                for handle in self._handles:
                    handle.remove()


def _multi_replica_frame() -> Any:
    frame = _context.current_frame()
    if frame is None or frame.replica_context is None or frame.strategy.topology.num_local_replicas < 2:
        return None
    return frame


def _forbid_unscoped(module: nn.Module, args: Any) -> None:
    frame = _multi_replica_frame()
    if frame is None:
        return
    params = module.__dict__.get("_parameters")
    if params and not isinstance(params, MirroredDict):
        names = ", ".join(repr(name) for name in params)
        raise ContextError(
            f"module {type(module).__name__} has parameters with no copy per replica ({names}): "
            f"it was created outside strategy.scope(), or they were assigned to it after the scope "
            f"closed. Every replica of {frame.strategy!r} would share one copy and the replicas "
            f"would silently diverge. Create the module (or assign the parameters) inside "
            f"`with strategy.scope():`")


def _forbid_unscoped_optimizer(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    frame = _context.current_frame()   # (any replica count: only parameters with copies are looked at)
    if frame is None or frame.replica_context is None or placement_of(optimizer) is not None:
        return   # outside run, or ours: a scoped optimizer or a twin
    placement = frame.strategy.placement
    if any(placement.all_copies(p) is not None for group in optimizer.param_groups for p in group["params"]):
        raise ContextError(
            f"{type(optimizer).__name__} was created outside strategy.scope() but updates the "
            f"parameters of a model created in the scope of {frame.strategy!r}: every replica would "
            f"step it (and clear its gradients) on its own thread, so the replicas would diverge or "
            f"race. Create the optimizer inside `with strategy.scope():` too; its step then sums the "
            f"replicas' gradients and applies the update once")


_original_zero_grad = torch.optim.Optimizer.zero_grad


@functools.wraps(_original_zero_grad)
def _checked_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    _forbid_unscoped_optimizer(self)
    _original_zero_grad(self, set_to_none)


_unscoped_check = _UnscopedModuleCheck()
