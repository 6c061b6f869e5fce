"""``sg.metrics.get``: a metric from what ``compile(metrics=[...])`` was given.

``"accuracy"`` (or ``"acc"``) depends on the loss, as in Keras: sparse categorical
cross-entropy (``"sparse_categorical_crossentropy"``, ``nn.CrossEntropyLoss``,
``nn.NLLLoss``) gives :class:`SparseCategoricalAccuracy`, binary cross-entropy
(``"binary_crossentropy"``, ``nn.BCELoss``) :class:`BinaryAccuracy` (threshold 0 on logits:
``nn.BCEWithLogitsLoss`` or a loss with ``from_logits=True``), categorical cross-entropy
:class:`CategoricalAccuracy`. With another loss, or none, the kind is chosen from the
shapes of each batch, as Keras 3 does: integer predictions are compared for equality, scores
with one column (or one axis) are binary, labels with one axis less than the scores (or one
column) are class indices, otherwise one-hot labels.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from stratagem.errors import InvalidArgumentError
from stratagem.metrics.base import Metric
from stratagem.metrics.keras import (AUC, BinaryAccuracy, CategoricalAccuracy, Mean, MeanAbsoluteError,
                                     MeanMetricWrapper, MeanSquaredError, SparseCategoricalAccuracy, TorchMetric,
                                     _tensors)

__all__ = ["get"]

_BY_NAME = {
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "mae": MeanAbsoluteError, "mean_absolute_error": MeanAbsoluteError,
    "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError,
    "auc": AUC,
    "mean": Mean,
}
_ACCURACY = ("accuracy", "acc")


class _AccuracyByShape(MeanMetricWrapper):
    """``"accuracy"`` with a loss that does not say which accuracy: chosen per batch from the
    shapes (the state is the same weighted mean for every kind)."""

    def __init__(self, name: str = "accuracy"):
        super().__init__(None, name)

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if not (y_pred.is_floating_point() or y_pred.is_complex()):   # predicted classes
            return y_pred.to(y_true.dtype) == y_true
        if y_pred.dim() == 0 or y_pred.shape[-1] == 1 or y_pred.dim() == 1:
            return (y_pred > 0.5).to(y_true.dtype) == y_true
        if y_true.dim() == y_pred.dim() - 1:
            return y_pred.argmax(-1) == y_true.long()
        return y_pred.argmax(-1) == y_true.argmax(-1)

    def _update(self, state: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.as_tensor(y_pred)
        y_true = torch.as_tensor(y_true, device=y_pred.device)
        if y_pred.dim() >= 2 and y_pred.shape[-1] > 1 and y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
            y_true = y_true.squeeze(-1)   # class indices as a column
        else:
            y_true, y_pred = _tensors(y_true, y_pred)
        super()._update(state, y_true, y_pred, sample_weight)


def _loss_kind(loss: Any) -> tuple[str | None, bool]:
    """("sparse" / "binary" / "categorical" / None, whether the loss takes logits)."""
    if loss is None:
        return None, False
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", type(loss).__name__)
    key = re.sub(r"[^a-z]", "", name.lower())
    logits = bool(getattr(loss, "from_logits", False)) or key in ("bcewithlogitsloss", "binarycrossentropywithlogits")
    if key in ("sparsecategoricalcrossentropy", "crossentropyloss", "nllloss", "crossentropy"):
        return "sparse", logits
    if key in ("binarycrossentropy", "bceloss", "bcewithlogitsloss", "binarycrossentropywithlogits", "bce"):
        return "binary", logits
    if key == "categoricalcrossentropy":
        return "categorical", logits
    return None, logits


def _accuracy_for(name: str, loss: Any) -> Metric:
    kind, logits = _loss_kind(loss)
    if kind == "sparse":
        return SparseCategoricalAccuracy(name)
    if kind == "binary":
        return BinaryAccuracy(name, threshold=0.0 if logits else 0.5)
    if kind == "categorical":
        return CategoricalAccuracy(name)
    return _AccuracyByShape(name)


def get(identifier: Any, *, loss: Any = None) -> Metric:
    """A :class:`Metric` from a metric, a torchmetrics metric, a metric class, a function
    ``fn(y_true, y_pred)`` of per-prediction values, or a short name; ``loss`` (a name or a
    module) decides what ``"accuracy"`` means (module docstring). Call it in the strategy's
    scope: the metric is bound to the strategy active there.

    Example::

        import torch, stratagem as sg
        acc = sg.metrics.get("accuracy", loss=torch.nn.CrossEntropyLoss())
        assert type(acc).__name__ == "SparseCategoricalAccuracy" and acc.name == "accuracy"
        try:
            sg.metrics.get("accurracy")
        except ValueError as error:
            print(error)
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, str):
        name = identifier
        key = name.lower()
        if key in _ACCURACY:
            return _accuracy_for(name, loss)
        kind = _BY_NAME.get(key)
        if kind is None:
            known = sorted([*_BY_NAME, *_ACCURACY])
            raise InvalidArgumentError(
                f"unknown metric name {identifier!r}; known names: {', '.join(known)}. Or pass a metric "
                f"object: an sg.metrics.Metric, a torchmetrics.Metric, or a function fn(y_true, y_pred)")
        return kind(name=name)
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if _is_torchmetric(identifier):
        return TorchMetric(identifier)
    if callable(identifier) and not isinstance(identifier, type):
        return MeanMetricWrapper(identifier, getattr(identifier, "__name__", type(identifier).__name__))
    raise InvalidArgumentError(
        f"a metric must be a name, an sg.metrics.Metric, a torchmetrics.Metric or a function "
        f"fn(y_true, y_pred); got {identifier!r}")


def _is_torchmetric(value: Any) -> bool:
    return any(c.__module__.startswith("torchmetrics") and c.__name__ == "Metric" for c in type(value).__mro__)
