"""``sg.models``: Keras's ``load_model`` and ``save_model`` for :class:`sg.Model <stratagem.Model>`.

``load_model`` rebuilds a model that ``model.save`` wrote -- its module, weights, optimizer
(class, hyperparameters, state) and compile state (loss, metrics, mixed-precision policy) --
under the strategy active where it is called, as Keras does: call it inside
``with strategy.scope():`` to distribute the model with that strategy, whatever strategy
saved it. Under a multi-worker strategy every worker calls it.

Example::

    import tempfile, torch, stratagem as sg
    model = sg.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    model.compile(optimizer="adam", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    path = tempfile.mkdtemp() + "/model.pt"
    sg.models.save_model(model, path)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        restored = sg.models.load_model(path)
    print(restored.strategy.num_replicas_in_sync, restored.optimizer.learning_rate)   # 2 0.001
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from stratagem import _context
from stratagem.errors import CheckpointError, ContextError
from stratagem.keras import architecture
from stratagem.keras.model import Model
from stratagem.keras.model_file import check_model_file, parse, resolve_compile
from stratagem.keras.shared_file import agree, in_replica_context, read_everywhere

__all__ = ["load_model", "save_model"]


def save_model(model: Model, filepath: "str | os.PathLike", overwrite: bool = True,
               include_optimizer: bool = True) -> None:
    """``model.save(filepath, overwrite, include_optimizer)`` (Keras's function form)."""
    model.save(filepath, overwrite=overwrite, include_optimizer=include_optimizer)


def load_model(filepath: "str | os.PathLike", custom_objects: dict[str, Any] | None = None, compile: bool = True,
               safe_mode: bool = True) -> Model:
    """The :class:`~stratagem.Model` saved in ``filepath`` by ``model.save``, under the active strategy.

    ``compile=False``: the module and its weights only (no optimizer, loss or metrics).
    ``custom_objects``: ``{name: object}`` for classes and functions the file names (a
    module class defined in the training script, a loss function), by name or qualified
    name; a metric or loss that could not be stored by name is given by its name (``"loss"``
    for the loss). ``safe_mode=True`` (the default) refuses a file that names anything but
    module, optimizer, loss and metric classes, ``torch.nn.functional`` functions and
    ``custom_objects`` (loading a file is then never a way to run its code); pass
    ``safe_mode=False`` only for a file you trust.
    """
    if in_replica_context():
        raise ContextError("sg.models.load_model was called inside strategy.run; call it outside run")
    strategy = _context.get_strategy()
    path = os.fspath(filepath)
    data = read_everywhere(strategy, filepath, "load_model")
    error = module = content = compiled = None
    try:   # everything that reads the file, before anything is created: the workers agree first
        content = check_model_file(parse(data, path), path)
        module = architecture.load(content["architecture"], content["state_dict"], content["tensors"],
                                   safe_mode=safe_mode, custom_objects=custom_objects, path=path)
        if not isinstance(module, nn.Module):
            raise CheckpointError(f"{path} is damaged: its architecture is a {type(module).__name__}, not a module")
        if compile and content["compile"] is not None:
            compiled = resolve_compile(content["compile"], content, path, safe_mode=safe_mode,
                                       custom_objects=custom_objects)
    except Exception as err:   # raised on every worker, after they compared
        error = err
    agree(strategy, error, "load_model")
    return _build(strategy, module, compiled, path, content.get("output"))


def _build(strategy: Any, module: nn.Module, compiled: dict | None, path: str, output: Any = None) -> Model:
    """Create the model in ``strategy``'s scope (placed as if constructed there), then compile
    it and restore the optimizer's and the loss scaler's state."""
    with strategy.scope():
        architecture.register_in_scope(module)
        strategy.placement.finalize()
        model = Model(module, output=output)
        if compiled is None:
            return model
        spec = compiled["optimizer"]
        saved = spec["state_dict"]
        params = _parameters_by_name(module)
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in names]}
                  for group, names in zip(saved["param_groups"], spec["param_names"])]
        try:
            optimizer = spec["class"](groups, **spec["defaults"])
        except TypeError as err:
            raise CheckpointError(
                f"load_model({path}): {spec['class'].__name__} cannot be created again from its saved defaults "
                f"({', '.join(sorted(spec['defaults']))}): {err}; load_model(path, compile=False) and compile the "
                f"model again (the weights are restored)") from None
        metrics = [m[0](**m[1]) if isinstance(m, tuple) else m for m in compiled["metrics"]]
        model.compile(optimizer=optimizer, loss=compiled["loss"], metrics=metrics,
                      mixed_precision=compiled["mixed_precision"],
                      steps_per_execution=compiled.get("steps_per_execution", 1),
                      jit_compile=compiled.get("jit_compile", False))
        strategy.placement.finalize()
    optimizer.load_state_dict(saved)
    if compiled["loss_scaler"] is not None and model.loss_scaler is not None:
        model.loss_scaler.load_state_dict(compiled["loss_scaler"])
    return model


def _parameters_by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter under every name it has (the placed tensors: a mirrored strategy's replica 0's)."""
    found: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, param in dict.items(m._parameters):
            if param is not None:
                found[f"{prefix}.{name}" if prefix else name] = param
    return found
