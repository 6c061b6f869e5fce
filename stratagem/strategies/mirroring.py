"""What happens to modules and optimizers created in a strategy's scope.

Modules: global registration hooks see every parameter and buffer registered while
a scope is active on this thread. The module joins the strategy's pending list;
when the module is finished (at the latest when an optimizer is created, ``run``
starts, or the outermost scope is left) its tensors are placed on the first
replica's device and, with several local replicas, one copy per replica is made.
The module keeps its parameters in a :class:`MirroredDict`: the same Python object
then reads replica ``r``'s copy on replica ``r``'s thread inside ``run`` and the
primary copy (replica 0's) everywhere else.

Writes made outside ``run`` (``load_state_dict``, manual init) are noticed through
the tensors' version counters and pushed to every replica before the next ``run``.
Buffers written inside ``run`` (BatchNorm statistics) read, outside ``run``, as the
mean over replicas.

Optimizers: the base ``Optimizer.__init__`` is wrapped so that an optimizer created
in scope gets its class swapped for a subclass whose ``step``/``zero_grad`` ask the
strategy what to do. With several replicas, each replica gets a twin optimizer over
its own copies (built when the user's ``__init__`` has finished): after the
gradients are summed, every replica applies the same update to its copy in
parallel, so optimizer state is mirrored.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Iterable

import torch
from torch import nn

from stratagem import _context
from stratagem.errors import ContextError, InvalidArgumentError


class MirroredDict(dict):
    """``module._parameters`` / ``module._buffers`` with one value per replica.

    The dict's own storage holds the primary (replica 0) tensors; ``_copies[r]``
    holds replica ``r``'s. Lookups pick the calling thread's replica.
    """

    def __init__(self, placement: "Placement", is_buffers: bool, items: Iterable = ()):
        super().__init__(items)
        self._placement = placement
        self._is_buffers = is_buffers
        self._copies: list[dict[str, Any]] = [{} for _ in range(placement.num_replicas)]
        self._versions: dict[str, int] = {}
        self._finalized = False
        self._stale = False  # buffers written by replicas, not yet averaged

    # what torch.save / copy.deepcopy see: one plain copy
    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def _replica(self) -> int | None:
        frame = _context.current_frame()
        if frame is None or frame.replica_context is None:
            return None
        if frame.strategy is not self._placement.strategy:
            raise ContextError(
                f"a module created in the scope of {self._placement.strategy!r} was called inside "
                f"run of {frame.strategy!r}; use each module only with the strategy it was created under")
        return frame.replica_context._local_id

    def __getitem__(self, key: str) -> Any:
        replica = self._replica()
        if replica:
            return self._copies[replica][key]
        if replica is None and self._stale:
            self._average_buffers()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self):
        return dict.__iter__(self)

    def values(self):
        return [self[k] for k in dict.keys(self)]

    def items(self):
        return [(k, self[k]) for k in dict.keys(self)]

    def copy(self) -> dict:
        return dict(self.items())

    def __setitem__(self, key: str, value: Any) -> None:
        replica = self._replica()
        if replica:
            self._copies[replica][key] = value
            return
        dict.__setitem__(self, key, value)
        if self._finalized and replica is None:
            self._placement.mirror_entry(self, key)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        for copies in self._copies:
            copies.pop(key, None)
        self._versions.pop(key, None)

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = dict.__getitem__(self, key)
        del self[key]
        return value

    # ---------------------------------------------------------- synchronisation

    def _record_versions(self) -> None:
        for key, tensor in dict.items(self):
            if tensor is not None:
                self._versions[key] = tensor._version

    def _push_modified(self) -> None:
        """Copy primaries written outside ``run`` to every replica."""
        if self._stale:
            self._average_buffers()
        versions = self._versions
        for key, tensor in dict.items(self):
            if tensor is not None and versions.get(key) != tensor._version:
                with torch.no_grad():
                    for copies in self._copies[1:]:
                        copies[key].copy_(tensor)
                versions[key] = tensor._version

    def _after_run(self) -> None:
        if self._is_buffers:
            versions = self._versions
            self._stale = self._stale or any(
                t is not None and versions.get(k) != t._version for k, t in dict.items(self))
        self._record_versions()

    def _average_buffers(self) -> None:
        self._stale = False
        n = len(self._copies)
        with torch.no_grad():
            for key, primary in dict.items(self):
                if primary is None or not primary.is_floating_point():
                    continue
                total = primary.clone()
                for copies in self._copies[1:]:
                    total.add_(copies[key].to(total.device))
                total.div_(n)
                primary.copy_(total)
                for copies in self._copies[1:]:
                    copies[key].copy_(total)
        self._record_versions()


class Placement:
    """Places what is created in a strategy's scope on its replicas' devices."""

    def __init__(self, strategy: Any, devices: tuple):
        self._strategy_ref = weakref.ref(strategy)
        self.devices = tuple(d.torch_device for d in devices)
        self.num_replicas = len(devices)
        self._pending_modules: list[nn.Module] = []
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._dicts: list[MirroredDict] = []
        self._copies: dict[int, tuple[torch.Tensor, ...]] = {}   # id(primary) -> all copies

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    # ---------------------------------------------------------------- modules

    def on_registered(self, module: nn.Module) -> None:
        if self.num_replicas > 1:
            for attr, is_buffers in (("_parameters", False), ("_buffers", True)):
                current = module.__dict__[attr]
                if not isinstance(current, MirroredDict):
                    mirrored = MirroredDict(self, is_buffers, dict.items(current))
                    module.__dict__[attr] = mirrored
                    self._dicts.append(mirrored)
                elif current._placement is not self:
                    raise InvalidArgumentError(
                        f"module {type(module).__name__} already belongs to {current._placement.strategy!r}")
        if not self._pending_modules or self._pending_modules[-1] is not module:
            self._pending_modules.append(module)

    def finalize(self) -> None:
        """Place pending modules and build replica twins of pending optimizers."""
        if self._pending_modules:
            modules, self._pending_modules = self._pending_modules, []
            unique = list({id(m): m for m in modules}.values())
            for module in unique:
                self._place_module(module)
            self.strategy._on_modules_placed(unique)
        if self._pending_optimizers:
            optimizers, self._pending_optimizers = self._pending_optimizers, []
            for optimizer in optimizers:
                self._build_twins(optimizer)

    def _place_module(self, module: nn.Module) -> None:
        first = self.devices[0]
        for attr in ("_parameters", "_buffers"):
            entries = module.__dict__[attr]
            for key, tensor in dict.items(entries):
                if tensor is not None and tensor.device != first:
                    with torch.no_grad():
                        tensor.data = tensor.data.to(first)
            if isinstance(entries, MirroredDict):
                for key in dict.keys(entries):
                    self.mirror_entry(entries, key)
                entries._finalized = True
                entries._record_versions()

    def mirror_entry(self, entries: MirroredDict, key: str) -> None:
        """(Re)make every replica's copy of one primary entry."""
        primary = dict.__getitem__(entries, key)
        if primary is None:
            for copies in entries._copies[1:]:
                copies[key] = None
            return
        if primary.device != self.devices[0]:
            with torch.no_grad():
                primary.data = primary.data.to(self.devices[0])
        all_copies = [primary]
        for r in range(1, self.num_replicas):
            with torch.no_grad():
                data = primary.detach().to(self.devices[r], copy=True)
            if isinstance(primary, nn.Parameter):
                copy = nn.Parameter(data, requires_grad=primary.requires_grad)
            else:
                copy = data
            entries._copies[r][key] = copy
            all_copies.append(copy)
        self._copies[id(primary)] = tuple(all_copies)
        entries._versions[key] = primary._version

    def all_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        copies = self._copies.get(id(tensor))
        return copies if copies is not None and copies[0] is tensor else None

    def replica_copy(self, tensor: torch.Tensor, replica: int) -> torch.Tensor:
        if self.num_replicas == 1:
            return tensor
        copies = self.all_copies(tensor)
        return tensor if copies is None else copies[replica]

    def before_run(self) -> None:
        self.finalize()
        for entries in self._dicts:
            entries._push_modified()

    def after_run(self) -> None:
        for entries in self._dicts:
            entries._after_run()

    # ------------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.__class__ = _distributed_class(type(optimizer))
        optimizer._sg_strategy = self.strategy
        optimizer._sg_twins = None
        self._pending_optimizers.append(optimizer)

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        if optimizer._sg_twins is None:
            if optimizer in self._pending_optimizers:
                self._pending_optimizers.remove(optimizer)
            self._build_twins(optimizer)
        return optimizer._sg_twins

    def _build_twins(self, optimizer: torch.optim.Optimizer) -> None:
        base = optimizer._sg_base
        twins = [optimizer]
        if self.num_replicas > 1:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if self.all_copies(p) is None:
                        raise InvalidArgumentError(
                            f"an optimizer created in the scope of {self.strategy!r} was given a "
                            f"parameter of shape {tuple(p.shape)} that was not created in that scope, "
                            f"so it has no copy per replica. Create the model inside "
                            f"`with strategy.scope():` too")
            for r in range(1, self.num_replicas):
                twin = object.__new__(base)
                twin.__dict__.update(optimizer.__dict__)
                twin.state = defaultdict(dict)
                twin.param_groups = [
                    {**group, "params": [self._copies[id(p)][r] for p in group["params"]]}
                    for group in optimizer.param_groups]
                twin._sg_twins = None
                if optimizer.state:
                    base.load_state_dict(twin, optimizer.state_dict())
                twins.append(twin)
        optimizer._sg_twins = twins


_DISTRIBUTED_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """A subclass of ``base`` whose methods ask the owning strategy what to do.

    The strategy decides what ``step``, ``zero_grad``, state dicts and pickling mean:
    mirrored twins for strategies in one process, parameter servers for
    ParameterServerStrategy.
    """
    cls = _DISTRIBUTED_CLASSES.get(base)
    if cls is not None:
        return cls

    def step(self, closure=None):
        return self._sg_strategy._optimizer_step(self, closure)

    def zero_grad(self, set_to_none: bool = True):
        self._sg_strategy._optimizer_zero_grad(self, set_to_none)

    def state_dict(self):
        return self._sg_strategy._optimizer_state_dict(self)

    def load_state_dict(self, state_dict):
        self._sg_strategy._optimizer_load_state_dict(self, state_dict)

    def add_param_group(self, param_group):
        strategy = self.__dict__.get("_sg_strategy")
        if strategy is None:  # still inside Optimizer.__init__
            return base.add_param_group(self, param_group)
        strategy._optimizer_add_param_group(self, param_group)

    def __reduce_ex__(self, protocol):
        return self._sg_strategy._reduce_optimizer(self)

    cls = type(base.__name__, (base,), {
        "step": step, "zero_grad": zero_grad, "state_dict": state_dict,
        "load_state_dict": load_state_dict, "add_param_group": add_param_group,
        "__reduce_ex__": __reduce_ex__, "_sg_base": base, "__module__": base.__module__,
        "__doc__": f"{base.__name__} created in a stratagem strategy's scope.",
    })
    cls.__qualname__ = f"distributed.{base.__qualname__}"
    _DISTRIBUTED_CLASSES[base] = cls
    return cls


# --------------------------------------------------------------- global hooks

def _scoped_strategy() -> Any:
    frame = _context.current_frame()
    if frame is None or frame.replica_context is not None or frame.strategy._is_default:
        return None
    return frame.strategy


def _on_tensor_registered(module: nn.Module, name: str, tensor: Any) -> None:
    strategy = _scoped_strategy()
    if strategy is not None:
        strategy._placement.on_registered(module)
    return None


_original_optimizer_init = torch.optim.Optimizer.__init__


def _optimizer_init(self, params, defaults):
    from stratagem.strategies.sharded_update import building

    strategy = _scoped_strategy()
    if strategy is None or building() or type(self).__dict__.get("_sg_base") is not None:
        return _original_optimizer_init(self, params, defaults)
    strategy._placement.finalize()   # modules placed before the optimizer captures parameters
    _original_optimizer_init(self, params, defaults)
    strategy._placement.on_optimizer_created(self)


def install_hooks() -> None:
    """Install the module-registration hooks and the optimizer-creation wrapper (once)."""
    if getattr(torch.optim.Optimizer.__init__, "_sg_wrapped", False):
        return
    nn.modules.module.register_module_parameter_registration_hook(_on_tensor_registered)
    nn.modules.module.register_module_buffer_registration_hook(_on_tensor_registered)
    _optimizer_init._sg_wrapped = True
    torch.optim.Optimizer.__init__ = _optimizer_init
