"""How a scope sees what is created in it, and the class of optimizers created there.

While at least one non-default strategy's scope is open (on any thread), these are
installed in torch, and all are removed when the last such scope closes
(:func:`scope_opened` / :func:`scope_closed`):

- module registration hooks (``register_module_parameter_registration_hook``, the buffer
  one and ``register_module_module_registration_hook``), which report each module that
  registers a tensor or a submodule on a thread whose innermost frame is a strategy's
  cross-replica scope to that strategy's placement (:func:`module_placement` answers later
  in whose scope a module was built);
- a wrapper of ``torch.optim.Optimizer.__init__`` (torch has no optimizer-creation hook,
  so it is patched, and only while a scope is open). It calls the original ``__init__``
  and, only for an optimizer created on a thread inside a scope, hands it to that
  strategy's placement (``on_optimizer_created``, which calls :func:`adopt`). Optimizers
  created outside every scope, and stratagem's own (:class:`internal_optimizers`), are
  never touched;
- the same for ``torch.amp.GradScaler.__init__``: a scaler created in scope is handed to
  :func:`stratagem.placement.scope.grad_scaler.adopt` (one decision for every replica); and
  ``scale`` / ``unscale_`` / ``step`` / ``update`` refuse, inside a multi-replica ``run``, a
  scaler created outside every scope (:func:`~stratagem.placement.scope.grad_scaler.refuse_unscoped`).

An optimizer created in scope then has its class replaced by a subclass of its own
class, named after the placement (``MirroredSGD``, ``ParameterServerAdam``;
:func:`distributed_class`), so that ``isinstance`` checks and schedulers keep working while
``type(opt).__name__`` and ``repr(opt)`` say what stratagem changed (the class also has
Keras's ``learning_rate``: :mod:`stratagem.placement.scope.learning_rate`). Its record
(:mod:`stratagem._record`) holds the placement (:func:`placement_of`) and its own class
(:func:`base_of`).

Step hooks: torch runs an optimizer's step pre/post hooks inside its ``step``
wrapper. A scoped optimizer's ``step`` is ours; it fires the user's hooks itself,
once per logical step (:func:`step_hooks` lists them, :func:`run_hooks` runs them, in the
order of :mod:`stratagem.placement.data_axis.step`), and applies the update to every copy through
:func:`unhooked_step`, which skips torch's wrapper.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn

from stratagem import _context
from stratagem._record import attach, record, record_of
from stratagem.placement.scope import grad_scaler
from stratagem.placement.scope.learning_rate import rate_attributes

_lock = threading.Lock()
_internal = threading.local()   # set while stratagem builds optimizers of its own
_users = 0
_module_placements: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_installed: list[Any] = []   # the registration hooks' handles while scopes are open
_original_init = torch.optim.Optimizer.__init__
_original_scaler_init = torch.amp.GradScaler.__init__
_SCALER_METHODS = ("scale", "unscale_", "step", "update")
_original_scaler_methods = {name: getattr(torch.amp.GradScaler, name) for name in _SCALER_METHODS}


class internal_optimizers:
    """While active on this thread, optimizers created are stratagem's own (never adopted)."""

    def __enter__(self) -> None:
        _internal.active = True

    def __exit__(self, *exc: Any) -> None:
        _internal.active = False


def _scoped_placement() -> Any:
    frame = _context.current_frame()
    if frame is None or frame.replica_context is not None or frame.strategy.is_default:
        return None
    return frame.strategy.placement


def _on_tensor_registered(module: nn.Module, name: str, tensor: Any) -> None:
    placement = _scoped_placement()
    if placement is not None:
        _module_placements[module] = weakref.ref(placement)   # (a strong value would keep the module alive)
        placement.on_module_registered(module)
    return None


def module_placement(module: nn.Module) -> Any:
    """The placement of the strategy in whose scope ``module`` (or a submodule) registered a
    tensor, else None."""
    for submodule in module.modules():
        placement = _module_placements.get(submodule, lambda: None)()
        if placement is not None:
            return placement
    return None


def own_placement(module: nn.Module) -> Any:
    """The placement in whose scope ``module`` itself registered a tensor or a submodule, else None."""
    found = _module_placements.get(module)
    return None if found is None else found()


def _on_submodule_registered(module: nn.Module, name: str, submodule: Any) -> None:
    placement = _scoped_placement()
    if placement is not None and submodule is not None:
        _module_placements[module] = weakref.ref(placement)
        placement.on_submodule_registered(module)
    return None


def _optimizer_init(self: torch.optim.Optimizer, params: Any, defaults: dict) -> None:
    placement = _scoped_placement()
    if placement is None or getattr(_internal, "active", False) or type(self) in _SCOPED_CLASSES:
        return _original_init(self, params, defaults)
    placement.finalize()   # modules placed before the optimizer captures parameters
    _original_init(self, params, defaults)
    placement.on_optimizer_created(self)


def _grad_scaler_init(self: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> None:
    _original_scaler_init(self, *args, **kwargs)
    placement = _scoped_placement()
    if placement is not None and not isinstance(self, grad_scaler.ReplicaGradScaler):
        grad_scaler.adopt(self, placement)


def _checked_scaler_method(name: str) -> Callable[..., Any]:
    original = _original_scaler_methods[name]

    @functools.wraps(original)
    def method(self: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, grad_scaler.ReplicaGradScaler):
            grad_scaler.refuse_unscoped(self, name)
        return original(self, *args, **kwargs)
    return method


_checked_scaler_methods = {name: _checked_scaler_method(name) for name in _SCALER_METHODS}


def _patch_grad_scaler(install: bool) -> None:
    torch.amp.GradScaler.__init__ = _grad_scaler_init if install else _original_scaler_init
    for name in _SCALER_METHODS:
        setattr(torch.amp.GradScaler, name, (_checked_scaler_methods if install else _original_scaler_methods)[name])


def scope_opened() -> None:
    """A non-default scope was entered on some thread: install the hooks if first."""
    global _users
    with _lock:
        if _users == 0:
            _installed[:] = [nn.modules.module.register_module_parameter_registration_hook(_on_tensor_registered),
                             nn.modules.module.register_module_buffer_registration_hook(_on_tensor_registered),
                             nn.modules.module.register_module_module_registration_hook(_on_submodule_registered)]
            torch.optim.Optimizer.__init__ = _optimizer_init
            _patch_grad_scaler(True)
        _users += 1


def scope_closed() -> None:
    """The matching exit: the last one removes every hook and restores ``__init__``."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for handle in _installed:
                handle.remove()
            _installed.clear()
            if torch.optim.Optimizer.__init__ is _optimizer_init:
                torch.optim.Optimizer.__init__ = _original_init
            _patch_grad_scaler(False)


def hooks_installed() -> bool:
    """Whether stratagem has anything installed in torch right now (for tests)."""
    return torch.optim.Optimizer.__init__ is _optimizer_init or bool(_installed) or \
        torch.amp.GradScaler.__init__ is _grad_scaler_init


# ------------------------------------------------------------ the optimizer class

_CLASSES: dict[tuple[type, str], type] = {}
_SCOPED_CLASSES: set[type] = set()   # the classes of _CLASSES (an optimizer of one is ours already)


def _not_compiled(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run eagerly when a compiled function calls it: a strategy's optimizer step
    synchronizes replicas and workers (``torch.compiler.disable``, applied at the first call so
    that importing stratagem does not load dynamo; torch's own optimizers defer it the same way)."""
    return torch._disable_dynamo(method)


def distributed_class(base: type, kind: str) -> type:
    """The subclass of ``base`` whose methods ask the optimizer's placement what to do."""
    cls = _CLASSES.get((base, kind))
    if cls is not None:
        return cls

    # in a compiled training step, dynamo runs these as they are (a graph break, as at a plain
    # optimizer's zero_grad) instead of tracing the replicas' exchanges, barriers and
    # thread-local replica lookups
    @_not_compiled
    def step(self, closure=None):
        return record(self).placement.optimizer_step(self, closure)
    # torch wraps an optimizer class's step to run the hooks (at __init__, and again in
    # load_state_dict); ours fires them itself, once per logical step: never wrap it
    step.hooked = True

    @_not_compiled
    def zero_grad(self, set_to_none: bool = True):
        record(self).placement.optimizer_zero_grad(self, set_to_none)

    def state_dict(self):
        return record(self).placement.optimizer_state_dict(self)

    def load_state_dict(self, state_dict):
        record(self).placement.optimizer_load_state_dict(self, state_dict)

    def add_param_group(self, param_group):
        placement = placement_of(self)
        if placement is None:  # still inside Optimizer.__init__
            return base.add_param_group(self, param_group)
        placement.optimizer_add_param_group(self, param_group)

    def __reduce_ex__(self, protocol):
        return record(self).placement.optimizer_reduce(self)

    def __repr__(self):
        return f"{base.__repr__(self)}\n(created in the scope of {record(self).placement.strategy!r})"

    name = f"{kind}{base.__name__}"
    cls = type(name, (base,), {
        **rate_attributes(base), "step": step, "zero_grad": zero_grad, "state_dict": state_dict,
        "load_state_dict": load_state_dict, "add_param_group": add_param_group,
        "__reduce_ex__": __reduce_ex__, "__repr__": __repr__,
        "__module__": "stratagem.placement",
        "__doc__": f"A {base.__name__} created in a stratagem strategy's scope ({kind.lower()} placement).",
    })
    cls.__qualname__ = name
    _CLASSES[(base, kind)] = cls
    _SCOPED_CLASSES.add(cls)
    return cls


def adopt(optimizer: torch.optim.Optimizer, placement: Any) -> None:
    """Make ``optimizer`` (just created in scope) ask ``placement`` what its methods mean."""
    base = type(optimizer)
    optimizer.__class__ = distributed_class(base, placement.kind)
    attach(optimizer, placement=placement, base=base)


def placement_of(optimizer: torch.optim.Optimizer) -> Any:
    """The placement of an optimizer created in a strategy's scope (or of a replica's twin of
    one), else None."""
    found = record_of(optimizer)
    return None if found is None else found.placement


def base_of(optimizer: torch.optim.Optimizer) -> type:
    """The own class of an optimizer created in a strategy's scope (``SGD`` under ``MirroredSGD``)."""
    return record(optimizer).base


def unhooked_step(base: type) -> Callable[..., Any]:
    """``base.step`` without torch's hook-running wrapper (we fire the hooks once ourselves)."""
    step = base.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


#: Global step pre-hooks that stratagem registers for its own checks, each a no-op for a scoped
#: optimizer (it looks at optimizers created outside every scope): :func:`step_hooks` leaves them out,
#: so a scoped step neither runs them nor holds the replicas' meeting that a user's hook needs.
OWN_STEP_PRE_HOOKS: set[Callable[..., Any]] = set()


def step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    """The step pre- and post-hooks that torch would run for ``optimizer`` (global ones first
    among the pre-hooks, last among the post-hooks, as torch's wrapper orders them), stratagem's
    own checks (:data:`OWN_STEP_PRE_HOOKS`) left out."""
    global_pre, global_post = _global_step_hooks()
    global_pre = [hook for hook in global_pre if hook not in OWN_STEP_PRE_HOOKS]
    pre = list(itertools.chain(global_pre, optimizer.__dict__.get("_optimizer_step_pre_hooks", {}).values()))
    post = list(itertools.chain(optimizer.__dict__.get("_optimizer_step_post_hooks", {}).values(), global_post))
    return pre, post


def _global_step_hooks() -> tuple[list, list]:
    """The hooks registered by ``torch.optim.optimizer.register_optimizer_step_pre_hook`` and
    ``..._post_hook``. torch's private dicts, read here only: torch has no public way to list
    them (the registration returns a handle that can only remove its hook), and only its own
    step wrapper runs them, which a scoped optimizer's step replaces (it fires them once per
    logical step, between its replicas' barriers). The optimizer's own hooks above are torch's
    private ``_optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks`` for the same reason."""
    return (list(torch_optimizer._global_optimizer_pre_hooks.values()),
            list(torch_optimizer._global_optimizer_post_hooks.values()))


def run_hooks(hooks: list, optimizer: torch.optim.Optimizer) -> None:
    for hook in hooks:
        hook(optimizer, (), {})
