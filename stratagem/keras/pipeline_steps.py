"""``sg.Model``'s steps under ``PipelineStrategy``: the schedule runs forward and backward.

A pipeline's step is not a forward and then ``loss.backward()``: the schedule interleaves
the micro-batches' forwards and backwards, and calls the loss on the last stage, one
micro-batch at a time. So the train step hands the schedule a loss over row indices:
``strategy.forward_backward`` is given each row's index in the batch as its target, and
the loss of a micro-batch looks up those rows' targets and sample weights, takes the
compiled loss's per-example values, weights them and averages them over the micro-batch
(the schedule then weights each micro-batch by its share of the global batch). The
gradient is Keras's ``sum_over_batch_size`` over the global batch, sample weights
included, exactly as under the other strategies.

Metrics need the model's outputs, which only the last stage has: with compiled metrics,
``forward_backward(..., return_outputs=True)`` sends them to every process of the pipeline,
and every process updates its metrics alike (reading one is then a collective over the
data axis, as for the other strategies, the same value everywhere). Without, only the
loss tracker is updated, from the step's loss (no outputs travel). ``evaluate`` and
``predict`` run :meth:`PipelineStrategy.predict`, whose output reaches every process.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from stratagem.errors import InvalidArgumentError
from stratagem.nn.losses import current_global_batch_size
from stratagem.keras.inputs import unpack
from stratagem.keras.steps import ModelSteps, StepPrecision, per_example_losses, update_metrics
from stratagem.keras.structured import OutputChoice
from stratagem.values import flatten, map_structure

__all__ = ["PipelineSteps"]


class PipelineSteps(ModelSteps):
    """The train / test / predict steps of ``Model`` under a ``PipelineStrategy``."""

    supports_mixed_precision = False   # (compile refuses a mixed policy: the schedule runs the forward)
    supports_jit_compile = False

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def train(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
              loss_tracker: Any, metrics: Sequence[Any], precision: StepPrecision | None = None, *,
              output: OutputChoice | None = None) -> Callable[[Any], tuple[torch.Tensor, int]]:
        strategy = _one_output(self.strategy, output)

        def train_step(batch: Any) -> tuple[torch.Tensor, int]:
            parts = unpack(batch)
            rows = _check_rows(parts)
            optimizer.zero_grad()
            result = strategy.forward_backward(module, parts.x, torch.arange(rows),
                                               loss_fn=_MicroBatchLoss(loss_fn, parts), return_outputs=bool(metrics))
            optimizer.step()   # gradients summed over the data axis, each process updates its stages
            if metrics:
                loss, y_pred = result
                losses, weights = per_example_losses(loss_fn, parts.y, y_pred, parts.sample_weight)
                update_metrics(loss_tracker, metrics, parts.y, y_pred, losses, weights)
            else:   # this data group's sum of weighted losses, over its rows
                loss = result
                share = loss.detach() * current_global_batch_size(rows)
                loss_tracker.update_state(share.reshape(1) / rows, sample_weight=torch.tensor([float(rows)]))
            return loss.detach(), rows
        return train_step

    def test(self, module: torch.nn.Module, loss_fn: Callable, loss_tracker: Any,
             metrics: Sequence[Any], precision: StepPrecision | None = None, *,
             output: OutputChoice | None = None) -> Callable[[Any], None]:
        strategy = _one_output(self.strategy, output)

        def test_step(batch: Any) -> None:
            parts = unpack(batch)
            y_pred = strategy.predict(module, parts.x)
            with torch.no_grad():
                losses, weights = per_example_losses(loss_fn, parts.y, y_pred, parts.sample_weight)
            update_metrics(loss_tracker, metrics, parts.y, y_pred, losses, weights)
        return test_step

    def predict(self, module: torch.nn.Module, precision: StepPrecision | None = None, *,
                output: OutputChoice | None = None) -> Callable[[Any], Any]:
        strategy = _one_output(self.strategy, output)
        return lambda batch: strategy.predict(module, unpack(batch).x)


class _MicroBatchLoss:
    """The schedule's ``loss_fn(output, rows)`` on the last stage: the compiled loss of those
    rows of the batch, weighted by their sample weights, averaged over the micro-batch."""

    def __init__(self, loss_fn: Callable, parts: Any) -> None:
        self.loss_fn, self.y, self.sample_weight = loss_fn, parts.y, parts.sample_weight

    def __call__(self, y_pred: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        y = map_structure(lambda t: t[rows.to(t.device)] if isinstance(t, torch.Tensor) else t, self.y)
        weight = self.sample_weight
        if weight is not None:
            weight = torch.as_tensor(weight, device=rows.device).reshape(-1)[rows]
        losses, weights = per_example_losses(self.loss_fn, y, y_pred, weight)
        weighted = losses if weights is None else losses * weights
        return weighted.sum() / max(rows.numel(), 1)


def _one_output(strategy: Any, output: OutputChoice | None) -> Any:
    """The strategy, once sure the model reads the last stage's output as it is (a tensor)."""
    if output is not None and output.key is not None:
        raise InvalidArgumentError(f"sg.Model(module, output={output.key!r}) is not supported under "
                                   f"{type(strategy).__name__}: the last stage returns the one tensor the loss "
                                   f"reads; build the Model without output=")
    return strategy


def _check_rows(parts: Any) -> int:
    """The batch's rows; targets and weights checked on every process (the loss runs on the last stage only)."""
    if parts.y is None:
        raise InvalidArgumentError("training needs targets: batches of (x, y) or (x, y, sample_weight), or fit(x, y)")
    first = next((t for t in flatten(parts.x) if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if first is None:
        raise InvalidArgumentError(f"the model's input must be a tensor with a batch dimension, got "
                                   f"{type(parts.x).__name__}")
    rows = first.shape[0]
    for name, value in (("targets", parts.y), ("sample_weight", parts.sample_weight)):
        for leaf in flatten(value) if value is not None else ():
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != rows:
                raise InvalidArgumentError(
                    f"under PipelineStrategy the {name} must be tensors with one row per example ({rows}), got "
                    f"{tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__}")
    return rows
