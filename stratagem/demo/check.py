"""The demo's verdict: a strategy's final parameters against plain PyTorch's (the equivalence guarantee).

A synchronous strategy trained from the same initial weights on the same batches must end
where plain single-device PyTorch ends, up to float32 rounding: :func:`check_equivalence`
trains the reference and compares with :func:`max_relative_difference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stratagem.demo.data import Digits
from stratagem.demo.training import TrainConfig, Trained, one_intra_op_thread, train_plain_pytorch
from stratagem.errors import InvalidArgumentError

__all__ = ["DemoResult", "check_equivalence", "max_relative_difference"]


@dataclass(frozen=True)
class DemoResult:
    """What one demo run measured.

    ``max_rel_diff`` is, over every parameter tensor, the largest absolute difference
    between the strategy's and plain PyTorch's final values, divided by the largest
    absolute value of that tensor in plain PyTorch; ``passed`` means it is within
    ``tolerance``. ``seconds`` is the strategy's training time (not the reference's, not
    data loading or starting processes).

    Asynchronous training (``parameter_server``) does not follow plain PyTorch step by
    step, so there ``max_rel_diff`` is None and ``passed`` means ``accuracy >=
    min_accuracy``; ``reference_accuracy`` is still plain PyTorch's after as many steps.
    ``num_workers`` counts the worker processes (1 for the strategies of one process).
    """

    accuracy: float
    max_rel_diff: float | None
    passed: bool
    steps: int
    seconds: float
    reference_accuracy: float
    tolerance: float
    strategy: str
    num_replicas: int
    num_workers: int = 1
    min_accuracy: float | None = None


def check_equivalence(trained: Trained, data: Digits, config: TrainConfig, tolerance: float, *,
                      strategy: str, num_replicas: int, num_workers: int = 1) -> DemoResult:
    """Train plain PyTorch from the same initial weights and compare the final parameters."""
    with one_intra_op_thread():
        reference, reference_accuracy = train_plain_pytorch(trained.initial_state, data, config)
    diff = max_relative_difference(trained.final_state, reference.state_dict())
    return DemoResult(accuracy=trained.accuracy, max_rel_diff=diff, passed=diff <= tolerance,
                      steps=trained.steps, seconds=trained.seconds, reference_accuracy=reference_accuracy,
                      tolerance=tolerance, strategy=strategy, num_replicas=num_replicas,
                      num_workers=num_workers)


def max_relative_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max over tensors of ``max|a - b| / max|b|``: float32 rounding gives about 1e-6.

    Example::

        import torch
        from stratagem.demo import max_relative_difference
        a = {"w": torch.tensor([1.0, -2.0])}
        assert max_relative_difference(a, {"w": torch.tensor([1.0, -2.002])}) < 1e-3
    """
    if state.keys() != reference.keys():
        raise InvalidArgumentError(
            f"the two models have different parameters: {sorted(state)} vs {sorted(reference)}")
    worst = 0.0
    for key, ref in reference.items():
        ref = ref.detach().double().cpu()
        value = state[key].detach().double().cpu()
        scale = max(ref.abs().max().item(), 1e-12) if ref.numel() else 1.0
        diff = (value - ref).abs().max().item() if ref.numel() else 0.0
        worst = max(worst, diff / scale) if not math.isnan(diff) else math.inf
    return worst
