"""Metric states as values: a *snapshot* is what one torchmetrics metric object holds, and
:func:`merge_states` combines several with the reductions torchmetrics declares.

Pure functions on torchmetrics objects; torchmetrics itself is not imported here (the
parameter-server closure code imports :mod:`stratagem.metrics.base`, which imports this).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import torchmetrics

__all__ = ["Snapshot", "merge_states", "on_cpu", "snapshot"]

#: A state's content: (how many updates, {state name: tensor or list of tensors}).
Snapshot = tuple[int, dict[str, Any]]


def merge_states(target: "torchmetrics.Metric", snapshots: list[Snapshot]) -> None:
    """Set ``target``'s states to the combination of ``snapshots`` (in order), with the
    reductions torchmetrics declares: list (cat) states are concatenated and stay lists;
    tensor states are stacked and reduced by their ``dist_reduce_fx`` (left stacked when it
    is None), as torchmetrics combines the states of several processes."""
    from torchmetrics.utilities.data import dim_zero_cat   # (loaded already: states exist)
    device = target.device
    for name, reduce_fn in target._reductions.items():
        values = [values[name] for _, values in snapshots]
        if isinstance(target._defaults[name], list) or reduce_fn is dim_zero_cat:
            merged: Any = []
            for value in values:
                merged.extend(p.to(device) for p in (value if isinstance(value, list) else [value]))
            if not isinstance(target._defaults[name], list):   # a tensor state reduced by cat
                merged = torch.cat([p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1) for p in merged])
        else:
            stacked = torch.stack([v.to(device) for v in values])
            merged = reduce_fn(stacked) if reduce_fn is not None else stacked
        setattr(target, name, merged)
    target._update_count = sum(count for count, _ in snapshots)
    target._computed = None


def snapshot(state: "torchmetrics.Metric") -> Snapshot:
    return state._update_count, state.metric_state


def on_cpu(snapshot: Snapshot) -> Snapshot:
    count, values = snapshot
    return count, {k: [t.detach().cpu() for t in v] if isinstance(v, list) else v.detach().cpu()
                   for k, v in values.items()}

