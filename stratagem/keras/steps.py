"""The functions ``Model`` runs per replica (or on a parameter-server worker): train, test, predict.

Each is made by a factory that closes over only what the step needs (the module, the
optimizer, the loss function, the metrics), never over the ``Model``: under a
parameter-server strategy the train step is pickled and sent to the workers, where the
module's variables and the optimizer travel as references.

The loss of a step is Keras's ``sum_over_batch_size``: per-example losses, weighted by
``sample_weight``, summed, divided by the *global* batch size
(:func:`sg.nn.compute_average_loss <stratagem.nn.compute_average_loss>`). Summed over
replicas, the gradients are then those of the whole batch on one device.

Under a mixed-precision policy (:class:`StepPrecision`) the forward pass runs under
``torch.autocast``, the loss and the metrics see the outputs in float32, and with
``"mixed_float16"`` the loss is scaled by the model's ``GradScaler`` (created in the
strategy's scope: one skip decision for every replica).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from stratagem.errors import InvalidArgumentError
from stratagem.mixed_precision import Policy
from stratagem.nn.losses import compute_average_loss
from stratagem.observe import record
from stratagem.keras.inputs import unpack
from stratagem.keras.structured import OutputChoice, call_module, check_inputs
from stratagem.values import map_structure

__all__ = ["ModelSteps", "StepPrecision", "check_jit_compile", "compiled", "make_predict_step", "make_test_step", "make_train_step",
           "per_example_losses"]


@dataclass(frozen=True)
class StepPrecision:
    """How a step computes: the policy, the device type autocast acts on, the loss scaler."""

    policy: Policy
    device_type: str = "cpu"
    loss_scaler: Any = None   # a torch.amp.GradScaler created in scope ("mixed_float16")
    jit_compile: bool = False   # compile(jit_compile=True): the forward through torch.compile

    def forward(self, module: torch.nn.Module, x: Any) -> Any:
        """The module's outputs, computed under autocast and read in float32 (a dict ``x`` is
        passed as keyword arguments, a tuple as positional ones: :func:`call_module`)."""
        check_inputs(module, x)
        if self.jit_compile:
            module = compiled(module)
        if self.policy.compute_dtype is None:
            return call_module(module, x)
        with self.policy.autocast(self.device_type):
            outputs = call_module(module, x)
        return map_structure(_to_float32, outputs)

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        scaler = self.loss_scaler
        if scaler is None:
            with record.span("backward"):
                loss.backward()
            optimizer.step()   # in scope: the same update on every replica
            return
        with record.span("backward"):
            scaler.scale(loss).backward()
        scaler.step(optimizer)   # skipped on every replica when any gradient is inf or NaN
        scaler.update()


_FULL = StepPrecision(Policy("float32"))
_AUTO = OutputChoice()
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()
_COMPILING = threading.Lock()


def check_jit_compile(jit_compile: Any, run_eagerly: bool, steps: "ModelSteps", strategy: Any) -> bool:
    """``compile(jit_compile=..., run_eagerly=...)`` as one flag: whether to ``torch.compile``."""
    if jit_compile not in (None, True, False, "auto"):
        raise InvalidArgumentError(f"jit_compile must be True, False, None or 'auto', got {jit_compile!r}")
    if jit_compile is True and not run_eagerly and not steps.supports_jit_compile:
        raise InvalidArgumentError(f"compile(jit_compile=True) is not supported under {strategy!r}; "
                                   f"compile with jit_compile=False")
    return jit_compile is True and not run_eagerly


def compiled(module: torch.nn.Module) -> Callable:
    """``torch.compile(module)``, made once per module in this process (a parameter-server
    worker compiles its own on its first step); replica threads share it."""
    with _COMPILING:
        found = _COMPILED.get(module)
        if found is None:
            # stratagem's placement hooks are global module hooks, written to run twice harmlessly
            # (once for the OptimizedModule, once for the module): torch's warning about it is noise
            warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
                                    category=UserWarning)
            found = _COMPILED[module] = torch.compile(module)
        return found


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def per_example_losses(loss_fn: Callable, y: Any, y_pred: torch.Tensor,
                       sample_weight: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss of every example (a scalar loss counts for each example of the slice), and
    the weights shaped like it."""
    if y is None:
        raise InvalidArgumentError("training and evaluation need targets: batches of (x, y) or "
                                   "(x, y, sample_weight), or fit(x, y)")
    values = loss_fn(y, y_pred)
    if not isinstance(values, torch.Tensor):
        raise InvalidArgumentError(f"the loss function returned a {type(values).__name__}; it must return a "
                                   f"tensor of per-example losses")
    rows = y_pred.shape[0] if y_pred.dim() else 1
    if values.dim() == 0:   # a mean over this slice: the same value for each of its examples
        if sample_weight is not None:
            raise InvalidArgumentError(
                "the loss function returned one number for the batch, so sample_weight cannot weight its "
                "examples; return per-example losses (reduction='none') to use sample weights")
        values = values.reshape(1).expand(rows)
    if sample_weight is not None:
        sample_weight = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
        if sample_weight.numel() != values.shape[0]:
            raise InvalidArgumentError(
                f"sample_weight has {sample_weight.numel()} values for {values.shape[0]} examples; give one "
                f"weight per example")
        sample_weight = sample_weight.reshape(values.shape)
    return values, sample_weight


def update_metrics(loss_tracker: Any, metrics: Sequence[Any], y: Any, y_pred: torch.Tensor,
                    losses: torch.Tensor, sample_weight: torch.Tensor | None) -> None:
    with torch.no_grad():
        weighted = losses.detach() if sample_weight is None else losses.detach() * sample_weight
        loss_tracker.update_state(weighted)
        for metric in metrics:
            metric.update_state(y, y_pred.detach(), sample_weight=sample_weight)


def make_train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                    loss_tracker: Any, metrics: Sequence[Any], precision: StepPrecision = _FULL, *,
                    output: OutputChoice = _AUTO) -> Callable[[Any], tuple[torch.Tensor, int]]:
    """``step(batch) -> (loss, rows)``: forward, backward, optimizer step, metrics (on ``output``'s tensor)."""
    def train_step(batch: Any) -> tuple[torch.Tensor, int]:
        if not module.training:   # Keras's training=True (dropout, batch statistics)
            module.train()
        parts = unpack(batch)
        with record.span("forward"):   # (the loss with it)
            y_pred = output.for_loss(precision.forward(module, parts.x))
            losses, weights = per_example_losses(loss_fn, parts.y, y_pred, parts.sample_weight)
            loss = compute_average_loss(losses, sample_weight=weights)
        optimizer.zero_grad()
        precision.backward_and_step(loss, optimizer)
        with record.span("metrics"):
            update_metrics(loss_tracker, metrics, parts.y, y_pred, losses, weights)
        return loss.detach(), int(y_pred.shape[0])
    return train_step


def make_test_step(module: torch.nn.Module, loss_fn: Callable, loss_tracker: Any,
                   metrics: Sequence[Any], precision: StepPrecision = _FULL, *,
                   output: OutputChoice = _AUTO) -> Callable[[Any], None]:
    """``step(batch)``: forward and metrics, no gradients."""
    def test_step(batch: Any) -> None:
        if module.training:   # Keras's training=False (Model restores the mode afterwards)
            module.eval()
        parts = unpack(batch)
        with torch.no_grad():
            y_pred = output.for_loss(precision.forward(module, parts.x))
            losses, weights = per_example_losses(loss_fn, parts.y, y_pred, parts.sample_weight)
        update_metrics(loss_tracker, metrics, parts.y, y_pred, losses, weights)
    return test_step


def make_predict_step(module: torch.nn.Module, precision: StepPrecision = _FULL, *,
                      output: OutputChoice = _AUTO) -> Callable[[Any], Any]:
    """``step(batch) -> outputs``: the module's outputs for the batch's inputs (``output``'s part)."""
    def predict_step(batch: Any) -> Any:
        if module.training:
            module.eval()
        with torch.no_grad():
            return output.for_predict(precision.forward(module, unpack(batch).x))
    return predict_step


class ModelSteps:
    """The steps ``Model`` runs on a replica, as ``steps_for(strategy)`` gives them: these
    (the module's forward, then ``loss.backward()``) unless the strategy's step is shaped
    otherwise (:class:`~stratagem.keras.pipeline_steps.PipelineSteps`)."""

    #: whether these steps run a mixed-precision policy (``compile(..., mixed_precision=...)``)
    supports_mixed_precision = True
    #: whether they run the forward through torch.compile (``compile(..., jit_compile=True)``)
    supports_jit_compile = True

    def train(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
              loss_tracker: Any, metrics: Sequence[Any], precision: StepPrecision = _FULL, *,
              output: OutputChoice = _AUTO) -> Callable[[Any], tuple[torch.Tensor, int]]:
        return make_train_step(module, optimizer, loss_fn, loss_tracker, metrics, precision, output=output)

    def test(self, module: torch.nn.Module, loss_fn: Callable, loss_tracker: Any, metrics: Sequence[Any],
             precision: StepPrecision = _FULL, *, output: OutputChoice = _AUTO) -> Callable[[Any], None]:
        return make_test_step(module, loss_fn, loss_tracker, metrics, precision, output=output)

    def predict(self, module: torch.nn.Module, precision: StepPrecision = _FULL, *,
                output: OutputChoice = _AUTO) -> Callable[[Any], Any]:
        return make_predict_step(module, precision, output=output)
