"""What ``stratagem demo`` prints: the header before training and the results block after."""

from __future__ import annotations

from typing import TextIO

from stratagem.demo.check import DemoResult
from stratagem.demo.data import Digits
from stratagem.demo.training import TrainConfig

__all__ = ["format_result", "print_header"]


def print_header(out: TextIO, strategy_line: str, data: Digits, config: TrainConfig, num_replicas: int,
                 *, batches_line: str | None = None, training_line: str | None = None) -> None:
    """The header before training: the data, the strategy, how batches are cut, the settings."""
    train_rows = len(data.y_train)
    batch_size, epochs = config.batch_size, config.epochs
    steps_per_epoch = config.steps_per_epoch(data)
    last = train_rows - (steps_per_epoch - 1) * batch_size
    if batches_line is None:
        batches_line = (f"global {batch_size} -> {_split(batch_size, num_replicas)} per replica; "
                        f"last batch {last} -> {_split(last, num_replicas)}")
    if training_line is None:
        training_line = f"{epochs} epoch{'s' * (epochs != 1)} x {steps_per_epoch} steps"
    lines = [
        f"stratagem demo: MLP on scikit-learn digits ({train_rows} train / {len(data.y_test)} test "
        f"images, 64 features, 10 classes)",
        f"  strategy   {strategy_line}",
        f"  batches    {batches_line}",
        f"  training   {training_line}, {config.optimizer} lr {config.lr:g}, seed {config.seed}",
    ]
    print("\n".join(lines), file=out, flush=True)


def _split(rows: int, num_replicas: int) -> str:
    """How the strategy cuts ``rows`` (earlier replicas take the extra rows), as ``"15/14"``."""
    base, extra = divmod(rows, num_replicas)
    sizes = [base + (r < extra) for r in range(num_replicas)]
    return "/".join(map(str, sizes))


def format_result(result: DemoResult) -> str:
    """The results block that ``stratagem demo`` prints."""
    verdict = "PASS" if result.passed else "FAIL"
    lines = [
        "results",
        f"  test accuracy   {result.accuracy:.4f}   (plain PyTorch: {result.reference_accuracy:.4f})",
        f"  training time   {result.seconds:.2f} s for {result.steps} steps "
        f"({result.steps / max(result.seconds, 1e-9):.0f} steps/s)",
    ]
    if result.max_rel_diff is not None:
        lines.append(f"  equivalence     {verdict}: max relative parameter difference vs plain PyTorch "
                     f"{result.max_rel_diff:.1e} (tolerance {result.tolerance:.0e})")
    else:   # asynchronous training: judged on accuracy
        relation = ">=" if result.passed else "<"
        lines += [
            "  equivalence     not applicable: asynchronous training applies each worker's update "
            "as it comes, not in plain PyTorch's order",
            f"  accuracy check  {verdict}: test accuracy {result.accuracy:.4f} {relation} "
            f"{result.min_accuracy:g}",
        ]
        if not result.passed:
            lines.append("                  train longer (the threshold needs about --epochs 5)")
    return "\n".join(lines)
