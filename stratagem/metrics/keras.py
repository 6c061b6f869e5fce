"""Keras's metrics by their Keras names, each holding its state in a torchmetrics metric.

Most Keras metrics are the weighted mean of a value computed per prediction
(``MeanMetricWrapper``): accuracy, MAE, MSE. Here they keep a :class:`WeightedMean` state
(a torchmetrics metric: a weighted sum and a total weight, in float64, both summed over
replicas and workers); their value is the weighted mean over every prediction, 0 when
nothing was seen (as in Keras), in ``dtype`` (default: torch's default dtype).
``AUC`` keeps torchmetrics' binned ROC (or precision-recall) state; :class:`TorchMetric`
wraps any torchmetrics metric.

Per-prediction values: a value per element of ``y_pred`` (accuracy, binary accuracy, MAE,
MSE) or per row (categorical and sparse categorical accuracy, which compare the argmax of
the last axis). ``sample_weight`` weighs rows: its shape is that of ``y_true`` without the
trailing axes (``(N,)`` or ``(N, 1)`` for a batch of N rows), or the full shape of the values.
Unlike Keras, a batch of 1-D predictions ``(N,)`` counts as N predictions, not one row, so
that the value is always the one computed on all predictions at once.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torchmetrics
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

from stratagem.errors import InvalidArgumentError
from stratagem.metrics.base import Metric

__all__ = ["AUC", "Accuracy", "BinaryAccuracy", "CategoricalAccuracy", "Mean", "MeanAbsoluteError",
           "MeanMetricWrapper", "MeanSquaredError", "SparseCategoricalAccuracy", "TorchMetric", "WeightedMean"]


class WeightedMean(torchmetrics.Metric):
    """torchmetrics state of Keras's mean metrics: a weighted sum and a total weight, both
    summed over replicas and workers; the value is 0 when the weight is 0 (as in Keras).

    float64 sums: a float32 count stops counting at 2**24 predictions. (torchmetrics'
    ``MeanMetric`` drops the weights when its NaN check is disabled; NaN must propagate here,
    not vanish.)"""

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        if weight is None:
            self.total.add_(values.sum(dtype=self.total.dtype))
            self.weight.add_(float(values.numel()))
        else:
            weight = weight.to(self.total.dtype)
            self.total.add_((values * weight).sum())
            self.weight.add_(weight.sum())

    def add(self, values: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """``update()`` without torchmetrics' wrapper (stratagem already disabled autograd):
        the wrapper's bookkeeping costs more than the sums on small batches."""
        type(self).update(self, values, weight)
        self.__dict__["_update_count"] += 1
        self.__dict__["_computed"] = None

    def compute(self) -> torch.Tensor:
        return self.value()

    def value(self) -> torch.Tensor:
        """``compute()`` without torchmetrics' wrapper around it (which costs more than the division)."""
        empty = self.weight == 0
        return torch.where(empty, torch.zeros_like(self.total), self.total / torch.where(empty, 1, self.weight))


def _add_weighted(state: WeightedMean, values: torch.Tensor, sample_weight: Any) -> None:
    if sample_weight is None:
        state.add(values)
        return
    weight = torch.as_tensor(sample_weight, device=values.device)
    while weight.dim() > values.dim() and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while weight.dim() < values.dim():
        weight = weight.unsqueeze(-1)
    try:
        weight = torch.broadcast_to(weight, values.shape)
    except RuntimeError:
        raise InvalidArgumentError(
            f"sample_weight of shape {tuple(torch.as_tensor(sample_weight).shape)} does not fit values of "
            f"shape {tuple(values.shape)}: give one weight per row ({values.shape[:1]}) or per value") from None
    state.add(values, weight)


def _tensors(y_true: Any, y_pred: Any) -> tuple[torch.Tensor, torch.Tensor]:
    y_pred = torch.as_tensor(y_pred)
    y_true = torch.as_tensor(y_true, device=y_pred.device)
    if y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    elif y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    return y_true, y_pred


class MeanMetricWrapper(Metric):
    """The weighted mean of ``fn(y_true, y_pred)`` (a tensor of per-prediction values).

    Example::

        import torch, stratagem as sg
        m = sg.metrics.MeanMetricWrapper(lambda t, p: (t - p).abs(), name="l1")
        m.update_state(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
        assert m.result().item() == 0.25
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, name: str = "mean",
                 *, dtype: torch.dtype | None = None):
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"MeanMetricWrapper needs a function fn(y_true, y_pred), got {fn!r}")
        self._fn = fn
        super().__init__(name, dtype=dtype)

    def _build(self) -> "torchmetrics.Metric":
        return WeightedMean()

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self._fn(y_true, y_pred))

    def _update(self, state: "torchmetrics.Metric", y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_true, y_pred = _tensors(y_true, y_pred)
        if y_true.shape[:1] != y_pred.shape[:1]:
            raise InvalidArgumentError(
                f"metric {self.name!r}: y_true has {y_true.shape[0] if y_true.dim() else 'no'} rows and "
                f"y_pred {y_pred.shape[0] if y_pred.dim() else 'no'} (shapes {tuple(y_true.shape)} and "
                f"{tuple(y_pred.shape)}); pass the labels and predictions of the same batch")
        _add_weighted(state, self._values(y_true, y_pred), sample_weight)

    def _compute(self, state: WeightedMean) -> torch.Tensor:
        return state.value().to(self.dtype or torch.get_default_dtype())


class Mean(Metric):
    """The weighted mean of the values given: ``update_state(values, sample_weight=None)``.

    Example::

        import torch, stratagem as sg
        loss = sg.metrics.Mean(name="loss")
        loss.update_state(torch.tensor([1.0, 3.0]))
        loss.update_state(torch.tensor(5.0))
        assert loss.result().item() == 3.0
    """

    def __init__(self, name: str = "mean", *, dtype: torch.dtype | None = None):
        super().__init__(name, dtype=dtype)

    def _build(self) -> "torchmetrics.Metric":
        return WeightedMean()

    def _update(self, state: "torchmetrics.Metric", values: Any, sample_weight: Any = None) -> None:
        _add_weighted(state, torch.as_tensor(values), sample_weight)

    def _compute(self, state: WeightedMean) -> torch.Tensor:
        return state.value().to(self.dtype or torch.get_default_dtype())


class Accuracy(MeanMetricWrapper):
    """How often ``y_pred`` equals ``y_true`` (Keras's ``Accuracy``: exact equality)."""

    def __init__(self, name: str = "accuracy", *, dtype: torch.dtype | None = None):
        super().__init__(None, name, dtype=dtype)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return y_pred.to(y_true.dtype) == y_true


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches the 0/1 label ``y_true``."""

    def __init__(self, name: str = "binary_accuracy", *, threshold: float = 0.5, dtype: torch.dtype | None = None):
        self.threshold = float(threshold)
        super().__init__(None, name, dtype=dtype)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return (y_pred > self.threshold).to(y_true.dtype) == y_true


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of ``y_pred`` matches the argmax of the one-hot ``y_true`` (last axis)."""

    def __init__(self, name: str = "categorical_accuracy", *, dtype: torch.dtype | None = None):
        super().__init__(None, name, dtype=dtype)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return y_pred.argmax(-1) == y_true.argmax(-1)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of ``y_pred`` (last axis) equals the class index ``y_true``."""

    def __init__(self, name: str = "sparse_categorical_accuracy", *, dtype: torch.dtype | None = None):
        super().__init__(None, name, dtype=dtype)

    def _update(self, state: "torchmetrics.Metric", y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.as_tensor(y_pred)
        y_true = torch.as_tensor(y_true, device=y_pred.device)
        if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
            y_true = y_true.squeeze(-1)
        if y_true.shape != y_pred.shape[:-1]:
            raise InvalidArgumentError(
                f"metric {self.name!r} compares class indices y_true of shape (N,) or (N, 1) with scores "
                f"y_pred of shape (N, num_classes); got y_true {tuple(y_true.shape)} and y_pred "
                f"{tuple(y_pred.shape)}")
        _add_weighted(state, y_pred.argmax(-1) == y_true.long(), sample_weight)


class MeanAbsoluteError(MeanMetricWrapper):
    """The mean of ``|y_true - y_pred|`` over every predicted value."""

    def __init__(self, name: str = "mean_absolute_error", *, dtype: torch.dtype | None = None):
        super().__init__(None, name, dtype=dtype)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return (y_true.to(y_pred.dtype) - y_pred).abs()


class MeanSquaredError(MeanMetricWrapper):
    """The mean of ``(y_true - y_pred) ** 2`` over every predicted value."""

    def __init__(self, name: str = "mean_squared_error", *, dtype: torch.dtype | None = None):
        super().__init__(None, name, dtype=dtype)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return (y_true.to(y_pred.dtype) - y_pred).square()


class AUC(Metric):
    """Area under the ROC curve (``curve="ROC"``) or the precision-recall curve (``"PR"``,
    torchmetrics' average precision) of scores ``y_pred`` against 0/1 labels ``y_true``, every
    value of a batch counted as one prediction.

    ``num_thresholds`` bins the scores as Keras does (bounded memory, the state is summed over
    replicas); ``None`` keeps every prediction and computes the exact area. ``from_logits``:
    the scores are logits (a sigmoid is applied). ``sample_weight`` is not supported.
    """

    def __init__(self, num_thresholds: int | None = 200, curve: str = "ROC", name: str = "auc", *,
                 from_logits: bool = False, dtype: torch.dtype | None = None):
        if curve not in ("ROC", "PR"):
            raise InvalidArgumentError(f"AUC curve must be 'ROC' or 'PR', got {curve!r}")
        if num_thresholds is not None and (not isinstance(num_thresholds, int) or num_thresholds < 2):
            raise InvalidArgumentError(f"num_thresholds must be an int > 1 or None, got {num_thresholds!r}")
        self.num_thresholds, self.curve, self.from_logits = num_thresholds, curve, from_logits
        super().__init__(name, dtype=dtype)

    def _build(self) -> "torchmetrics.Metric":
        kind = BinaryAUROC if self.curve == "ROC" else BinaryAveragePrecision
        metric = kind(thresholds=self.num_thresholds)
        return metric if self.dtype is None else metric.set_dtype(self.dtype)

    def _update(self, state: "torchmetrics.Metric", y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        if sample_weight is not None:
            raise InvalidArgumentError(f"metric {self.name!r} (AUC) does not support sample_weight; leave it out")
        y_true, y_pred = _tensors(y_true, y_pred)
        scores = y_pred.reshape(-1).float()
        if self.from_logits:
            scores = scores.sigmoid()
        state.update(scores, y_true.reshape(-1).long())


class TorchMetric(Metric):
    """Any torchmetrics metric, aggregated over stratagem's replicas and workers.

    ``update_state(y_true, y_pred)`` calls the metric's ``update(y_pred, y_true)``
    (torchmetrics takes predictions first; ``update_state(None, values)`` calls
    ``update(values)``, for aggregations such as ``SumMetric``); ``result()`` its ``compute()`` on the merged state.
    The metric given is copied (and reset): it serves as the template of every replica's state.

    Example::

        import torch, torchmetrics, stratagem as sg
        f1 = sg.metrics.get(torchmetrics.F1Score(task="multiclass", num_classes=3))
        f1.update_state(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
        print(f1.name, f1.result())
    """

    def __init__(self, metric: "torchmetrics.Metric", name: str | None = None):
        if not isinstance(metric, torchmetrics.Metric):
            raise InvalidArgumentError(f"TorchMetric wraps a torchmetrics.Metric instance, got {metric!r}")
        inner = [type(m).__name__ for m in metric.modules() if m is not metric and isinstance(m, torchmetrics.Metric)]
        if inner or not metric._defaults:
            where = f"in inner metrics ({', '.join(inner)})" if inner else "outside add_state"
            raise InvalidArgumentError(
                f"{type(metric).__name__} keeps its state {where}, "
                f"which stratagem cannot combine over replicas and workers; wrap the inner metric itself, "
                f"or a metric whose state is declared with add_state")
        self._given: Any = metric
        super().__init__(name or re.sub(r"(?<!^)(?=[A-Z])", "_", type(metric).__name__).lower())
        del self._given

    def _build(self) -> "torchmetrics.Metric":
        return self._given

    def _update(self, state: "torchmetrics.Metric", y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        if sample_weight is not None:
            raise InvalidArgumentError(
                f"metric {self.name!r} ({type(state).__name__}) takes no sample_weight: torchmetrics' "
                f"update(preds, target) has none; leave it out")
        if y_true is None:   # an aggregation (SumMetric, MaxMetric...): update(values)
            state.update(y_pred)
        else:
            state.update(y_pred, y_true)
