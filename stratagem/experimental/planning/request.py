"""What ``sg.experimental.plan`` is asked, checked before any process starts; the optimizers it names."""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch

from stratagem.errors import InvalidArgumentError

#: the optimizers ``optimizer=`` names, as ``torch.optim`` builds them
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def make_optimizer(optimizer: str | Callable[[Any], torch.optim.Optimizer], params: Any) -> torch.optim.Optimizer:
    """The optimizer ``optimizer`` names (``"adam"``, ``"adamw"``, ``"sgd"``, ``"momentum"``), or ``optimizer(params)``."""
    return OPTIMIZERS[optimizer](params) if isinstance(optimizer, str) else optimizer(params)


def processes_of(devices_or_cluster: Any) -> int:
    """How many processes ``devices_or_cluster`` means: a count of local processes, or ``"cuda"`` (one per GPU)."""
    if devices_or_cluster == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise InvalidArgumentError(
                "devices_or_cluster='cuda' needs GPUs, but torch sees none (torch.cuda.device_count() == 0): give a "
                "number of local CPU processes instead, e.g. sg.experimental.plan(..., 2, ...)")
        return count
    if isinstance(devices_or_cluster, bool) or not isinstance(devices_or_cluster, int) or devices_or_cluster < 1:
        raise InvalidArgumentError(
            f"devices_or_cluster must be a number of local processes (an int >= 1; each uses a GPU when torch sees "
            f"some) or 'cuda' (one process per GPU of this machine), got {devices_or_cluster!r}")
    return devices_or_cluster


def check_request(model_fn: Any, sample_batch: Any, *, global_batch: Any, optimizer: Any, memory_limit: Any,
                  time_budget_s: Any, loss_fn: Any, tensor_plan: Any, num_measured: Any,
                  steps: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Refuse what cannot be planned, naming the fix; the sample batch as ``(inputs, target)``."""
    if not callable(model_fn) or isinstance(model_fn, torch.nn.Module):
        raise InvalidArgumentError(
            f"model_fn must be a function that builds the model (each trial builds its own in its strategy's "
            f"scope), e.g. model_fn=lambda: torch.nn.Sequential(...), got {type(model_fn).__name__}")
    if (not isinstance(sample_batch, (tuple, list)) or len(sample_batch) != 2
            or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in sample_batch)
            or sample_batch[0].shape[0] != sample_batch[1].shape[0] or sample_batch[0].shape[0] < 1):
        raise InvalidArgumentError(
            "sample_batch must be (inputs, target): two tensors with the same number of rows (>= 1), e.g. "
            "(torch.randn(32, 784), torch.randn(32, 10)); the profile runs on it and the trials train on its rows")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise InvalidArgumentError(f"global_batch must be a positive int (rows per step over every process), "
                                   f"got {global_batch!r}")
    if not (callable(optimizer) or optimizer in OPTIMIZERS):
        raise InvalidArgumentError(f"optimizer must be one of {sorted(OPTIMIZERS)} or a function params -> "
                                   f"torch.optim.Optimizer, got {optimizer!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real)
                                     or not memory_limit > 0):
        raise InvalidArgumentError(f"memory_limit must be None or bytes per process (> 0), e.g. 4 * 2**30, "
                                   f"got {memory_limit!r}")
    if isinstance(time_budget_s, bool) or not isinstance(time_budget_s, numbers.Real) or not time_budget_s > 0:
        raise InvalidArgumentError(f"time_budget_s must be a positive number of seconds, got {time_budget_s!r}")
    if not callable(loss_fn):
        raise InvalidArgumentError(f"loss_fn must be callable: loss_fn(output, target) -> mean loss, got {loss_fn!r}")
    if tensor_plan is not None and (not isinstance(tensor_plan, dict) or not all(
            isinstance(k, str) and v in ("colwise", "rowwise") for k, v in tensor_plan.items())):
        raise InvalidArgumentError(
            f"tensor_plan must be None or a dict of module names (glob patterns allowed) to 'colwise' or "
            f"'rowwise', e.g. {{'0': 'colwise', '2': 'rowwise'}}, got {tensor_plan!r}")
    for name, value in (("num_measured", num_measured), ("steps", steps)):
        if (value is not None or name == "steps") and (isinstance(value, bool) or not isinstance(value, int)
                                                        or value < 1):
            raise InvalidArgumentError(f"{name} must be a positive int{' or None (all)' if name == 'num_measured' else ''}, "
                                       f"got {value!r}")
    return sample_batch[0], sample_batch[1]
