"""A module's structure without its values: what ``model.save`` stores, ``load_model`` rebuilds.

Rebuilding a model without its constructor's arguments needs the objects themselves, so the
structure is pickled -- but not the live module: :func:`clean_copy` first makes a copy of
its tree that holds none of what a strategy attached to it (the per-replica dicts of a
mirrored placement become plain dicts of replica 0's tensors, a placement's module classes
and hooks are left out; the user's own hooks stay). Tensors never enter the pickle: each is a
reference (pickle's *persistent id*) to an entry of the model's ``state_dict`` or of a list
of other tensors, which the file stores as ``torch.load(weights_only=True)`` reads them.

Loading (:func:`load`) with ``safe_mode=True`` admits only what cannot run code of the
file's choosing: subclasses of ``torch.nn.Module``, of ``torch.optim.Optimizer`` and of
stratagem's losses and metrics, importable by name from modules already imported (or from
``torch`` and ``stratagem``); public functions of ``torch.nn.functional`` (e.g. an
activation); torch dtypes, devices, sizes; plain containers; and whatever ``custom_objects``
names. Anything else -- ``os.system``, ``builtins.eval``, a planted global -- is refused
before it is called.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import inspect
import io
import pickle
import re
import sys
from typing import Any, Callable

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.metrics.base import Metric
from stratagem.keras.losses import Loss

__all__ = ["clean_copy", "dump", "load", "logical_module", "register_in_scope"]

_HOOKS = re.compile(r"^_\w*hooks$")   # nn.Module's dicts of hooks (_forward_hooks, _state_dict_pre_hooks, ...)
_PLACEMENT_MODULES = ("stratagem.ps.", "stratagem.placement.")
_ADMITTED_CLASSES = (nn.Module, torch.optim.Optimizer, Loss, Metric)
_ADMITTED_VALUES = {torch.device, torch.Size, collections.OrderedDict, builtins.slice, builtins.complex,
                    builtins.frozenset, builtins.set}
_FUNCTION_MODULES = ("torch.nn.functional", "torch._C._nn")


def logical_module(module: nn.Module) -> nn.Module:
    """The module itself, unwrapped from ``torch.compile`` (whose state_dict keys carry a prefix)."""
    while isinstance(getattr(module, "_orig_mod", None), nn.Module) and type(module).__name__ == "OptimizedModule":
        module = module._orig_mod
    return module


# ------------------------------------------------------------------ saving

def clean_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree as plain PyTorch built it: the same classes (a placement's
    subclass replaced by the user's class), attributes and user hooks, plain dicts of the
    original tensor objects, and none of a strategy's hooks. Shared submodules stay shared."""
    copies: dict[int, nn.Module] = {}

    def copy(m: nn.Module, where: str) -> nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        cls = _user_class(type(m), where)
        clone = cls.__new__(cls)
        copies[id(m)] = clone
        state = {}
        for key, value in m.__dict__.items():
            if key in ("_parameters", "_buffers"):
                value = dict(dict.items(value))   # a placement's dict: its primary tensors
            elif key == "_modules":
                value = {name: None if child is None else copy(child, f"{where}.{name}")
                         for name, child in value.items()}
            elif _HOOKS.match(key) and isinstance(value, dict):
                value = type(value)((k, hook) for k, hook in value.items() if not _from_stratagem(hook))
            elif key == "require_backward_grad_sync":   # DistributedDataParallel's switch, read by strategies
                continue
            state[key] = value
        clone.__dict__.update(state)
        return clone

    return copy(module, type(module).__name__)


def _user_class(cls: type, where: str) -> type:
    for candidate in cls.__mro__:   # a class a placement gave the module (PSEmbedding): the user's
        if not candidate.__module__.startswith(_PLACEMENT_MODULES):
            cls = candidate
            break
    try:
        found = _lookup(cls.__module__, cls.__qualname__, allow_import=False)
    except (ImportError, AttributeError):
        found = None
    if found is not cls:
        raise InvalidArgumentError(
            f"model.save cannot store the architecture: {where} is a {cls.__qualname__} (module {cls.__module__}), "
            f"a class that cannot be found again by its name (defined inside a function, or made at run time, "
            f"e.g. by torch.nn.utils.parametrize); define it at module level, or save the weights alone with "
            f"model.save_weights(path)")
    return cls


def _from_stratagem(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)          # functools.partial
    fn = getattr(fn, "hook", fn)              # torch's _WrappedHook
    return str(getattr(fn, "__module__", "") or "").startswith("stratagem.")


class _Pickler(pickle.Pickler):
    """Tensors become references: to ``state_keys`` (id -> state_dict key) or to ``tensors``."""

    def __init__(self, file: Any, state_keys: dict[int, str], tensors: list, to_stored: Callable):
        super().__init__(file, protocol=4)
        self._state_keys, self._tensors, self._to_stored = state_keys, tensors, to_stored
        self._seen: dict[int, tuple] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        pid = self._seen.get(id(obj))
        if pid is None:
            is_parameter = isinstance(obj, nn.Parameter)
            key = self._state_keys.get(id(obj))
            if key is not None:
                pid = ("state", key, is_parameter, bool(obj.requires_grad))
            else:
                self._tensors.append(self._to_stored(obj))
                pid = ("tensor", len(self._tensors) - 1, is_parameter, bool(obj.requires_grad))
            self._seen[id(obj)] = pid
        return pid


def dump(obj: Any, state_keys: dict[int, str], tensors: list, *, what: str,
         to_stored: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach().cpu()) -> bytes:
    """``obj`` pickled with its tensors as references (appended to ``tensors`` unless in
    ``state_keys``); a value that cannot be stored by name raises, naming ``what``."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, state_keys, tensors, to_stored).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise InvalidArgumentError(
            f"model.save cannot store {_culprit(obj, what)}: {err}. Objects are stored by their importable "
            f"names: replace a lambda or local function with a module-level function or a module") from err
    return buffer.getvalue()


def _culprit(obj: Any, what: str) -> str:
    """Which attribute of which module failed to pickle (the first found), else ``what``."""
    if isinstance(obj, nn.Module):
        for prefix, module in obj.named_modules(remove_duplicate=False):
            for key, value in module.__dict__.items():
                if key in ("_parameters", "_buffers", "_modules"):
                    continue
                try:
                    _Pickler(io.BytesIO(), {}, [], lambda t: t).dump(value)
                except Exception:
                    return f"{what}: attribute {key!r} of {prefix or type(obj).__name__} ({type(value).__name__})"
    return what


# ----------------------------------------------------------------- loading

class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, resolve: Callable[[str, str], Any], tensor: Callable[[tuple], Any]):
        super().__init__(io.BytesIO(data))
        self._resolve, self._tensor = resolve, tensor

    def find_class(self, module: str, name: str) -> Any:
        return self._resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return self._tensor(pid)


def load(data: bytes, state_dict: dict[str, torch.Tensor], tensors: list, *, safe_mode: bool,
         custom_objects: dict[str, Any] | None, path: str,
         to_live: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Any:
    """Unpickle what :func:`dump` wrote; its references are taken from ``state_dict`` and
    ``tensors`` (through ``to_live``). ``safe_mode``: admit only the globals of the module
    docstring and ``custom_objects`` (by name or qualified name)."""
    custom = dict(custom_objects or {})
    made: dict[tuple, torch.Tensor] = {}

    def resolve(module: str, name: str) -> Any:
        for key in (f"{module}.{name}", name):
            if key in custom:
                return custom[key]
        if not safe_mode:
            return _lookup(module, name, allow_import=True)
        return _admitted(module, name, path)

    def tensor(pid: Any) -> Any:
        key = pid if isinstance(pid, tuple) else None
        if key in made:
            return made[key]
        try:
            kind, ref, is_parameter, requires_grad = pid
            value = state_dict[ref] if kind == "state" else tensors[ref] if kind == "tensor" else None
        except (TypeError, ValueError, KeyError, IndexError):
            value = None
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"{path} is damaged: its architecture refers to a tensor {pid!r} the file "
                                       f"does not hold")
        value = to_live(value)
        made[key] = nn.Parameter(value, requires_grad=bool(requires_grad)) if is_parameter else value
        return made[key]

    return _Unpickler(data, resolve, tensor).load()


def _lookup(module: str, name: str, *, allow_import: bool) -> Any:
    found = sys.modules.get(module)
    if found is None:
        if not allow_import:
            raise ImportError(f"module {module} is not imported")
        found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def _admitted(module: str, name: str, path: str) -> Any:
    qualified = f"{module}.{name}"
    fix = (f"If you trust this file, load it with sg.models.load_model(path, safe_mode=False); if the name is "
           f"your own, pass custom_objects={{{name.rpartition('.')[2]!r}: <the object>}}")
    torch_or_ours = (module == "torch" or module.startswith(("torch.", "stratagem."))) and "__main__" not in module
    try:
        obj = _lookup(module, name, allow_import=torch_or_ours)
    except ImportError:
        raise InvalidArgumentError(
            f"load_model(safe_mode=True) did not load {path}: it names {qualified}, whose module {module} is not "
            f"imported (safe mode imports no module the file names: importing runs its code). Import "
            f"{module} first. {fix}") from None
    except AttributeError:
        raise InvalidArgumentError(f"load_model could not load {path}: it names {qualified}, which does not "
                                   f"exist (was it renamed since the file was saved?). {fix}") from None
    if isinstance(obj, type) and issubclass(obj, _ADMITTED_CLASSES) and not issubclass(obj, torch.jit.ScriptModule):
        return obj
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or \
            any(obj is value for value in _ADMITTED_VALUES):
        return obj
    if module in _FUNCTION_MODULES and "." not in name and not name.startswith("_") and \
            getattr(obj, "__module__", None) in _FUNCTION_MODULES and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        return obj   # a function defined there (not one reached through it: F.torch.load)
    raise InvalidArgumentError(
        f"load_model(safe_mode=True) refused to load {path}: it names {qualified}, which is not a torch.nn.Module, "
        f"optimizer, loss or metric class nor a torch.nn.functional function (a file naming any other global "
        f"could run code of its choosing while loading). {fix}")


# ---------------------------------------------------------------- building

def register_in_scope(module: nn.Module) -> None:
    """Register every tensor and child of ``module`` again, children first (as constructing it
    does), so that the active strategy's scope places a module that was unpickled."""
    done: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in done:
            return
        done.add(id(m))
        for child in m._modules.values():
            if child is not None:
                visit(child)
        for name, param in list(dict.items(m._parameters)):
            if param is not None:
                m.register_parameter(name, param)
        for name, buffer in list(dict.items(m._buffers)):
            if buffer is not None:
                m.register_buffer(name, buffer, persistent=name not in m._non_persistent_buffers_set)
        for name, child in list(m._modules.items()):
            if child is not None:
                m.add_module(name, child)

    visit(module)


def state_keys(module: nn.Module) -> dict[int, str]:
    """``id(tensor) -> its state_dict key`` for the tensors ``state_dict()`` saves (the first key
    of a tensor that several modules share)."""
    keys: dict[int, str] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in dict.items(m._parameters):
            if param is not None:
                keys.setdefault(id(param), dot + name)
        for name, buffer in dict.items(m._buffers):
            if buffer is not None and name not in m._non_persistent_buffers_set:
                keys.setdefault(id(buffer), dot + name)
    return keys
