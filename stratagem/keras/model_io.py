"""Keras's saving and inspection API of ``sg.Model``: ``save``, ``save_weights`` /
``load_weights``, ``summary``, the variables, ``get_weights`` / ``set_weights``.

Whatever the strategy, these see the module as one logical model: its ``state_dict()`` (a
mirrored placement's replica 0, a parameter server's pulled values), and they change it
through ``load_state_dict``, which every placement spreads to its copies (every replica,
every parameter server). Files are written by the chief alone, atomically
(:mod:`stratagem.keras.shared_file`); the file format is :mod:`stratagem.keras.model_file`;
``sg.models.load_model`` (:mod:`stratagem.models`) reads a file of ``save``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from stratagem.errors import CheckpointError, ContextError, InvalidArgumentError
from stratagem.keras import architecture, model_file
from stratagem.checkpoint.storage import MANIFEST
from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.keras.shared_file import agree, in_replica_context, read_everywhere, write_everywhere
from stratagem.keras.summary import summary_lines

__all__ = ["ModelIO"]

_NUMPY_LACKS = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32)


class ModelIO:
    """The saving and inspection half of :class:`~stratagem.keras.model.Model` (a mixin)."""

    module: nn.Module
    strategy: Any
    optimizer: torch.optim.Optimizer | None

    # ----------------------------------------------------------------- files

    def save(self, filepath: "str | os.PathLike", overwrite: bool = True, include_optimizer: bool = True,
             **keras_options: Any) -> None:
        """Save the model to one file: architecture, weights, optimizer state and compile state.

        ``sg.models.load_model(filepath)`` rebuilds it under the strategy active there (any
        strategy, any replica count); ``torch.load(filepath, weights_only=True)["state_dict"]``
        is the module's state_dict, for plain PyTorch. Every worker calls it; the chief writes
        (a worker given another path writes its copy there). ``overwrite=False`` refuses an
        existing file; ``include_optimizer=False`` leaves out the optimizer's state (its class
        and hyperparameters are kept). Classes are stored by name: the module's class must be
        importable where the file is loaded.

        Example::

            import tempfile, torch, stratagem as sg
            strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
            with strategy.scope():
                model = sg.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
                model.compile(optimizer="adam", loss="mse")
            path = tempfile.mkdtemp() + "/model.pt"
            model.save(path)
            restored = sg.models.load_model(path)          # here: the default strategy
            x = torch.randn(3, 4)
            assert torch.allclose(restored.predict(x), model.predict(x))   # (rounding: 2 replicas, 1 here)
            plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
        """
        _refuse("save", keras_options)
        self._outside_run("save")
        module = architecture.logical_module(self.module)
        write_everywhere(self.strategy, filepath,
                         lambda: model_file.model_payload(self, module, include_optimizer=bool(include_optimizer)),
                         overwrite=overwrite, what="model.save")

    def save_weights(self, filepath: "str | os.PathLike", overwrite: bool = True, **keras_options: Any) -> None:
        """Save the module's weights: its state_dict, one logical copy, as ``torch.save`` writes it
        (``plain_module.load_state_dict(torch.load(filepath, weights_only=True))``). Every worker
        calls it; the chief writes.

        Example::

            import tempfile, torch, stratagem as sg
            model = sg.Model(torch.nn.Linear(4, 2))
            path = tempfile.mkdtemp() + "/model.weights.pt"
            model.save_weights(path)
            other = sg.Model(torch.nn.Linear(4, 2))
            other.load_weights(path)
            assert torch.equal(other.module.weight, model.module.weight)
        """
        _refuse("save_weights", keras_options)
        self._outside_run("save_weights")
        module = architecture.logical_module(self.module)
        write_everywhere(self.strategy, filepath, lambda: model_file.weights_payload(module), overwrite=overwrite,
                         what="model.save_weights")

    def load_weights(self, filepath: "str | os.PathLike", **keras_options: Any) -> None:
        """Load weights saved by ``save_weights`` or ``save`` (or a ``torch.save``-d state_dict), or
        the ``model`` entry of a checkpoint directory (``ModelCheckpoint``'s, ``sg.Checkpoint``'s,
        ``sg.latest_checkpoint(dir)``) into every replica and worker. Names and shapes are checked first (on every worker);
        nothing changes unless all match."""
        _refuse("load_weights", keras_options)
        self._outside_run("load_weights")
        path = str(filepath)
        is_checkpoint = (Path(path) / MANIFEST).is_file()   # ModelCheckpoint's / sg.Checkpoint's directory
        workers = self.strategy.checkpoint_collective
        if workers.num_workers > 1:   # the chief's view: every worker takes the same path below
            is_checkpoint = workers.broadcast_object(is_checkpoint)
        if is_checkpoint:   # Keras's load_weights(tf.train.latest_checkpoint(dir)): its "model" entry
            Checkpoint(model=self.module).restore(path)
            return
        module = architecture.logical_module(self.module)
        data = read_everywhere(self.strategy, filepath, "model.load_weights")
        state, error = None, None
        try:
            state = model_file.weights_of(model_file.parse(data, path), path)
            _check_matches(module, state, path)
        except (CheckpointError, InvalidArgumentError) as err:
            error = err
        agree(self.strategy, error, "model.load_weights")
        module.load_state_dict(state)

    def _outside_run(self, method: str) -> None:
        if in_replica_context():
            raise ContextError(f"model.{method} was called inside strategy.run; call it between steps, outside run")

    # ------------------------------------------------------------- variables

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        """``(state_dict key, tensor)`` of every tensor the module saves, each once, in state_dict order."""
        seen: set[int] = set()
        entries = []
        for key, tensor in architecture.logical_module(self.module).state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                entries.append((key, tensor))
        return entries

    @property
    def weights(self) -> list[torch.Tensor]:
        """Every tensor the module saves (parameters and persistent buffers), each once, in
        state_dict order: the logical ones (under a mirrored strategy, replica 0's)."""
        return [tensor for _, tensor in self._entries()]

    variables = weights

    @property
    def trainable_variables(self) -> list[torch.Tensor]:
        """The parameters that require gradients (Keras's ``trainable_variables``)."""
        return [t for t in self.weights if isinstance(t, nn.Parameter) and t.requires_grad]

    trainable_weights = trainable_variables

    @property
    def non_trainable_variables(self) -> list[torch.Tensor]:
        """The parameters that do not require gradients, and the persistent buffers (BatchNorm's
        running statistics: Keras's non-trainable weights)."""
        return [t for t in self.weights if not (isinstance(t, nn.Parameter) and t.requires_grad)]

    non_trainable_weights = non_trainable_variables

    def get_weights(self) -> list[np.ndarray]:
        """The values of :attr:`weights` as numpy arrays (copies; dtypes numpy lacks, such as
        bfloat16, as float32).

        Example::

            import torch, stratagem as sg
            model = sg.Model(torch.nn.Linear(3, 2))
            weight, bias = model.get_weights()
            model.set_weights([weight * 0, bias])
            assert float(model.module.weight.detach().abs().sum()) == 0.0
        """
        state = architecture.logical_module(self.module).state_dict()
        arrays = []
        for key, _ in self._entries():
            value = state[key].detach().cpu()
            arrays.append((value.float() if value.dtype in _NUMPY_LACKS else value).numpy().copy())
        return arrays

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set :attr:`weights` from arrays (numpy or tensors) in the order of ``get_weights``; the
        shapes are checked first, the values cast to each weight's dtype, and every replica
        (and parameter server) takes them."""
        self._outside_run("set_weights")
        entries = self._entries()
        if isinstance(weights, (str, bytes, dict)) or not isinstance(weights, Sequence):
            raise InvalidArgumentError(f"set_weights takes a list of arrays (as get_weights returns), got "
                                       f"{type(weights).__name__}")
        if len(weights) != len(entries):
            raise InvalidArgumentError(
                f"set_weights got {len(weights)} arrays, and the model has {len(entries)} weights "
                f"({', '.join(key for key, _ in entries)}); pass one array per weight, in the order of get_weights")
        values: dict[int, torch.Tensor] = {}
        for index, ((key, tensor), value) in enumerate(zip(entries, weights)):
            value = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
            if tuple(value.shape) != tuple(tensor.shape):
                raise InvalidArgumentError(
                    f"set_weights: weight {index} ({key}) has shape {tuple(tensor.shape)}, and the array given for "
                    f"it has shape {tuple(value.shape)}")
            values[id(tensor)] = value.to(dtype=tensor.dtype)
        module = architecture.logical_module(self.module)
        state = {key: values[id(tensor)] for key, tensor in module.state_dict(keep_vars=True).items()}
        module.load_state_dict(state)

    # --------------------------------------------------------------- summary

    def build(self, input_shape: Sequence[int | None], dtype: torch.dtype | None = None) -> None:
        """Note the input shape (Keras's ``build``; the module is built already) so that
        :meth:`summary` shows each layer's output shape. ``None`` marks the batch dimension;
        ``dtype`` is the input's (default: that of the first floating parameter)."""
        shape = tuple(input_shape)
        if not shape or not all(d is None or (isinstance(d, int) and d > 0) for d in shape):
            raise InvalidArgumentError(f"build(input_shape) takes a shape such as (None, 784), got {input_shape!r}")
        self._input_spec = (shape, dtype)

    def summary(self, line_length: int | None = None, positions: Sequence[float] | None = None,
                print_fn: Callable[[str], Any] | None = None, expand_nested: bool = False,
                show_trainable: bool = False, layer_range: Sequence[str] | None = None) -> None:
        """Print a table of the module's layers (its children), as Keras does: name (type),
        output shape ("?" unless :meth:`build` gave the input shape), parameter count; then the
        totals (trainable and non-trainable: frozen parameters and persistent buffers).
        ``print_fn`` receives each line (default ``print``); ``expand_nested`` lists children's
        children; ``layer_range`` = ``[first, last]`` names limits the rows.

        Example::

            import torch, stratagem as sg
            model = sg.Model(torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
            model.build((None, 784))
            model.summary()
        """
        module = architecture.logical_module(self.module)
        for line in summary_lines(module, getattr(self, "_input_spec", None), line_length=line_length,
                                  positions=positions, expand_nested=expand_nested, show_trainable=show_trainable,
                                  layer_range=layer_range):
            (print_fn or print)(line)


def _refuse(method: str, options: dict[str, Any]) -> None:
    """Keras options with no meaning here (``save_format``, ``skip_mismatch``, ...): an error, never ignored."""
    if options:
        raise InvalidArgumentError(
            f"model.{method} got {', '.join(sorted(options))}, which stratagem does not take: it writes and reads "
            f"one file that torch.load reads (no save formats or options), and loads weights only when every "
            f"name and shape matches; remove {', '.join(f'{name}=' for name in sorted(options))}")


def _check_matches(module: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """Raise, naming the keys, when ``state`` does not fit ``module``'s state_dict."""
    current = module.state_dict(keep_vars=True)
    missing = [k for k in current if k not in state]
    unexpected = [k for k in state if k not in current]
    shapes = [f"{k}: {tuple(state[k].shape)} in the file, {tuple(current[k].shape)} here"
              for k in current if k in state and tuple(state[k].shape) != tuple(current[k].shape)]
    problems = [f"{label} {', '.join(items[:6])}{' ...' if len(items) > 6 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("shapes differ:", shapes))
                if items]
    if problems:
        raise CheckpointError(f"model.load_weights({path}): the weights do not fit this model ({'; '.join(problems)})")
