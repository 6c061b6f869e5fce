"""``sg.Model``: Keras's ``compile`` / ``fit`` / ``evaluate`` / ``predict`` over any strategy.

Create the module in a strategy's scope (or pass ``strategy=``), wrap it in a ``Model``,
``compile`` it, and ``fit``: the loop below is the custom training loop of the README --
``experimental_distribute_dataset`` cuts every global batch over the replicas,
``strategy.run`` runs the step (:mod:`stratagem.keras.steps`, or the strategy's own from
``steps_for(strategy)``: a pipeline's schedule) on each, and the metrics
are read as global values at the end of every step and epoch. Under a parameter-server
strategy the steps are scheduled through its ``ClusterCoordinator`` instead
(:mod:`stratagem.ps.fit_loop`).

The loop's order per epoch: reset the metrics, ``on_epoch_begin``, then per step
``on_train_batch_begin``, the step, ``on_train_batch_end(logs)`` and a check of
``model.stop_training``; then validation (``val_*`` logs), the progress line,
``on_epoch_end(logs)`` and the check again.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from stratagem import metrics as metrics_module
from stratagem.callbacks import BackupAndRestore
from stratagem.errors import InvalidArgumentError, StratagemError
from stratagem.mixed_precision import Policy, as_policy, global_policy
from stratagem.placement.scope.learning_rate import with_learning_rate
from stratagem.keras import losses as losses_module, optimizers
from stratagem.keras.callback_list import CallbackList, History
from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.keras.epochs import EpochBatches, ReplicatedEpochs, concat, global_rows, length, step_logs
from stratagem.keras.inputs import as_batches, is_array_input, split_validation
from stratagem.keras.model_io import ModelIO
from stratagem.keras.model_scope import check_used_in_scope, model_strategy
from stratagem.keras.progress import ProgressLogger
from stratagem.keras.step_kinds import steps_for
from stratagem.keras.steps import StepPrecision, check_jit_compile
from stratagem.keras.structured import OutputChoice
from stratagem.values import map_structure, select_replica

__all__ = ["Model", "NotCompiledError"]

class NotCompiledError(StratagemError, RuntimeError):
    """``fit`` or ``evaluate`` was called before ``compile``."""


class Model(ModelIO):
    """A module with Keras's training API, distributed by a strategy.

    ``strategy`` defaults to the strategy whose scope is active when the ``Model`` is
    created (the default strategy outside every scope); the module must have been created
    in that strategy's scope, and ``compile``, ``fit``, ``evaluate`` and ``predict`` are
    called in it or outside every scope (else :class:`~stratagem.errors.ContextError`:
    :mod:`stratagem.keras.model_scope`). Callbacks may read and set ``model.stop_training`` and read
    ``optimizer``, ``module``, ``strategy``, ``history``, ``loss``, ``metrics``,
    ``dtype_policy`` and ``loss_scaler``. ``output``: which part of what the module returns the
    loss, the metrics and ``predict`` read -- a key of a dict or Hugging Face ``ModelOutput``,
    an index of a tuple, or None: a tensor as is, else ``"logits"``, else the first element
    (:mod:`stratagem.keras.structured`). A dict ``x`` is passed to the module as keyword
    arguments, a tuple as positional ones. Saving and inspecting (``save``, ``save_weights``,
    ``load_weights``, ``summary``, ``weights``, ``get_weights``, ...): :class:`ModelIO`.

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = sg.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
            model.compile(optimizer="adam", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        x, y = torch.randn(100, 4), torch.randint(0, 3, (100,))
        history = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.2, verbose=0)
        print(history.history["loss"], model.evaluate(x, y, verbose=0, return_dict=True))
        print(model.predict(x).shape)   # torch.Size([100, 3])
    """

    def __init__(self, module: nn.Module, *, strategy: Any = None, output: str | int | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise InvalidArgumentError(f"sg.Model wraps a torch.nn.Module, got {type(module).__name__}")
        self.module, self._output = module, OutputChoice(output)
        self.strategy = model_strategy(module, strategy)
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss: Any = None
        self.compiled_metrics: list[Any] = []
        self._loss_fn: Any = None
        self._loss_tracker: Any = None
        self.dtype_policy = Policy("float32")
        self.loss_scaler: torch.amp.GradScaler | None = None   # "mixed_float16": created in scope
        self._precision = StepPrecision(self.dtype_policy)
        self.steps_per_execution = 1
        self.stop_training = False
        self.history: History | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def output(self) -> str | int | None:
        """The ``output=`` the model was built with: what the loss, metrics and ``predict`` read."""
        return self._output.key

    @property
    def metrics(self) -> list[Any]:
        """The loss tracker (a ``Mean`` named ``"loss"``) followed by the compiled metrics."""
        return ([] if self._loss_tracker is None else [self._loss_tracker]) + list(self.compiled_metrics)

    # ----------------------------------------------------------------- compile

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, metrics: Sequence[Any] | None = None, *,
                mixed_precision: Any = None, steps_per_execution: int = 1, jit_compile: Any = None,
                run_eagerly: bool = False) -> None:
        """Set the optimizer, the loss and the metrics; created in the strategy's scope.

        ``optimizer``: a torch optimizer over the module's parameters (created in scope),
        or ``"sgd"``, ``"adam"``, ``"adamw"``, ``"rmsprop"`` (Keras's learning rates).
        ``loss``: see :mod:`stratagem.keras.losses` (names, ``sg.losses`` objects,
        ``torch.nn`` losses, callables). ``metrics``: names (``"accuracy"``, ``"mae"``, ...)
        or ``sg.metrics`` objects. ``mixed_precision``: Keras's policy, ``"mixed_bfloat16"``,
        ``"mixed_float16"`` (with loss scaling) or ``"float32"``; by default
        ``sg.mixed_precision.global_policy()`` (:mod:`stratagem.mixed_precision`).
        ``steps_per_execution``: steps per call of the batch callbacks (and, under a
        parameter-server strategy, per scheduled function: fewer round trips), as Keras.
        ``jit_compile=True``: the forward runs through ``torch.compile`` (``None``/``"auto"``:
        eager). ``run_eagerly`` is accepted for Keras code; steps always run eagerly otherwise.
        """
        check_used_in_scope(self.strategy, "compile")
        if loss is None:
            raise InvalidArgumentError("compile needs a loss: a name like 'mse', an sg.losses object, a "
                                       "torch.nn loss, or a function fn(y_true, y_pred)")
        if metrics is not None and (isinstance(metrics, (str, dict)) or not isinstance(metrics, Iterable)):
            raise InvalidArgumentError(f"metrics must be a list, e.g. metrics=['accuracy'], got {metrics!r}")
        loss_fn = losses_module.get(loss)
        policy = global_policy() if mixed_precision is None else as_policy(mixed_precision)
        if policy.compute_dtype is not None and not steps_for(self.strategy).supports_mixed_precision:
            raise InvalidArgumentError(f"compile(mixed_precision={policy.name!r}) is not supported under "
                                       f"{self.strategy!r}; compile with mixed_precision='float32'")
        _check_count("steps_per_execution", steps_per_execution, minimum=1)
        jit_compile = check_jit_compile(jit_compile, run_eagerly, steps_for(self.strategy), self.strategy)
        device_type = next((p.device.type for p in self.module.parameters()), "cpu")
        with self.strategy.scope():   # nothing is kept unless everything resolves
            compiled_metrics = [metrics_module.get(m, loss=loss) for m in (metrics or [])]
            loss_tracker = metrics_module.Mean(name="loss")
            scaler = torch.amp.GradScaler(device_type) if policy.loss_scaling else None
            optimizer = optimizers.get(optimizer, self.module.parameters())
            self.optimizer = with_learning_rate(optimizer)   # Keras's learning_rate
        self.dtype_policy, self.loss_scaler = policy, scaler
        self._precision = StepPrecision(policy, device_type, scaler, jit_compile)
        self.steps_per_execution = steps_per_execution
        self.loss, self._loss_fn = loss, loss_fn
        self._loss_tracker, self.compiled_metrics = loss_tracker, compiled_metrics

    def make_train_function(self) -> Callable[[Any], tuple[torch.Tensor, int]]:
        """The function that runs one training step on a replica (or a parameter-server worker):
        ``step(batch) -> (loss, rows)`` -- forward, loss, backward, optimizer step, metrics."""
        self._require_compiled("fit")
        return steps_for(self.strategy).train(self.module, self.optimizer, self._loss_fn, self._loss_tracker,
                                              self.compiled_metrics, self._precision, output=self._output)

    def _require_compiled(self, method: str) -> None:
        if self.optimizer is None:
            raise NotCompiledError(f"model.{method}() needs a compiled model: call model.compile(optimizer=..., "
                                   f"loss=..., metrics=...) first")

    # --------------------------------------------------------------------- fit

    def fit(self, x: Any, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            steps_per_epoch: int | None = None, validation_data: Any = None, validation_split: float = 0.0,
            shuffle: bool = True, callbacks: Sequence[Any] | None = None, verbose: Any = 1,
            initial_epoch: int = 0, *, sample_weight: Any = None) -> History:
        """Train for ``epochs`` epochs; return a :class:`History` of the epoch logs.

        ``batch_size`` is the *global* batch (over every replica of every worker), for
        tensor / numpy inputs only. ``steps_per_epoch`` limits each epoch (then the input
        is read on across epochs, starting over when it ends); required under a
        parameter-server strategy. ``validation_data``: ``(x_val, y_val)``, a DataLoader or
        an iterable of batches. ``validation_split``: the last fraction of array inputs.
        """
        self._require_compiled("fit")
        check_used_in_scope(self.strategy, "fit")
        _check_count("epochs", epochs, minimum=1)
        _check_count("initial_epoch", initial_epoch, minimum=0)
        if steps_per_epoch is not None:
            _check_count("steps_per_epoch", steps_per_epoch, minimum=1)
        if validation_split:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split)
        progress = ProgressLogger(verbose, chief=self._is_chief())
        if _fit_loop_kind(self.strategy) == "scheduled":
            from stratagem.ps.fit_loop import ScheduledEpochs   # grpc: loaded for a ps fit only

            loop: Any = ScheduledEpochs(self, x, y, sample_weight, batch_size=batch_size,
                                        steps_per_epoch=steps_per_epoch, shuffle=shuffle)
        else:
            loop = ReplicatedEpochs(self, x, y, sample_weight, batch_size=batch_size,
                                     steps_per_epoch=steps_per_epoch, shuffle=shuffle)
        history = History()
        callback_list = CallbackList([*(callbacks or []), history], model=self,
                                     params={"epochs": epochs, "steps": loop.steps, "verbose": progress.verbose,
                                             "batch_size": loop.batch_size})
        initial_epoch = self._restore_backup(callback_list, loop, initial_epoch)
        loop.prepare(callback_list, progress)
        self.history, self.stop_training = history, False
        callback_list.call("on_train_begin", None)
        logs: dict = {}
        for epoch in range(initial_epoch, epochs):
            self.reset_metrics()
            callback_list.call("on_epoch_begin", epoch, None)
            progress.begin(loop.steps, f"Epoch {epoch + 1}/{epochs}")
            loop.run_epoch(callback_list, progress)
            logs = self.get_metrics_result()
            if validation_data is not None:
                logs.update(self._validate(validation_data, batch_size, callback_list))
            progress.end(logs)
            callback_list.call("on_epoch_end", epoch, logs)
            if self.stop_training:
                break
        callback_list.call("on_train_end", logs)
        loop.end(progress)
        return history

    def checkpoint_parts(self) -> dict[str, Any]:
        """What ``sg.Checkpoint(model=model)`` saves of it: ``module``, and once compiled
        ``optimizer`` (and ``loss_scaler`` under ``"mixed_float16"``)."""
        parts: dict[str, Any] = {"module": self.module}
        if self.optimizer is not None:
            parts["optimizer"] = self.optimizer
        if self.loss_scaler is not None:
            parts["loss_scaler"] = self.loss_scaler
        return parts

    def _restore_backup(self, callback_list: CallbackList, loop: Any, initial_epoch: int) -> int:
        """A ``BackupAndRestore`` among the callbacks: restore model, optimizer and input position
        (an epoch backed up inside resumes at its step: the loop takes the rest of its steps)."""
        for callback in callback_list.callbacks:
            if isinstance(callback, BackupAndRestore):
                parts = self.checkpoint_parts()
                state = {"model": parts.pop("module"), **parts}
                state.update({"data": loop.dataset} if loop.dataset is not None else {})
                epoch, step = callback.restore(Checkpoint(**state))
                if epoch >= initial_epoch and loop.dataset is not None:
                    loop.resume_in_epoch(step)
                initial_epoch = max(initial_epoch, epoch)
        return initial_epoch

    def _validate(self, validation_data: Any, batch_size: int | None, callback_list: CallbackList) -> dict:
        """The ``val_*`` logs; the callbacks' ``on_test_*`` hooks are called, as Keras does."""
        if isinstance(validation_data, tuple) and len(validation_data) in (2, 3) and \
                is_array_input(validation_data[0]):
            data = as_batches(*validation_data, batch_size=batch_size, shuffle=False, method="fit")
        else:
            data = as_batches(validation_data, batch_size=None, shuffle=False, method="fit")
        logs = self._evaluate_batches(data, steps=None, callback_list=callback_list, progress=ProgressLogger(0))
        return {f"val_{name}": value for name, value in logs.items()}

    # ------------------------------------------------------------ evaluate

    def evaluate(self, x: Any, y: Any = None, batch_size: int | None = None, steps: int | None = None,
                 callbacks: Sequence[Any] | None = None, verbose: Any = 1, return_dict: bool = False, *,
                 sample_weight: Any = None) -> Any:
        """The loss and metrics over ``x`` (global values): a list ``[loss, *metrics]`` (the
        loss alone when there are no metrics), or a dict with ``return_dict=True``.

        Under a parameter-server strategy the coordinator evaluates, reading the model as
        one plain model.
        """
        self._require_compiled("evaluate")
        check_used_in_scope(self.strategy, "evaluate")
        if steps is not None:
            _check_count("steps", steps, minimum=1)
        data = as_batches(x, y, sample_weight, batch_size=batch_size, shuffle=False, method="evaluate")
        callback_list = CallbackList(callbacks or [], model=self,
                                     params={"epochs": 1, "steps": steps or length(data), "verbose": verbose})
        logs = self._evaluate_batches(data, steps, callback_list, ProgressLogger(verbose, chief=self._is_chief()))
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _evaluate_batches(self, data: Iterable, steps: int | None, callback_list: CallbackList | None,
                          progress: ProgressLogger) -> dict:
        strategy = self.strategy
        call = callback_list.call if callback_list is not None else (lambda *args: None)
        step_fn = steps_for(strategy).test(self.module, self._loss_fn, self._loss_tracker, self.compiled_metrics,
                                           self._precision, output=self._output)
        self.reset_metrics()
        batch_logs = step_logs(self, callback_list, progress, "on_test_batch_end", steps or length(data))
        call("on_test_begin", None)
        progress.begin(steps or length(data), "evaluate")
        logs: dict = {}
        training = self.module.training   # the steps run in eval mode; the mode is put back after
        try:
            for step, batch in enumerate(EpochBatches(strategy.experimental_distribute_dataset(data), steps).epoch()):
                call("on_test_batch_begin", step, None)
                strategy.run(step_fn, args=(batch,))
                logs = batch_logs(step)
                call("on_test_batch_end", step, logs)
                progress.step(global_rows(batch), logs)
        finally:
            self.module.train(training)
        logs = self.get_metrics_result()
        progress.end(logs)
        call("on_test_end", logs)
        return logs

    # ------------------------------------------------------------- predict

    def predict(self, x: Any, batch_size: int | None = None, steps: int | None = None,
                callbacks: Sequence[Any] | None = None, verbose: Any = 0) -> Any:
        """The module's outputs for every example of ``x``, in input order (on every worker), as
        CPU tensors: the output named by ``sg.Model(module, output=...)``, or without it the whole
        output (a tuple, dict or ``ModelOutput`` of them for a module that returns one).

        Each replica computes its slice; the slices are put back in order, across workers
        too, with no padding rows. Batches of ``(x, y)`` have their ``y`` ignored.
        """
        check_used_in_scope(self.strategy, "predict")
        if steps is not None:
            _check_count("steps", steps, minimum=1)
        data = as_batches(x, batch_size=batch_size, shuffle=False, method="predict")
        strategy = self.strategy
        callback_list = CallbackList(callbacks or [], model=self,
                                     params={"epochs": 1, "steps": steps or length(data), "verbose": verbose})
        progress = ProgressLogger(verbose, chief=self._is_chief())
        step_fn = steps_for(strategy).predict(self.module, self._precision, output=self._output)
        num_local = strategy.topology.num_local_replicas
        outputs: list[Any] = []
        callback_list.call("on_predict_begin", None)
        progress.begin(steps or length(data), "predict")
        training = self.module.training   # the steps run in eval mode; the mode is put back after
        try:
            for step, batch in enumerate(EpochBatches(strategy.experimental_distribute_dataset(data), steps).epoch()):
                callback_list.call("on_predict_batch_begin", step, None)
                result = strategy.run(step_fn, args=(batch,))
                local = [select_replica(i, result) for i in range(num_local)] if num_local > 1 else [result]
                outputs.append(concat([map_structure(lambda t: t.cpu(), part) for part in local]))
                callback_list.call("on_predict_batch_end", step, {"outputs": outputs[-1]})
                progress.step(global_rows(batch), None)
        finally:
            self.module.train(training)
        progress.end(None)
        callback_list.call("on_predict_end", None)
        if strategy.topology.num_workers > 1:   # every worker's slices of each step, in worker order
            everyone = strategy.collective.all_gather_object(outputs, "Model.predict")
            outputs = [part for step_parts in zip(*everyone) for part in step_parts]
        if not outputs:
            raise InvalidArgumentError("predict got no batches: the input is empty")
        return concat(outputs)

    # ------------------------------------------------------------- metrics

    def reset_metrics(self) -> None:
        """Reset the loss tracker and every compiled metric."""
        for metric in self.metrics:
            metric.reset_state()

    def get_metrics_result(self) -> dict:
        """Every metric's global value, by name: ``{"loss": ..., "accuracy": ...}`` (Keras's name).

        Across workers this is a collective: every worker calls it at the same point."""
        logs = {}
        for metric in self.metrics:
            value = metric.result()
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 else value.tolist()
            logs[metric.name] = value
        return logs

    def _is_chief(self) -> bool:
        return bool(getattr(self.strategy, "is_chief", True))

    def __repr__(self) -> str:
        return f"Model({type(self.module).__name__}, strategy={self.strategy!r})"


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _fit_loop_kind(strategy: Any) -> str:
    kind = getattr(strategy, "model_fit_loop_kind", "replicated")   # (Strategy.model_fit_loop_kind)
    if kind not in ("replicated", "scheduled"):
        raise InvalidArgumentError(f"{type(strategy).__name__}.model_fit_loop_kind is {kind!r}; sg.Model knows "
                                   f"'replicated' and 'scheduled'")
    return kind
