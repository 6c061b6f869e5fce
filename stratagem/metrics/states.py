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
    tensor states are stacked and reduced by their ``dist_reduce_fx``, as torchmetrics combines
    the states of several processes. With no reduction (None) they stay stacked, one row per
    part, and a state merged before contributes its rows: merging merged states (workers, or
    the steps a parameter-server coordinator accepts) gives the same rows as merging all parts
    at once."""
    from torchmetrics.utilities.data import dim_zero_cat   # (loaded already: states exist)
    device = target.device
    for name, reduce_fn in target._reductions.items():
        parts = [values[name] for _, values in snapshots]
        default = target._defaults[name]
        if isinstance(default, list) or reduce_fn is dim_zero_cat:
            merged: Any = []
            for part in parts:
                merged.extend(t.to(device) for t in (part if isinstance(part, list) else [part]))
            if not isinstance(default, list):   # a tensor state reduced by cat
                merged = torch.cat([t if t.dim() else t.reshape(1) for t in merged])
        elif reduce_fn is None:   # left stacked, one row per part; a part merged before is rows already
            merged = torch.cat([t.to(device).unsqueeze(0) if t.dim() == default.dim() else t.to(device)
                                for t in parts])
        else:
            merged = reduce_fn(torch.stack([t.to(device) for t in parts]))
        setattr(target, name, merged)
    target._update_count = sum(count for count, _ in snapshots)
    target._computed = None


def snapshot(state: "torchmetrics.Metric") -> Snapshot:
    return state._update_count, state.metric_state


def on_cpu(snapshot: Snapshot) -> Snapshot:
    count, values = snapshot
    return count, {k: [t.detach().cpu() for t in v] if isinstance(v, list) else v.detach().cpu()
                   for k, v in values.items()}

