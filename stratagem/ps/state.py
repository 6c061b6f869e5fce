"""What a parameter server saves and restores: its variables' values and optimizer states.

:class:`ShardStates` is a part of :class:`~stratagem.ps.service.ParameterServer` (a base
class of it): ``get_state`` copies out what ``set_state`` needs to rebuild the variables,
here or on a fresh ps (after a lost one was restarted, the coordinator's
``model.load_state_dict`` / ``optimizer.load_state_dict`` call ``set_state``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stratagem.errors import InvalidArgumentError
from stratagem.ps.shards import Shard, check_value, clone_tree, nbytes
from stratagem.ps.sparse_update import after_load_state_dict

__all__ = ["ShardStates"]


class ShardStates:
    """``get_state`` / ``set_state`` of a parameter server's variables (see the module doc)."""

    # provided by the ParameterServer: create(), _get() and _count(), and these
    name: str
    _variables: dict[str, Shard]

    def get_state(self, var_ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Per variable: ``{"value", "optimizer_spec", "optimizer_state"}`` (copies), what
        :meth:`set_state` needs to restore it -- here or on a fresh parameter server."""
        ids = list(self._variables) if var_ids is None else list(var_ids)
        state = {}
        for var_id in ids:
            var = self._get(var_id)
            with var.lock:
                state[var_id] = {
                    "value": var.param.detach().clone(),
                    "optimizer_spec": var.optimizer_spec,
                    "optimizer_state": None if var.optimizer is None else clone_tree(var.optimizer.state_dict()),
                }
        self._count("get_state", 0, sum(nbytes(entry["value"]) for entry in state.values()))
        return state

    def set_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restores what :meth:`get_state` returned: values and optimizer states (including
        hyperparameters). Variables missing here are created from the entry's
        ``optimizer_spec``. An entry without ``value`` restores the optimizer state of a
        variable that exists."""
        for var_id, entry in state.items():
            if not isinstance(entry, Mapping) or not (
                    "value" in entry or ("optimizer_state" in entry and var_id in self._variables)):
                raise InvalidArgumentError(
                    f"set_state: the entry of {var_id!r} must be a dict with 'value' (and "
                    "'optimizer_spec', 'optimizer_state'), as get_state() returns.")
            if var_id not in self._variables:
                self.create(var_id, entry["value"], entry.get("optimizer_spec"))
            var = self._get(var_id)
            value = check_value(var_id, var, entry["value"], "value") if "value" in entry else None
            optimizer_state = entry.get("optimizer_state")
            with var.lock:
                if value is not None:
                    with torch.no_grad():
                        var.param.copy_(value)
                if optimizer_state is not None:
                    if var.optimizer is None:
                        raise InvalidArgumentError(
                            f"set_state: {var_id!r} has optimizer state but no optimizer on {self.name}.")
                    try:
                        # A copy: load_state_dict keeps the given tensors, which belong to
                        # the caller (or to the request's buffer).
                        var.optimizer.load_state_dict(clone_tree(optimizer_state))
                        after_load_state_dict(var.optimizer, var.param)
                    except (KeyError, ValueError, TypeError) as err:
                        raise InvalidArgumentError(
                            f"set_state: the optimizer state of {var_id!r} does not fit its "
                            f"{type(var.optimizer).__name__}: {err}") from err
