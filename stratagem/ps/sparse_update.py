"""Row-sparse optimizer updates: torch.optim's rules applied to a few rows of a parameter.

An embedding step touches a few rows of a large table. A dense ``optimizer.step()`` with a
gradient that is zero elsewhere would still move every other row (momentum keeps going,
Adam's moments decay, weight decay shrinks) and cost time proportional to the table.
:func:`apply_row_update` instead updates only the touched rows, their parameters and their
optimizer state, so that each row evolves exactly as under the dense optimizer run on the
steps that touched it (TensorFlow's "lazy" sparse updates, with per-row step counts):

- ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize): a row's
  momentum buffer starts as its first gradient, as torch.optim's does;
- ``torch.optim.Adagrad`` (lr_decay, weight decay, initial accumulator, eps, maximize);
- ``torch.optim.Adam`` / ``torch.optim.AdamW`` (betas, eps, weight decay -- coupled or
  decoupled --, amsgrad, maximize): bias corrections use the row's own step count.

State lives in ``optimizer.state[param]`` under torch.optim's own keys (``momentum_buffer``,
``sum``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``step``) plus ``row_step``, the
int64 count of updates of each row. So ``optimizer.state_dict()`` saves and restores it
(call :func:`after_load_state_dict` after ``load_state_dict``, which casts it to the
parameter's dtype), and a dense ``step()`` can follow sparse ones (call
:func:`note_dense_step` after it). When every touched row has the same step count the
arithmetic is torch.optim's, operation for operation; otherwise the per-row bias
corrections are applied as tensors (equal up to float rounding).

Other optimizers get what plain PyTorch gives them for an ``nn.Embedding``:
``torch.optim.SparseAdam`` a sparse gradient of the rows (``sparse=True``; it updates only
those rows), every other one -- RMSprop, Adadelta, NAdam, a subclass of Adam... -- a dense
``step()`` with a full-size gradient that is zero outside the rows (``sparse=False``). That
dense step is exact but touches the whole table, every step: time and optimizer state
proportional to the table, not to the rows used. :func:`updates_rows_only` says which
optimizers are spared it; :func:`dense_updates_warning` is what the user is told, once per table.

Example::

    >>> import torch
    >>> from stratagem.ps.sparse_update import apply_row_update
    >>> table = torch.nn.Parameter(torch.zeros(4, 2))
    >>> optimizer = torch.optim.SGD([table], lr=0.5, momentum=0.9)
    >>> apply_row_update(optimizer, table, torch.tensor([1, 1]), torch.ones(2, 2))
    >>> table.detach()        # the duplicated row got both gradients; the others did not move
    tensor([[ 0.,  0.],
            [-1., -1.],
            [ 0.,  0.],
            [ 0.,  0.]])
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SUPPORTED_OPTIMIZERS", "after_load_state_dict", "apply_row_update", "coalesce_rows",
           "dense_updates_warning", "note_dense_step", "updates_rows_only"]

#: The optimizers whose row updates touch only the rows (the others take dense steps).
SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam)


def coalesce_rows(row_ids: torch.Tensor, row_grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique sorted row ids, and the gradients of repeated rows summed (as autograd does)."""
    rows, inverse = torch.unique(row_ids, sorted=True, return_inverse=True)
    if rows.numel() == row_ids.numel():
        return rows, row_grads.new_empty(row_grads.shape).index_copy_(0, inverse, row_grads)
    summed = row_grads.new_zeros((rows.numel(), *row_grads.shape[1:]))
    return rows, summed.index_add_(0, inverse, row_grads)


def _scalar_dtype() -> torch.dtype:   # what torch.optim uses for state["step"]
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _dense_steps(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> int:
    if isinstance(optimizer, torch.optim.SGD):
        return int(state.get("momentum_buffer") is not None)
    return int(state["step"]) if "step" in state else 0


def _row_steps(optimizer: torch.optim.Optimizer, param: torch.Tensor,
               state: dict[str, Any]) -> torch.Tensor:
    row_step = state.get("row_step")
    if row_step is None:   # rows already stepped densely count those steps
        row_step = torch.full((param.shape[0],), _dense_steps(optimizer, state), dtype=torch.int64)
    elif row_step.dtype != torch.int64:   # load_state_dict casts state to the param's dtype
        row_step = row_step.to(torch.int64)
    state["row_step"] = row_step
    return row_step


def note_dense_step(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Counts a dense ``step()`` in the per-row step counts, if sparse updates made them."""
    row_step = optimizer.state[param].get("row_step")
    if row_step is not None:
        row_step.add_(1)


def after_load_state_dict(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Undoes ``load_state_dict``'s cast of ``row_step`` to the parameter's dtype."""
    state = optimizer.state.get(param)
    if state is not None and "row_step" in state:
        state["row_step"] = state["row_step"].to(torch.int64)


def _per_row(values: torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A Python float when all rows share the value (torch.optim's exact arithmetic), else
    a tensor of ``like``'s dtype shaped to broadcast over rows."""
    if bool((values == values[0]).all()):
        return float(values[0])
    return values.to(like.dtype).reshape(-1, *[1] * (like.dim() - 1))


def _scaled_div(target: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor,
                scale: float | torch.Tensor) -> None:
    """``target += scale * numerator / denominator`` (``addcdiv_`` when scale is a float)."""
    if isinstance(scale, float):
        target.addcdiv_(numerator, denominator, value=scale)
    else:
        target.add_(scale * numerator / denominator)


def _sgd(group: dict[str, Any], state: dict[str, Any], optimizer: torch.optim.Optimizer,
         param: torch.Tensor, rows: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> None:
    momentum, dampening = group["momentum"], group["dampening"]
    if group["weight_decay"] != 0:
        g = g.add(p, alpha=group["weight_decay"])
    if momentum != 0:
        row_step = _row_steps(optimizer, param, state)
        buffer = state.get("momentum_buffer")
        if buffer is None:
            buffer = state["momentum_buffer"] = torch.zeros_like(param.detach())
        fresh = (row_step.index_select(0, rows) == 0).reshape(-1, *[1] * (g.dim() - 1))
        b = buffer.index_select(0, rows).mul_(momentum).add_(g, alpha=1 - dampening)
        b = torch.where(fresh, g, b)   # a row's first step: buffer = its gradient
        buffer.index_copy_(0, rows, b)
        row_step.index_add_(0, rows, torch.ones_like(rows))
        g = g.add(b, alpha=momentum) if group["nesterov"] else b
    p.add_(g, alpha=-float(group["lr"]))


def _adagrad(group: dict[str, Any], state: dict[str, Any], optimizer: torch.optim.Optimizer,
             param: torch.Tensor, rows: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> None:
    row_step = _row_steps(optimizer, param, state)
    row_step.index_add_(0, rows, torch.ones_like(rows))
    steps = row_step.index_select(0, rows).to(torch.float64)
    state["step"] += 1
    if group["weight_decay"] != 0:
        g = g.add(p, alpha=group["weight_decay"])
    clr = float(group["lr"]) / (1 + (steps - 1) * group["lr_decay"])
    total = state["sum"].index_select(0, rows).addcmul_(g, g, value=1)
    state["sum"].index_copy_(0, rows, total)
    _scaled_div(p, g, total.sqrt().add_(group["eps"]), _per_row(-clr, p))


def _adam(group: dict[str, Any], state: dict[str, Any], optimizer: torch.optim.Optimizer,
          param: torch.Tensor, rows: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> None:
    beta1, beta2 = (float(beta) for beta in group["betas"])
    lr, weight_decay, amsgrad = float(group["lr"]), group["weight_decay"], group["amsgrad"]
    if not state or "exp_avg" not in state:   # as Adam's _init_group
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        state["exp_avg"] = torch.zeros_like(param.detach(), memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param.detach(), memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param.detach(), memory_format=torch.preserve_format)
    row_step = _row_steps(optimizer, param, state)
    row_step.index_add_(0, rows, torch.ones_like(rows))
    steps = row_step.index_select(0, rows).to(torch.float64)
    state["step"] += 1
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)):
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    exp_avg = state["exp_avg"].index_select(0, rows).lerp_(g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    state["exp_avg"].index_copy_(0, rows, exp_avg)
    state["exp_avg_sq"].index_copy_(0, rows, exp_avg_sq)
    if bool((steps == steps[0]).all()):   # torch.optim's exact float arithmetic
        step = float(steps[0])
        step_size: float | torch.Tensor = lr / (1 - beta1**step)
        bias_correction2_sqrt: float | torch.Tensor = (1 - beta2**step) ** 0.5
    else:
        step_size = _per_row(lr / (1 - beta1**steps), p)
        bias_correction2_sqrt = _per_row((1 - beta2**steps) ** 0.5, p)
    second = exp_avg_sq
    if amsgrad:
        second = torch.maximum(state["max_exp_avg_sq"].index_select(0, rows), exp_avg_sq)
        state["max_exp_avg_sq"].index_copy_(0, rows, second)
    denom = (second.sqrt() / bias_correction2_sqrt).add_(group["eps"])
    _scaled_div(p, exp_avg, denom, -step_size)


_RULES = {torch.optim.SGD: _sgd, torch.optim.Adagrad: _adagrad,
          torch.optim.Adam: _adam, torch.optim.AdamW: _adam}


def updates_rows_only(optimizer_class: type, dtype: torch.dtype) -> bool:
    """Whether :func:`apply_row_update` touches only the given rows for this optimizer class
    and parameter dtype; if not, it takes a dense step over the whole parameter."""
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        return True
    return optimizer_class in _RULES and not dtype.is_complex


def dense_updates_warning(optimizer_name: str, table: str, shape: tuple[int, ...]) -> str:
    """What to tell the user when the row updates of the embedding ``table`` will be dense
    steps of its ``optimizer_name``: the cost, and how to avoid it."""
    names = ", ".join(kind.__name__ for kind in SUPPORTED_OPTIMIZERS)
    return (
        f"{optimizer_name} has no row-sparse update, so each step that looks up rows of the embedding "
        f"table {table} (shape {tuple(shape)}) applies a dense {optimizer_name} step to the whole table on "
        f"its parameter server (as plain PyTorch does with nn.Embedding(sparse=False)): every step costs "
        f"time proportional to the table's {shape[0]} rows, not to the rows the batch uses, and the "
        f"optimizer keeps state for every row. To update only the rows used, train embeddings with one of "
        f"torch.optim.{{{names}}}, e.g. a separate optimizer over the embedding's parameters.")


def apply_row_update(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                     row_ids: torch.Tensor, row_grads: torch.Tensor) -> None:
    """Updates rows ``row_ids`` of ``param`` (the optimizer's only parameter) with ``row_grads``.

    ``row_ids`` is a 1-D integer tensor of rows of ``param`` (repeats are summed);
    ``row_grads`` has shape ``(len(row_ids), *param.shape[1:])``. Untouched rows and their
    optimizer state do not change -- except under an optimizer without a row rule (see
    :func:`updates_rows_only`), which takes a dense step as plain PyTorch would. The caller
    serialises calls on one parameter.
    """
    if row_ids.numel() == 0:
        return
    rule = _RULES.get(type(optimizer))
    if rule is None or param.is_complex():
        _full_size_step(optimizer, param, row_ids.to(torch.int64), row_grads.to(param.dtype))
        return
    group = optimizer.param_groups[0]
    rows, grads = coalesce_rows(row_ids.to(torch.int64), row_grads.to(param.dtype))
    if group.get("maximize", False):
        grads = -grads
    with torch.no_grad():
        p = param.index_select(0, rows)
        rule(group, optimizer.state[param], optimizer, param, rows, p, grads)
        param.index_copy_(0, rows, p)


def _full_size_step(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                    rows: torch.Tensor, row_grads: torch.Tensor) -> None:
    """``optimizer.step()`` with the gradient an ``nn.Embedding`` lookup of ``rows`` gives
    ``param``: sparse for SparseAdam, else dense (zero outside the rows)."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        grad = torch.sparse_coo_tensor(rows[None], row_grads, param.shape, check_invariants=False)  # rows checked
    else:
        grad = torch.zeros_like(param.detach()).index_add_(0, rows, row_grads)
    param.grad = grad
    try:
        optimizer.step()
    finally:
        param.grad = None
    note_dense_step(optimizer, param)
