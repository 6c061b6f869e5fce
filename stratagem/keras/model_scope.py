"""Which strategy an ``sg.Model`` trains under, and the scopes it refuses to be built or used in.

A ``Model`` trains under one strategy: the one passed as ``strategy=``, else the one whose
scope is open when it is built (the default strategy outside every scope). A model built
outside the scope it is used in would otherwise fail only at its first step or, around a
module of a multi-worker scope, train to other weights than the strategy's without a word
(each worker would read whole batches of the default strategy while the scope still exchanges
the gradients). So, as modules are, it is refused early, by an error that names the scopes and
the fix (``with strategy.scope(): model = sg.Model(module)``):

- at construction, a module created in the scope of a strategy other than the model's (the
  model built outside that scope, in another strategy's scope, or given another
  ``strategy=``) -- :class:`~stratagem.errors.ContextError`; and, where several replicas are
  in sync, a module with parameters the strategy does not hold (created outside every scope, or
  assigned after it: no copy per replica, no agreed values or summed gradients across workers) --
  :class:`~stratagem.errors.InvalidArgumentError`;
- at ``compile``, ``fit``, ``evaluate`` and ``predict``, a call inside the scope of another
  strategy than the model's -- :class:`~stratagem.errors.ContextError`.

Accepted: everything built and used in one strategy's scope (the tutorials' pattern); a model
built in the scope and used outside every scope (each method enters the scope itself); a model
built outside every scope, around a module created there, used outside every scope (the
default strategy throughout); ``strategy=`` naming the strategy whose scope made the module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stratagem import _context
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.placement.scope.hooks import module_placement

__all__ = ["check_used_in_scope", "model_strategy"]

_FIX = "`with strategy.scope(): model = sg.Model(module)`"


def model_strategy(module: nn.Module, strategy: Any = None) -> Any:
    """The strategy a ``Model`` of ``module`` trains under (``strategy``, else the current
    one); refuses a module that strategy did not create (see the module docstring)."""
    chosen = strategy if strategy is not None else _context.get_strategy()
    placement = module_placement(module)
    created = getattr(placement, "strategy", None)
    if created is not None and created is not chosen:
        if strategy is not None:
            where = f"with strategy={_name(chosen, created)}"
        elif chosen.is_default:
            where = "outside that scope (so for the default strategy)"
        else:
            where = f"in the scope of {_name(chosen, created)}"
        raise ContextError(
            f"the module given to sg.Model ({type(module).__name__}) was created in the scope of "
            f"{created!r}, but the Model is built {where}: it would not train under the strategy "
            f"that holds the module's parameters (its first step would fail or, across workers, it "
            f"would silently train to other weights). Build the Model in the scope the module was "
            f"created in: {_FIX}, or pass that strategy: sg.Model(module, strategy=strategy)")
    _check_placed(module, chosen)
    return chosen


def _check_placed(module: nn.Module, strategy: Any) -> None:
    """A module created outside every scope has no copy per replica, and across workers no agreed
    values or summed gradients: refused where several replicas are in sync."""
    first = next(iter(module.parameters()), None)
    if first is None or strategy.num_replicas_in_sync == 1 and strategy.topology.num_local_replicas == 1:
        return
    placement = strategy.placement
    placement.finalize()
    unheld = [".".join(part for part in (name, leaf) if part)
              for name, inner in module.named_modules() for leaf in placement.unheld(inner)]
    if unheld or (strategy.topology.num_local_replicas > 1 and placement.all_copies(first) is None):
        shown = f"; parameters it does not hold: {', '.join(repr(n) for n in unheld[:6])}" \
            f"{' ...' if len(unheld) > 6 else ''}" if unheld else ""
        raise InvalidArgumentError(
            f"the module given to sg.Model was not created in the scope of {strategy!r} (or parameters "
            f"were assigned to it after the scope closed{shown}), so its replicas would not be kept in "
            f"sync; create it inside `with strategy.scope():` and build the Model there too: {_FIX}")


def check_used_in_scope(strategy: Any, method: str) -> None:
    """Refuse ``model.<method>()`` called in the scope of another strategy than the model's
    ``strategy`` (outside every scope, and in its own scope, it runs)."""
    frame = _context.current_frame()
    if frame is None or frame.strategy is strategy:
        return
    built = ("outside every scope, so for the default strategy" if strategy.is_default
             else f"for {strategy!r}")
    raise ContextError(
        f"model.{method}() was called in the scope of {_name(frame.strategy, strategy)}, but this "
        f"sg.Model was built {built}: a Model trains under the strategy it was built for, and "
        f"cannot be used in another strategy's scope. Create the module and build the Model in "
        f"the scope you use it in: {_FIX}; or call {method}() outside that scope")


def _name(strategy: Any, other: Any) -> str:
    """``repr(strategy)``, told apart from ``other`` when both read the same."""
    text = repr(strategy)
    return f"{text} (a different {type(strategy).__name__} object, with the same settings)" if text == repr(other) else text
