"""One variable as a parameter server holds it, and the checks of what workers send for it.

A ps task holds whole variables and shards of partitioned ones alike: each is a
:class:`Shard` -- an ``nn.Parameter``, the ``torch.optim`` optimizer made over it from an
:data:`OptimizerSpec`, and the lock that orders its updates. The functions here make and
check these pieces; :class:`~stratagem.ps.service.ParameterServer` keeps the shards by id
and serves them.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError

__all__ = ["OptimizerSpec", "Rows", "Shard", "check_rows", "check_spec", "check_value",
           "clone_tree", "make_optimizer", "nbytes"]

#: How a variable's optimizer is made on the ps: ``(torch.optim.Adam, {"lr": 1e-3})``.
OptimizerSpec = tuple[type[torch.optim.Optimizer], Mapping[str, Any]]
#: Row ids of a variable: a 1-D integer tensor or a sequence of ints.
Rows = Union[torch.Tensor, Sequence[int]]


@dataclass
class Shard:
    """A variable (or one shard of one) on a ps: its value, its optimizer and the spec it
    was made from (None: no optimizer), the lock every read and update takes, and the
    number of updates applied."""

    param: nn.Parameter
    optimizer: torch.optim.Optimizer | None
    optimizer_spec: OptimizerSpec | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0


def nbytes(tensor: torch.Tensor) -> int:
    """The size of ``tensor``'s elements in bytes."""
    return tensor.numel() * tensor.element_size()


def clone_tree(obj: Any) -> Any:
    """A copy of an optimizer state dict whose tensors no longer alias the live state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {key: clone_tree(value) for key, value in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(clone_tree(value) for value in obj)
    return obj


def make_optimizer(var_id: str, param: nn.Parameter,
                   spec: OptimizerSpec | None) -> torch.optim.Optimizer | None:
    """The optimizer ``spec`` describes, over ``param`` alone (None when ``spec`` is None)."""
    if spec is None:
        return None
    if not param.requires_grad:
        raise InvalidArgumentError(
            f"variable {var_id!r} has dtype {param.dtype}: only floating-point variables can "
            "have an optimizer.")
    try:
        return spec[0]([param], **spec[1])
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(
            f"variable {var_id!r}: cannot make {spec[0].__name__}(**{spec[1]!r}): {err}") from err


def check_spec(spec: Any, var_id: str) -> OptimizerSpec | None:
    """``spec`` as an :data:`OptimizerSpec` (its hyperparameters copied), or None."""
    if spec is None:
        return None
    if (isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], type)
            and issubclass(spec[0], torch.optim.Optimizer) and isinstance(spec[1], Mapping)):
        closure = inspect.signature(spec[0].step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise InvalidArgumentError(
                f"variable {var_id!r}: {spec[0].__name__}.step needs a closure that recomputes the "
                "loss, but a parameter server only receives gradients and applies each once; use an "
                "optimizer that steps on a gradient alone (SGD, Adam, RMSprop, ...).")
        return spec[0], dict(spec[1])
    raise InvalidArgumentError(
        f"variable {var_id!r}: optimizer_spec must be (optimizer class, hyperparameter dict), "
        f"like (torch.optim.Adam, {{'lr': 1e-3}}), or None; got {spec!r}.")


def check_value(var_id: str, var: Shard, value: Any, what: str) -> torch.Tensor:
    """``value`` (a new value or a gradient: ``what``) on the CPU in ``var``'s dtype, once
    its shape is checked against ``var``'s."""
    if not isinstance(value, torch.Tensor) or value.shape != var.param.shape:
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidArgumentError(
            f"the {what} for {var_id!r} must be a tensor of shape {tuple(var.param.shape)}, "
            f"got {got}.")
    return value.detach().to(device="cpu", dtype=var.param.dtype)


def check_rows(var_id: str, var: Shard, row_ids: Rows) -> torch.Tensor:
    """``row_ids`` as an int64 tensor, once checked to be 1-D row ids within ``var``."""
    rows = torch.as_tensor(row_ids)
    if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        raise InvalidArgumentError(
            f"row ids for {var_id!r} must be a 1-D integer tensor, got dtype {rows.dtype} "
            f"and shape {tuple(rows.shape)}.")
    if var.param.dim() == 0:
        raise InvalidArgumentError(f"variable {var_id!r} is 0-d: it has no rows.")
    rows = rows.to(torch.int64)
    num_rows = var.param.shape[0]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        bad = rows[(rows < 0) | (rows >= num_rows)][0].item()
        raise InvalidArgumentError(
            f"row id {bad} is out of range for {var_id!r}, which has {num_rows} rows "
            "(ids are local to the shard: subtract the shard's first row).")
    return rows
