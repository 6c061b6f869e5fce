"""The optimizer state of variables on parameter servers, seen from the coordinator.

Each shard's optimizer lives on its ps. :func:`state_dict` assembles one logical optimizer
state dict from the shards' states (tensors with the parameter's rows are joined); and
:func:`load_state_dict` cuts a logical one into the shards of the current layout and writes
them, with the values, to the ps -- whatever layout (or strategy) the state came from. These
are the :class:`~stratagem.ps.placement.ParameterServerPlacement`'s ``optimizer_state_dict``
and ``optimizer_load_state_dict``.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.placement.scope.hooks import base_of
from stratagem.ps.client import call_each
from stratagem.ps.variables import remote_of

__all__ = ["load_state_dict", "state_dict"]


def state_dict(placement: Any, optimizer: torch.optim.Optimizer) -> dict:
    """One logical optimizer state dict, assembled from the shards' states."""
    placement.finalize()
    result = base_of(optimizer).state_dict(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    states = _get_states(placement, params)
    logical: dict[int, dict] = {}
    for index, p in enumerate(params):
        pieces = [states[s.shard_id]["optimizer_state"] for s in remote_of(p).shards]
        per_shard = [(piece or {}).get("state", {}).get(0, {}) for piece in pieces]
        if not per_shard or not per_shard[0]:
            continue
        merged = {}
        for key, first in per_shard[0].items():
            if isinstance(first, torch.Tensor) and first.dim() > 0 and len(per_shard) > 1:
                merged[key] = torch.cat([s[key] for s in per_shard])
            else:
                merged[key] = first
        logical[index] = merged
    result["state"] = logical
    return result


def load_state_dict(placement: Any, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Cut a logical optimizer state dict into the shards and write them to the ps."""
    base = base_of(optimizer)
    placement.load_param_groups(optimizer, state_dict["param_groups"])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # A fresh ps (restarted, or not yet restored) lacks the variables: those keep the
    # coordinator's values, which go to the ps below. Asked, not guessed from a failed
    # pull: any other failure (a ps down, a wrong token, a broken pull) raises.
    held = [set(ids) for ids in call_each([(c, "variables", {}) for c in placement.ps_clients])]
    placement.pull_into([p for p in params
                         if all(shard.shard_id in held[shard.ps] for shard in remote_of(p).shards)])
    per_ps: dict[int, dict[str, dict]] = {}
    index = 0
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            remote = remote_of(p)
            state = state_dict["state"].get(index, state_dict["state"].get(str(index)))
            for shard in remote.shards:
                piece = None
                if state is not None:
                    piece = {k: (v[shard.start:shard.stop].clone() if isinstance(v, torch.Tensor)
                                 and v.dim() > 0 and v.shape[0] == remote.shape[0] else v)
                             for k, v in state.items()}
                group_state = {**hyper, "params": [0]}
                per_ps.setdefault(shard.ps, {})[shard.shard_id] = {
                    "value": shard.of(p.detach()).clone(), "optimizer_spec": (base, hyper),
                    "optimizer_state": None if piece is None else {"state": {0: piece},
                                                                  "param_groups": [group_state]}}
            index += 1
    placement.write_states(per_ps)


def _get_states(placement: Any, params: list[torch.Tensor]) -> dict[str, dict]:
    wanted: dict[int, list[str]] = {}
    for p in params:
        for shard in remote_of(p).shards:
            wanted.setdefault(shard.ps, []).append(shard.shard_id)
    clients = placement.ps_clients
    states: dict[str, dict] = {}
    for got in call_each([(clients[ps], "get_state", {"var_ids": ids}) for ps, ids in wanted.items()]):
        states.update(got)
    return states
