"""Does a loaded state fit the object it is about to be loaded into? Said before anything changes.

:func:`problems_with` answers with the first problem in words (the parameter by name, both
shapes), or None. The checks are those that ``load_state_dict`` would otherwise fail on
half-way, or not at all (an optimizer's state for a parameter of another shape loads
silently and breaks the next step).
"""

from __future__ import annotations

from typing import Any

import torch


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def module_problem(module: torch.nn.Module, state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a module's state_dict"
    own = module.state_dict(keep_vars=True)   # the tensors themselves: shapes, never a gather or a copy
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing[:5]))}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {', '.join(map(repr, unexpected[:5]))}" + (" ..." if len(unexpected) > 5 else ""))
        return (f"the saved {type(module).__name__} has other entries than this one ({'; '.join(parts)}); "
                f"build the same model as the job that saved it")
    for key, value in own.items():
        saved = state[key]
        if isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor) and saved.shape != value.shape:
            return (f"{key!r} has shape {_shape(saved)} in the checkpoint but {_shape(value)} in this "
                    f"{type(module).__name__}; build the same model as the job that saved it")
    return None


def optimizer_problem(optimizer: torch.optim.Optimizer, state: Any, names: dict[int, str]) -> str | None:
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        return "does not hold an optimizer's state_dict (no 'state' and 'param_groups')"
    groups, saved_groups = optimizer.param_groups, state["param_groups"]
    if len(groups) != len(saved_groups):
        return (f"the saved optimizer has {len(saved_groups)} parameter group(s), this one has {len(groups)}; "
                f"create the optimizer with the same groups")
    params = [p for group in groups for p in group["params"]]
    saved_ids = [i for group in saved_groups for i in group["params"]]
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            return (f"parameter group {index} has {len(saved['params'])} parameters in the checkpoint but "
                    f"{len(group['params'])} here; create the optimizer over the same parameters")
    position = {saved_id: i for i, saved_id in enumerate(saved_ids)}
    for saved_id, entry in state["state"].items():
        if saved_id not in position or not isinstance(entry, dict):
            return f"its state names parameter {saved_id!r}, which no parameter group lists"
        param = params[position[saved_id]]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.shape != param.shape:
                name = names.get(id(param), f"parameter {position[saved_id]} of the optimizer")
                return (f"the optimizer's {key!r} for {name} has shape {_shape(value)} in the checkpoint but "
                        f"the parameter has shape {_shape(param)}; build the same model as the job that saved it")
    return None


def problems_with(kind: str, obj: Any, value: Any, names: dict[int, str]) -> str | None:
    """The first reason ``value`` cannot be loaded into ``obj`` (tracked as ``kind``), else None."""
    if kind == "module":
        return module_problem(obj, value)
    if kind == "optimizer":
        return optimizer_problem(obj, value, names)
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            return f"holds a {type(value).__name__}, not a tensor"
        if value.shape != obj.shape:
            return f"the tensor has shape {_shape(value)} in the checkpoint but {_shape(obj)} here"
        return None
    if kind == "dataset":
        return obj.position.problem(value)
    if kind in ("scheduler", "stateful") and not isinstance(value, dict):
        return f"holds a {type(value).__name__}, not a state_dict"
    return None
