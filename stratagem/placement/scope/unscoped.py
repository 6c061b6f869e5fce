"""Refusing parameters a strategy does not hold, and what a multi-replica ``run`` would share.

A module created outside every scope has no copy per replica; an optimizer created outside
every scope over mirrored parameters would be stepped by every replica thread. Both are
refused, with the fix, at their first use inside such a ``run`` (:class:`UnscopedCheck`,
acquired by the mirrored placement around each ``run`` where some replica computes with copies).

Across processes, a parameter the strategy did not place (a module created outside the scope,
a parameter or submodule assigned to a placed module after the scope closed) has no agreed
initial value and no summed gradient: each worker would silently train its own copy. Where
several replicas are in sync, a module's forward refuses it (:func:`refuse_unheld`, on every
worker alike, since every worker runs the same forward): inside ``run``; outside ``run`` in the
scope of a strategy whose process holds one replica (that replica's step); and outside every
scope, for a module the strategy placed (its own parameters and children are looked at). The
look is remembered per module until its parameters or children change.

Why ``Optimizer.zero_grad`` is replaced on the class while multi-replica runs are active, not
on the optimizers involved alone: none of torch's hooks sees it (torch 2.13's ``Optimizer``
has global and per-optimizer hooks for ``step`` and the state dicts only; ``zero_grad`` calls
none). The optimizers involved are not ours: created outside every scope, possibly before any
scope opened, when no creation wrapper is installed, and nothing leads from a parameter to
the optimizers that hold it, so they cannot be found at a run's start to be wrapped one by
one. Their first ``step()`` (torch's global step pre-hook finds them) comes too late: a loop's
``zero_grad()`` precedes it, and on one replica's thread it clears gradients another replica's
backward is writing. So the class's method is wrapped while such runs are active (the first
acquire wraps the method it finds there, the last release puts that one back); the wrapper
passes the call on at once outside such runs and for every optimizer created in scope.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stratagem import _context
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.placement.scope.hooks import OWN_STEP_PRE_HOOKS, own_placement, placement_of
from stratagem.placement.layout.mirrored_dict import MirroredDict


class UnscopedCheck:
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

    def watch_modules(self) -> None:
        """Install the forward pre-hook (it stays: see the class docstring)."""
        with self._lock:
            if self._module_hook is None:
                self._module_hook = nn.modules.module.register_module_forward_pre_hook(_forbid_unscoped)

    def acquire(self) -> None:
        self.watch_modules()
        with self._lock:
            if self._users == 0:
                self._handles = [register_optimizer_step_pre_hook(_forbid_unscoped_optimizer)]
                found = torch.optim.Optimizer.__dict__["zero_grad"]   # torch's, or what someone put there
                if found is not _checked_zero_grad:   # (ours, put back after the runs by who replaced it: kept)
                    _found[0] = found
                torch.optim.Optimizer.zero_grad = _checked_zero_grad
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                current = torch.optim.Optimizer.__dict__["zero_grad"]
                if current is not _checked_zero_grad:   # (it may call ours, and cannot be told apart: loudly)
                    warnings.warn(
                        f"torch.optim.Optimizer.zero_grad was replaced ({current!r}) while a multi-replica "
                        f"run was active, over the method stratagem wraps during such runs; stratagem puts "
                        f"back {_found[0]!r}, found at the runs' start. Replace it before or after "
                        f"strategy.run", RuntimeWarning, stacklevel=2)
                torch.optim.Optimizer.zero_grad = _found[0]
                for handle in self._handles:
                    handle.remove()


def _forbid_unscoped(module: nn.Module, args: Any) -> None:
    frame = _context.current_frame()   # (read once: this runs at every module call)
    if frame is not None and frame.replica_context is not None and frame.strategy.topology.num_local_replicas > 1:
        params = module.__dict__.get("_parameters")
        if params and not isinstance(params, MirroredDict):
            names = ", ".join(repr(name) for name in params)
            raise ContextError(
                f"module {type(module).__name__} has parameters with no copy per replica ({names}): "
                f"it was created outside strategy.scope(), or they were assigned to it after the scope "
                f"closed. Every replica of {frame.strategy!r} would share one copy and the replicas "
                f"would silently diverge. Create the module (or assign the parameters) inside "
                f"`with strategy.scope():`")
    if torch.compiler.is_compiling():
        return   # (traced by torch.compile: the compiled module's own call, eager, looked at its tree)
    placement = _acting_placement(module, frame)
    if placement is not None:
        refuse_unheld(module, placement)


def _acting_placement(module: nn.Module, frame: Any) -> Any:
    """The placement whose parameters ``module``'s forward must use here, where several
    replicas are in sync: the strategy's whose replica this thread acts as (inside ``run``, or
    outside it with one replica in this process), else, outside every scope, the one that
    placed ``module`` (``frame``: this thread's)."""
    if frame is None or frame.strategy.is_default:
        placement = own_placement(module)
    elif frame.replica_context is not None or frame.strategy.outside_replica_context() is not None:
        placement = frame.strategy.placement
    else:
        return None   # several replicas in this process, outside run: not a replica's step
    if placement is None or placement.strategy is None or placement.strategy.num_replicas_in_sync < 2:
        return None
    return placement


#: module -> (placement, its parameters' and children's ids) when they were last found held
_looked: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def refuse_unheld(module: nn.Module, placement: Any) -> None:
    """Raise, naming them and the fix, if ``module``'s parameters or its children's (those not
    placed themselves) include one ``placement`` neither placed nor is about to place."""
    params, children = module.__dict__.get("_parameters", {}), module.__dict__.get("_modules", {})
    key = (id(placement), tuple(map(id, dict.values(params))), tuple(map(id, dict.values(children))))
    if _looked.get(module) == key:
        return
    other = own_placement(module)
    if other is not None and other is not placement:
        raise ContextError(
            f"a module created in the scope of {other.strategy!r} ({type(module).__name__}) computes for "
            f"{placement.strategy!r}; use each module only with the strategy it was created under")
    unheld = placement.unheld(module)
    for name, child in dict.items(children):
        if child is None or own_placement(child) is placement:
            continue   # (its own forward, or its parent's, looks at it)
        unheld += [".".join(part for part in (name, sub, leaf) if part)
                   for sub, inner in child.named_modules() for leaf in placement.unheld(inner)]
    if unheld:
        strategy = placement.strategy
        raise ContextError(
            f"{type(module).__name__} computes with parameters that {strategy!r} does not hold "
            f"({', '.join(repr(n) for n in unheld[:6])}{' ...' if len(unheld) > 6 else ''}): they were "
            f"created outside strategy.scope(), or assigned to a module after the scope closed. Their "
            f"initial values are not agreed between the {strategy.num_replicas_in_sync} replicas in sync "
            f"and their gradients are not summed, so each worker would silently train its own copy. "
            f"Create the module (and assign every parameter or submodule) inside "
            f"`with strategy.scope():`, or after `sg.experimental_set_strategy(strategy)`")
    _looked[module] = key


def refuse_optimizer_over(optimizer: torch.optim.Optimizer, outside: list, strategy: str, why: str) -> None:
    """Refuse ``optimizer``, created in the scope of ``strategy`` (its description), if ``outside``
    lists parameters the strategy did not place; ``why`` says what that would break."""
    if outside:
        shapes = [list(p.shape) for p in outside[:4]]
        raise InvalidArgumentError(
            f"{type(optimizer).__name__} was created in the scope of {strategy} over {len(outside)} "
            f"parameter(s) (shapes {shapes}{' ...' if len(outside) > 4 else ''}) that were not created in "
            f"that scope: they belong to a module created outside the scope, or were assigned to one after "
            f"the scope closed, so {why}. Create the model (and assign every parameter) inside "
            f"`with strategy.scope():`, or after `sg.experimental_set_strategy(strategy)`")


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


OWN_STEP_PRE_HOOKS.add(_forbid_unscoped_optimizer)   # (a scoped optimizer's step need not run it)


#: the ``Optimizer.zero_grad`` that :func:`_checked_zero_grad` calls: the one found at acquire
_found: list[Any] = [torch.optim.Optimizer.zero_grad]


@functools.wraps(torch.optim.Optimizer.zero_grad)
def _checked_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    _forbid_unscoped_optimizer(self)
    _found[0](self, set_to_none)


#: the one check, shared by every mirrored placement
unscoped_check = UnscopedCheck()
