"""Gradient clipping by the global norm where no process holds a parameter's whole gradient.

Under ``sharding="gradients"`` (ZeRO-2) a worker holds its range of the summed gradients,
under ``sharding="parameters"`` (ZeRO-3) its shard of each, under tensor parallelism its
shards along the model axis, under pipeline parallelism its own stages' gradients (summed over
a data axis when backward ended). ``torch.nn.utils.clip_grad_norm_`` over such parameters
measures one process's part. This module makes it measure the whole.

While a placement that holds gradients apart exists (it calls :func:`register`), torch's
``clip_grad_norm_``, ``clip_grad_value_`` and ``clip_grads_with_norm_`` come here: torch
has no hook for them, so the function that each of torch's (``no_grad``-decorated) wrappers
calls is swapped, and the wrappers themselves stay -- a name imported earlier
(``from torch.nn.utils import clip_grad_norm_``) comes here too. The last such placement to
go restores torch's functions. Parameters that no such placement holds get torch's own
functions, unchanged. Over a placement's parameters, ``clip_grad_norm_``:

1. asks the placement for each gradient's parts on this process (:class:`GradientParts`), one
   rule for every layout and update rule (its data axis's,
   :meth:`~stratagem.placement.data_axis.axis.DataAxis.gradient_parts`): the pieces of this
   process's range of the sum where ZeRO-2 keeps one (the packs finished now, the range kept for
   the step), else the local part of each ``.grad``; the layout names the group the parts are
   spread on and the axes along which it holds a tensor the same everywhere;
2. measures the parts this process counts -- a part counts on rank 0 of every axis that
   replicates it (:func:`counts_here`), so each element of a whole gradient counts on exactly
   one process -- with torch's own norm, and sums their p-th power (inf-norm: takes the max)
   over that group;
3. scales every part in place with torch's own code, by ``min(1, max_norm / (norm + 1e-6))``.

Every process returns the same norm, a plain tensor: plain PyTorch's over the whole model.
``clip_grad_value_`` clamps every part of the whole gradients. ``clip_grads_with_norm_``
(scale by a norm computed elsewhere) is refused over such parameters: the norm a user can
compute from ``p.grad`` (``torch.nn.utils.get_total_norm``) is this process's part only.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import weakref
from typing import Any, Callable

import torch
import torch.nn.utils.clip_grad as torch_clip

from stratagem.errors import InvalidArgumentError
from stratagem.values import is_dtensor

_lock = threading.RLock()   # (a placement's finalizer may run inside a locked section)
_placements: dict[int, weakref.ref] = {}
_restore: list[Callable[[], None]] = []

# torch's functions, as its no_grad wrappers call them
_torch_norm = torch_clip.clip_grad_norm_.__wrapped__
_torch_value = torch_clip.clip_grad_value_.__wrapped__
_torch_with_norm = torch.nn.utils.clip_grads_with_norm_.__wrapped__
_torch_total = torch.nn.utils.get_total_norm.__wrapped__


@dataclasses.dataclass
class GradientParts:
    """This process's parts of some parameters' whole gradients, as a placement gives them."""

    tensors: list[torch.Tensor]   # every part held here (clipping scales or clamps them in place)
    counted: list[torch.Tensor]   # those whose elements count toward the norm on this process
    group: Any                    # the WorkerGroup whose processes hold the counted parts (None: this one)


# ------------------------------------------------------------------ routing

def register(placement: Any) -> None:
    """``placement`` (a placement, or ZeRO-2's update rule) holds gradients apart: route torch's
    clipping through it while it lives.

    It answers ``splits_gradients(params) -> list[bool]`` and ``gradient_parts(params)``
    (:class:`~stratagem.placement.scope.base.Placement`: its data axis's, from its ``norm_axes()``).
    """
    key = id(placement)
    with _lock:
        if not _placements:
            _install()
        _placements[key] = weakref.ref(placement, lambda _, key=key: _release(key))


def _release(key: int) -> None:
    with _lock:
        _placements.pop(key, None)
        if not _placements:
            while _restore:
                _restore.pop()()


def _install() -> None:
    for wrapper, routed in ((torch_clip.clip_grad_norm_, _routed_norm), (torch_clip.clip_grad_value_, _routed_value),
                            (torch.nn.utils.clip_grads_with_norm_, _routed_with_norm)):
        _restore.append(_swap(wrapper, routed))


def _swap(wrapper: Callable, routed: Callable) -> Callable[[], None]:
    """Make torch's ``wrapper`` call ``routed`` instead of the function it wraps; returns the undo."""
    original = wrapper.__wrapped__
    for cell in wrapper.__closure__ or ():
        if cell.cell_contents is original:
            cell.cell_contents = routed
            return lambda: setattr(cell, "cell_contents", original)
    raise AssertionError(f"torch's {wrapper.__name__} no longer wraps its function in a closure")


def installed() -> bool:
    """Whether torch's clipping functions are routed here now (for tests)."""
    return bool(_restore)


def _owner(params: list[torch.Tensor], what: str) -> Any:
    """The placement that holds these parameters' gradients apart, or None (plain gradients)."""
    with _lock:
        placements = [p for p in (ref() for ref in _placements.values()) if p is not None]
    found = None
    for placement in placements:
        flags = placement.splits_gradients(params)
        if not any(flags):
            continue
        if found is not None or not all(flags):
            others = [tuple(p.shape) for p, split in zip(params, flags) if not split][:4]
            raise InvalidArgumentError(
                f"{what} got parameters whose gradients {type(placement).__name__} holds over several processes "
                f"together with others (shapes {others or 'of another strategy'}); the global norm is only "
                f"known within one strategy's model: clip each model's parameters in its own call")
        found = placement
    return found


def _listed(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _routed_norm(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                 foreach: bool | None = None) -> torch.Tensor:
    generator = isinstance(parameters, types.GeneratorType)
    params = _listed(parameters)
    owner = _owner(params, "clip_grad_norm_")
    if owner is None:   # (a generator again, so that torch warns about an empty one as usual)
        return _torch_norm((p for p in params) if generator else params, max_norm, norm_type,
                           error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise InvalidArgumentError(
            f"clip_grad_norm_ over parameters whose gradients {type(owner).__name__} holds over several processes "
            f"combines the norms of the parts, which works for p-norms with p > 0 and for inf; got "
            f"norm_type={norm_type}")
    parts = owner.gradient_parts(params)
    total = global_norm(parts, norm_type, params, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    _torch_with_norm(_holders(parts.tensors), max_norm, total, foreach)
    return total


def _routed_value(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    params = _listed(parameters)
    owner = _owner(params, "clip_grad_value_")
    if owner is None:
        return _torch_value(params, clip_value, foreach)
    return _torch_value(_holders(owner.gradient_parts(params).tensors), clip_value, foreach)


def _routed_with_norm(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                      foreach: bool | None = None) -> None:
    params = _listed(parameters)
    owner = _owner(params, "clip_grads_with_norm_")
    if owner is not None:
        raise InvalidArgumentError(
            f"clip_grads_with_norm_ scales by a norm computed elsewhere, but {type(owner).__name__} holds these "
            f"gradients over several processes, so a norm of this process's p.grad (get_total_norm) is only its "
            f"part; call torch.nn.utils.clip_grad_norm_(parameters, max_norm) (or sg.nn.clip_grad_norm_), "
            f"which measure the global norm (max_norm=float('inf') only measures it)")
    return _torch_with_norm(params, max_norm, total_norm, foreach)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the norm of the whole gradients, returned on every process.

    The same as torch's call, which stratagem routes here while a strategy whose processes each
    hold part of the gradients exists (``sharding="gradients"`` or ``"parameters"``, tensor and
    pipeline parallelism: each gradient's parts are measured where they live, and the p-th
    powers are summed over the processes). Returns the norm that plain PyTorch returns for the
    whole model, as a plain tensor. Under those strategies it is a collective: call it on every
    process, after the step's last backward. Other parameters get torch's own code.

    Example::

        import torch, stratagem as sg
        model = torch.nn.Linear(4, 1)
        model(torch.ones(2, 4)).sum().backward()
        norm = sg.nn.clip_grad_norm_(model.parameters(), max_norm=1.0)
        assert norm > 1.0 and torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= 1.0
    """
    with torch.no_grad():
        return _routed_norm(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` over the whole gradients (see :func:`clip_grad_norm_`).

    Example::

        import torch, stratagem as sg
        model = torch.nn.Linear(4, 1)
        model(torch.ones(2, 4)).sum().backward()
        sg.nn.clip_grad_value_(model.parameters(), 0.5)
        assert model.weight.grad.max() == 0.5
    """
    with torch.no_grad():
        _routed_value(parameters, clip_value, foreach)


def _holders(tensors: list[torch.Tensor]) -> list[Any]:
    """Gradient parts as torch's clipping code reads them: objects whose ``.grad`` is the part."""
    return [types.SimpleNamespace(grad=t) for t in tensors]


# ------------------------------------------------------------------ the norm

def global_norm(parts: GradientParts, norm_type: float, params: list[torch.Tensor], *,
                error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The norm of the whole gradients whose parts the processes of ``parts.group`` hold (a
    collective over them). Its dtype is the parameters' (the same on every process)."""
    infinite = math.isinf(norm_type)
    local = _torch_total(parts.counted, norm_type, False, foreach).double()
    power = local if infinite else local ** norm_type
    carrier = torch.stack([power.cpu(), torch.tensor(float(bool(parts.counted)), dtype=torch.float64),
                           local.isnan().double().cpu()])
    if parts.group is not None and not parts.group.solo:
        parts.group.all_reduce(carrier, "clip_grad_norm_ (the global norm)", op="max" if infinite else "sum")
    power, anywhere, nan = carrier.tolist()
    if not anywhere:   # no gradient on any process: torch's answer for no gradients
        return torch.tensor(0.0)
    value = float("nan") if nan else power if infinite else power ** (1.0 / norm_type)
    dtypes = [p.dtype for p in params if p.is_floating_point()]
    dtype = dtypes[0] if dtypes else torch.get_default_dtype()
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    device = parts.tensors[0].device if parts.tensors else \
        parts.group.device if parts.group is not None else torch.device("cpu")
    total = torch.tensor(value, dtype=dtype, device=device)
    if error_if_nonfinite and not math.isfinite(value):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`")
    return total


def counts_here(tensor: torch.Tensor, axes: dict[str, int]) -> bool:
    """Whether this process counts its part of ``tensor`` (a gradient, or the parameter of a range of
    one) toward a global norm, so that each element counts on exactly one process of the norm's
    group: a part counts on rank 0 of every axis along which other processes hold the same part.
    ``axes``: the group's axes along which the layout holds a plain tensor the same everywhere (name ->
    this process's rank along it); a DTensor's placements say so for the axes of its own mesh."""
    axes = dict(axes)
    once = True
    if is_dtensor(tensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        for dim, placement in enumerate(tensor.placements):
            if placement.is_partial():
                raise AssertionError(f"a gradient is a partial DTensor ({tensor.placements})")
            sharded = placement.is_shard() or getattr(placement, "split_factor", None) is not None   # (FSDP x TP)
            once = once and (sharded or tensor.device_mesh.get_local_rank(dim) == 0)
            if dim < len(names):
                axes.pop(names[dim], None)
    return once and all(rank == 0 for rank in axes.values())
