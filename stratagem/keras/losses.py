"""Losses for :meth:`sg.Model.compile <stratagem.Model.compile>`: Keras's names, per-example values.

``Model`` needs one loss *per example* (weighted by ``sample_weight``, summed, and divided
by the global batch size, as :func:`sg.nn.compute_average_loss
<stratagem.nn.compute_average_loss>` does), so that the gradients summed over replicas
equal the single-device ones. :func:`get` turns what ``compile`` was given into such a
function, called ``loss(y_true, y_pred) -> per-example tensor``:

- a short name (``"mse"``, ``"mae"``, ``"binary_crossentropy"``,
  ``"categorical_crossentropy"``, ``"sparse_categorical_crossentropy"``) or one of the
  classes below, e.g. ``SparseCategoricalCrossentropy(from_logits=True)``;
- a ``torch.nn`` loss module (``torch.nn.CrossEntropyLoss()``): called torch's way,
  ``loss(y_pred, y_true)``, with ``reduction="none"`` (a copy is made);
- a function of ``torch.nn.functional`` (``F.cross_entropy``): torch's way too;
- any other callable: Keras's way, ``fn(y_true, y_pred)``, returning per-example losses
  (or a scalar mean, which then cannot be weighted by ``sample_weight``).

``from_logits`` defaults to ``False`` as in Keras: the crossentropies then expect
probabilities (a model ending in softmax or sigmoid), and a prediction outside
``[0, 1]`` raises an error that names ``from_logits=True`` -- a PyTorch model that ends
in ``nn.Linear`` outputs logits and needs ``from_logits=True``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from stratagem.errors import InvalidArgumentError

__all__ = ["BinaryCrossentropy", "CategoricalCrossentropy", "Loss", "MeanAbsoluteError", "MeanSquaredError",
           "Reduction", "SparseCategoricalCrossentropy", "get"]

_EPSILON = 1e-7   # Keras's clipping of probabilities


class Reduction:
    """Keras's names for how a loss object called directly reduces its per-example values.

    ``NONE``: one value per example (what a custom training loop passes to
    :func:`sg.nn.compute_average_loss <stratagem.nn.compute_average_loss>`); ``SUM``: their
    sum; ``SUM_OVER_BATCH_SIZE`` (Keras's default; ``AUTO`` and ``"mean"`` are the same): their
    mean over this batch -- under a strategy with several replicas that is each replica's own
    mean, which is why TensorFlow's custom-loop tutorial asks for ``NONE``;
    ``"mean_with_sample_weight"``: the weighted sum over the sum of the weights.
    ``sg.Model.compile`` always works per example, whatever the reduction.

    Example::

        import torch, stratagem as sg
        loss = sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=sg.losses.Reduction.NONE)
        assert loss(torch.tensor([0, 1]), torch.zeros(2, 3)).shape == (2,)
    """

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"

    ALL = ("auto", "none", "sum", "sum_over_batch_size", "mean", "mean_with_sample_weight")

    @classmethod
    def validate(cls, reduction: Any) -> str:
        """``reduction`` as one of :attr:`ALL` (``None`` is ``"none"``); a clear error otherwise."""
        name = "none" if reduction is None else reduction
        if name not in cls.ALL:
            raise InvalidArgumentError(
                f"unknown loss reduction {reduction!r}; use one of {', '.join(map(repr, cls.ALL))} or None "
                f"(sg.losses.Reduction.NONE / SUM / SUM_OVER_BATCH_SIZE)")
        return name


class Loss:
    """A loss object, Keras's way: ``loss(y_true, y_pred, sample_weight=None)`` reduced by ``reduction``.

    Subclasses define ``call(y_true, y_pred)``, the loss of every example (extra dimensions
    are averaged). ``reduction`` is one of :class:`Reduction`'s names (default
    ``"sum_over_batch_size"``, as in Keras); ``compile`` uses the per-example values whatever
    it is.

    Example::

        import torch, stratagem as sg
        loss = sg.losses.MeanSquaredError()                  # the batch's mean, as in Keras
        assert loss(torch.zeros(2, 2), torch.ones(2, 2)).item() == 1.0
        per_example = sg.losses.MeanSquaredError(reduction="none")
        assert per_example(torch.zeros(2, 2), torch.ones(2, 2)).tolist() == [1.0, 1.0]
    """

    name = "loss"
    _ARGUMENTS = ("reduction", "name")

    def __init__(self, reduction: Any = Reduction.SUM_OVER_BATCH_SIZE, name: str | None = None,
                 **unknown: Any) -> None:
        self._refuse(unknown)
        self.reduction = Reduction.validate(reduction)
        if name is not None:
            self.name = name

    def _refuse(self, unknown: dict) -> None:
        if unknown:
            raise TypeError(f"sg.losses.{type(self).__name__}() got unexpected argument(s) "
                            f"{', '.join(sorted(unknown))}; it takes {', '.join(self._ARGUMENTS)}")

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: Any = None) -> torch.Tensor:
        values = self.per_example(y_true, y_pred)
        weighted = values
        if sample_weight is not None:
            sample_weight = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
            weighted = values * sample_weight.reshape(values.shape)
        if self.reduction == "none":
            return weighted
        if self.reduction == "sum":
            return weighted.sum()
        if self.reduction == "mean_with_sample_weight" and sample_weight is not None:
            return weighted.sum() / sample_weight.sum()
        return weighted.sum() / max(values.numel(), 1)

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """One loss value per example, whatever ``reduction`` is."""
        return _per_example(self.call(y_true, y_pred))

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


class MeanSquaredError(Loss):
    """``mean((y_pred - y_true) ** 2)`` over each example's values.

    Example::

        import torch, stratagem as sg
        loss = sg.losses.MeanSquaredError(reduction="none")
        assert loss(torch.zeros(2, 2), torch.ones(2, 2)).tolist() == [1.0, 1.0]
    """

    name = "mean_squared_error"

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return (y_pred - _like(y_true, y_pred)) ** 2


class MeanAbsoluteError(Loss):
    """``mean(|y_pred - y_true|)`` over each example's values."""

    name = "mean_absolute_error"

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return (y_pred - _like(y_true, y_pred)).abs()


class _Crossentropy(Loss):
    _ARGUMENTS = ("from_logits", "reduction", "name")

    def __init__(self, from_logits: bool = False, reduction: Any = Reduction.SUM_OVER_BATCH_SIZE,
                 name: str | None = None, **unknown: Any) -> None:
        super().__init__(reduction, name, **unknown)
        self.from_logits = bool(from_logits)

    def _check_probabilities(self, y_pred: torch.Tensor) -> None:
        if y_pred.numel() and bool(((y_pred < -1e-6) | (y_pred > 1 + 1e-6)).any()):
            raise InvalidArgumentError(
                f"{type(self).__name__}(from_logits=False) expects probabilities in [0, 1], but the model "
                f"predicted values from {y_pred.min().item():.3g} to {y_pred.max().item():.3g}: it outputs "
                f"logits. Pass from_logits=True (e.g. loss=sg.losses.{type(self).__name__}(from_logits=True)), "
                f"or end the model with a softmax / sigmoid")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(from_logits={self.from_logits}, reduction={self.reduction!r})"


class BinaryCrossentropy(_Crossentropy):
    """Binary crossentropy of 0/1 targets (floats); ``from_logits=False``: ``y_pred`` are probabilities.

    Example::

        import torch, stratagem as sg
        loss = sg.losses.BinaryCrossentropy(from_logits=True, reduction="none")
        print(loss(torch.tensor([[1.0], [0.0]]), torch.tensor([[2.0], [-2.0]])))
    """

    name = "binary_crossentropy"

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        target = _like(y_true, y_pred)
        if self.from_logits:
            return F.binary_cross_entropy_with_logits(y_pred, target, reduction="none")
        self._check_probabilities(y_pred)
        return F.binary_cross_entropy(y_pred.clamp(_EPSILON, 1 - _EPSILON), target, reduction="none")


class CategoricalCrossentropy(_Crossentropy):
    """Crossentropy of one-hot (or soft) targets over the last dimension."""

    name = "categorical_crossentropy"

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        target = _like(y_true, y_pred)
        if self.from_logits:
            log_probs = F.log_softmax(y_pred, dim=-1)
        else:
            self._check_probabilities(y_pred)
            probs = y_pred / y_pred.sum(dim=-1, keepdim=True)   # Keras normalises too
            log_probs = probs.clamp(_EPSILON, 1 - _EPSILON).log()
        return -(target * log_probs).sum(dim=-1)


class SparseCategoricalCrossentropy(_Crossentropy):
    """Crossentropy of integer class targets; ``y_pred`` has one column per class.

    Example::

        import torch, stratagem as sg
        loss = sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        assert loss(torch.tensor([0, 1]), torch.zeros(2, 3)).shape == (2,)
    """

    name = "sparse_categorical_crossentropy"

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        target = y_true.long()
        if target.dim() == y_pred.dim():   # Keras accepts labels of shape (N, 1)
            target = target.squeeze(-1)
        if self.from_logits:
            return F.cross_entropy(y_pred, target, reduction="none")
        self._check_probabilities(y_pred)
        return F.nll_loss(y_pred.clamp(_EPSILON, 1 - _EPSILON).log(), target, reduction="none")


_NAMES: dict[str, type[Loss]] = {
    "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError, "mean_absolute_error": MeanAbsoluteError,
    "binary_crossentropy": BinaryCrossentropy, "bce": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}


def get(identifier: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What ``compile(loss=...)`` was given, as ``fn(y_true, y_pred) -> per-example losses``.

    Example::

        import torch, stratagem as sg
        fn = sg.losses.get(torch.nn.MSELoss())
        assert fn(torch.zeros(3, 2), torch.ones(3, 2)).tolist() == [1.0, 1.0, 1.0]
    """
    if isinstance(identifier, str):
        cls = _NAMES.get(identifier.lower())
        if cls is None:
            raise InvalidArgumentError(
                f"unknown loss {identifier!r}; use one of {', '.join(sorted(_NAMES))}, a torch.nn loss "
                f"(torch.nn.CrossEntropyLoss()), or a function fn(y_true, y_pred) -> per-example losses")
        identifier = cls()   # per example below (called, the object would reduce to the batch's mean)
    if isinstance(identifier, Loss):
        return _TorchOrder(functools.partial(_keras_order, identifier), identifier.name)
    if isinstance(identifier, torch.nn.Module) and hasattr(identifier, "reduction"):
        module = copy.copy(identifier)
        module.reduction = "none"
        return _TorchOrder(module)
    if callable(identifier) and getattr(identifier, "__module__", None) == "torch.nn.functional":
        return _TorchOrder(lambda y_pred, y_true: identifier(y_pred, y_true, reduction="none"),
                           getattr(identifier, "__name__", "loss"))
    if callable(identifier):
        return identifier
    raise InvalidArgumentError(
        f"loss must be a name ('mse', 'sparse_categorical_crossentropy', ...), a torch.nn loss or a "
        f"callable, got {type(identifier).__name__}")


def _keras_order(loss: Loss, y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
    """``loss``'s per-example values, with the targets shaped as Keras's ``compile`` shapes them:
    targets ``(N,)`` against predictions ``(N, k)`` are ``(N, 1)``, one target per example (plain
    broadcasting would pair target ``j`` with column ``j`` where ``N == k``, and fail elsewhere)."""
    if y_true.dim() == 1 and y_pred.dim() == 2:
        y_true = y_true.unsqueeze(-1)
    return loss.per_example(y_true, y_pred)


class _TorchOrder:
    """A torch loss (``reduction="none"``) called with Keras's argument order."""

    def __init__(self, fn: Callable, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or type(fn).__name__

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_true.is_floating_point() and y_true.dtype != y_pred.dtype:
            y_true = y_true.to(y_pred.dtype)
        return _per_example(self.fn(y_pred, y_true))


def _like(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Targets in the prediction's dtype, shaped like it where only a trailing 1 differs."""
    target = y_true.to(y_pred.dtype)
    if target.shape != y_pred.shape and target.numel() == y_pred.numel():
        target = target.reshape(y_pred.shape)
    return target


def _per_example(values: torch.Tensor) -> torch.Tensor:
    """One value per example: the mean over every dimension but the first (Keras's last-axis mean)."""
    if values.dim() <= 1:
        return values
    return values.reshape(values.shape[0], -1).mean(dim=1)
