"""What ``model.save`` writes: one ``torch.save`` file that ``torch.load(weights_only=True)`` reads.

::

    {"format": "stratagem.Model", "format_version": 1,
     "state_dict":   the module's state_dict: one logical copy, CPU tensors
                     (plain_module.load_state_dict(torch.load(path, weights_only=True)["state_dict"]))
     "architecture": bytes: the module's structure, its tensors referring to "state_dict" / "tensors"
                     (stratagem.keras.architecture; read by load_model, safe_mode=True by default)
     "tensors":      other tensors the architecture holds (non-persistent buffers, a loss's weights)
     "compile":      None (not compiled), or
                     {"loss": {"name": str} | {"pickle": bytes} | {"unrestorable": why},
                      "metrics": [{"pickle": bytes (class, kwargs)} | {"unrestorable": why, "name": str}],
                      "mixed_precision": policy name,
                      "optimizer": {"class": bytes, "defaults": dict, "param_names": [[str]],
                                    "state_dict": the optimizer's state_dict (state {} without
                                                  include_optimizer)},
                      "loss_scaler": a GradScaler's state_dict or None},
     "output":       the Model's output= (a key, an index or None; absent in older files)
     "info":         {"stratagem", "torch", "strategy", "num_replicas_in_sync", "saved_at"}}

``model.save_weights`` writes the state_dict alone (a plain ``{name: tensor}``).
"""

from __future__ import annotations

import inspect
import io
import time
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from stratagem import __version__
from stratagem.errors import CheckpointError, InvalidArgumentError
from stratagem.metrics.base import Metric
from stratagem.placement.scope.learning_rate import plain_class
from stratagem.keras import architecture
from stratagem.checkpoint.storage import check_loadable

__all__ = ["FORMAT", "model_payload", "parse", "resolve_compile", "weights_of", "weights_payload"]

FORMAT = "stratagem.Model"
VERSION = 1
#: placements that split a module between processes: no one process holds its architecture
_SPLIT = {"FullySharded": "sharding='parameters'", "TensorParallel": "TensorParallelStrategy",
          "Pipeline": "PipelineStrategy"}


def weights_payload(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """The module's state_dict, one logical copy on the CPU (every worker calls it: it may be a
    collective)."""
    return OrderedDict((key, value.detach().cpu()) for key, value in module.state_dict().items())


def model_payload(model: Any, module: nn.Module, *, include_optimizer: bool) -> dict:
    """The whole file's content (module docstring)."""
    strategy = model.strategy
    split = _SPLIT.get(getattr(strategy.placement, "kind", ""))
    if split is not None:
        raise InvalidArgumentError(
            f"model.save stores the whole module's architecture, and under {split} the module is split between "
            f"processes; save the weights with model.save_weights(path) (one logical copy; load them with "
            f"load_weights into a model built in code), or the training state with sg.Checkpoint")
    skeleton = architecture.clean_copy(module)
    state = weights_payload(module)
    keys = {i: key for i, key in architecture.state_keys(module).items() if key in state}
    tensors: list[torch.Tensor] = []
    payload = {"format": FORMAT, "format_version": VERSION, "state_dict": state,
               "architecture": architecture.dump(skeleton, keys, tensors, what="the module"), "tensors": tensors,
               "compile": None, "output": model.output,
               "info": {"stratagem": __version__, "torch": str(torch.__version__), "strategy": type(strategy).__name__,
                        "num_replicas_in_sync": strategy.num_replicas_in_sync,
                        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    if model.optimizer is not None:
        payload["compile"] = _compile_payload(model, module, keys, tensors, include_optimizer)
    return payload


def _compile_payload(model: Any, module: nn.Module, keys: dict[int, str], tensors: list,
                     include_optimizer: bool) -> dict:
    optimizer = model.optimizer
    names = _parameter_names(module)
    param_names = []
    for index, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise InvalidArgumentError(
                f"model.save stores the optimizer by the module's parameter names, and parameter group {index} of "
                f"{type(optimizer).__name__} holds {len(missing)} tensor(s) that are not the module's parameters "
                f"(shapes {missing[:4]}); save with include_optimizer=False, or the training state with "
                f"sg.Checkpoint")
        param_names.append([names[id(p)] for p in group["params"]])
    state = optimizer.state_dict()   # one logical copy (every worker: a sharded state is gathered)
    if not include_optimizer:
        state = {**state, "state": {}}
    scaler = model.loss_scaler.state_dict() if model.loss_scaler is not None and include_optimizer else None
    check_loadable(dict(optimizer.defaults), "the optimizer's defaults")
    check_loadable(state, "optimizer.state_dict()")
    check_loadable(scaler, "the loss scaler's state_dict()")
    return {"loss": _stored_loss(model.loss, keys, tensors),
            "metrics": [_metric_spec(m, keys, tensors) for m in model.compiled_metrics],
            "mixed_precision": model.dtype_policy.name,
            "steps_per_execution": model.steps_per_execution, "jit_compile": model._precision.jit_compile,
            "optimizer": {"class": architecture.dump(plain_class(optimizer), {}, [], what="the optimizer's class"),
                          "defaults": dict(optimizer.defaults), "param_names": param_names, "state_dict": state},
            "loss_scaler": scaler}


def _parameter_names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, param in dict.items(m._parameters):
            if param is not None:
                names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)
    return names


def _stored_loss(loss: Any, keys: dict[int, str], tensors: list) -> dict:
    if isinstance(loss, str):
        return {"name": loss}
    try:
        return {"pickle": architecture.dump(loss, keys, tensors, what="the loss")}
    except InvalidArgumentError as err:
        return _unrestorable(f"the loss {loss!r}", err)


def _metric_spec(metric: Metric, keys: dict[int, str], tensors: list) -> dict:
    """``(class, kwargs)`` that build the metric again: its constructor's arguments read back from
    the attributes of the same names (``fn`` from ``_fn``). A metric whose arguments are not all
    found is kept by name only, and restored only through ``custom_objects``."""
    cls = type(metric)
    kwargs = {}
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        for attribute in (param.name, f"_{param.name}"):
            if attribute in metric.__dict__:
                kwargs[param.name] = metric.__dict__[attribute]
                break
        else:
            return _unrestorable(f"metric {metric.name!r} ({cls.__name__}: its argument {param.name!r} is not kept)",
                                 None, name=metric.name)
    try:
        return {"pickle": architecture.dump((cls, kwargs), keys, tensors, what=f"metric {metric.name!r}")}
    except InvalidArgumentError as err:
        return _unrestorable(f"metric {metric.name!r}", err, name=metric.name)


def _unrestorable(what: str, err: Exception | None, **extra: Any) -> dict:
    why = f"{what} cannot be stored by name" + (f" ({err})" if err is not None else "")
    warnings.warn(f"model.save: {why}; load_model(path) will need it in custom_objects, or "
                  f"load_model(path, compile=False) and compile again", UserWarning, stacklevel=5)
    return {"unrestorable": why, **extra}


# ------------------------------------------------------------------ reading

def parse(data: bytes, path: str) -> Any:
    """The file's content, read with ``torch.load(weights_only=True)`` (never unpickling code)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{path} is not a file written by model.save or model.save_weights: "
                              f"torch.load(weights_only=True) failed: {err}") from None


def is_model_file(content: Any) -> bool:
    return isinstance(content, dict) and content.get("format") == FORMAT


def check_model_file(content: Any, path: str) -> dict:
    if not is_model_file(content):
        raise CheckpointError(f"{path} was not written by model.save (no 'format': {FORMAT!r} in it); a file of "
                              f"model.save_weights is loaded with model.load_weights into a model built in code")
    if content.get("format_version") != VERSION:
        raise CheckpointError(f"{path} has format version {content.get('format_version')!r}; this stratagem reads "
                              f"version {VERSION} (was it written by a newer one?)")
    return content


def weights_of(content: Any, path: str) -> dict[str, torch.Tensor]:
    """The state_dict in a file of ``save_weights`` (the file itself) or ``save`` (its "state_dict")."""
    if is_model_file(content):
        content = check_model_file(content, path)["state_dict"]
    if not isinstance(content, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in content.items()):
        raise CheckpointError(f"{path} holds no state_dict (a dict of names to tensors, as model.save_weights or "
                              f"torch.save(module.state_dict(), path) writes)")
    return content


def resolve_compile(stored: dict, content: dict, path: str, *, safe_mode: bool,
                    custom_objects: dict | None) -> dict:
    """The compile state as objects: ``loss``, ``metrics`` (classes with their arguments, or
    the objects ``custom_objects`` gives by metric name), the optimizer's class; raises what
    cannot be restored, naming the fix."""
    custom = dict(custom_objects or {})

    def load(data: bytes) -> Any:
        return architecture.load(data, content["state_dict"], content["tensors"], safe_mode=safe_mode,
                                 custom_objects=custom, path=path)

    def missing(why: str, key: str) -> CheckpointError:
        return CheckpointError(f"load_model({path}): {why}; pass custom_objects={{{key!r}: ...}}, or "
                               f"load_model(path, compile=False) and compile the model again")

    loss = stored["loss"]
    if "unrestorable" in loss:
        if "loss" not in custom:
            raise missing(loss["unrestorable"], "loss")
        loss = custom["loss"]
    else:
        loss = loss["name"] if "name" in loss else load(loss["pickle"])
    metrics = []
    for spec in stored["metrics"]:
        if "unrestorable" in spec:
            if spec["name"] not in custom:
                raise missing(spec["unrestorable"], spec["name"])
            metrics.append(custom[spec["name"]])
        else:
            cls, kwargs = load(spec["pickle"])
            if not (isinstance(cls, type) and issubclass(cls, Metric)) or not isinstance(kwargs, dict):
                raise CheckpointError(f"{path} is damaged: a metric entry is not a metric class and its arguments")
            metrics.append((cls, kwargs))
    optimizer = dict(stored["optimizer"])
    optimizer["class"] = load(optimizer["class"])
    if not (isinstance(optimizer["class"], type) and issubclass(optimizer["class"], torch.optim.Optimizer)):
        raise CheckpointError(f"{path} is damaged: its optimizer class is {optimizer['class']!r}")
    return {**stored, "loss": loss, "metrics": metrics, "optimizer": optimizer}
