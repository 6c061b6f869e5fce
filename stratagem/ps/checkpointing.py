"""Parameter-server checkpoints: every ps writes its own shards, all at once; the coordinator the rest.

``sg.Checkpoint.save`` asks the strategy's placement to write a module's or an optimizer's
state where it lives (:meth:`~stratagem.placement.base.Placement.write_checkpoint_state`).
Here that means: the coordinator sends each parameter server one ``write_shards`` call
(in parallel, :func:`~stratagem.ps.client.call_each`); each ps writes the values and optimizer
states of its shards into ``<name>.ps<k>.pt`` inside the checkpoint's temporary directory and
answers with the file's size and CRC-32; the coordinator writes ``<name>.pt``, the state dict
with each variable replaced by a descriptor of its pieces (:mod:`stratagem.training.pieces`),
and the manifest. No value travels through the coordinator, and the directory must be on a
file system that the coordinator and every ps share.

Reading assembles the logical state dict from the pieces, so the checkpoint restores under
any strategy; restored under a parameter-server strategy, ``load_state_dict`` cuts it into
the shards of the new layout (another partitioner, another number of ps: resharding).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.placement.hooks import placement_of
from stratagem.ps.client import call_each
from stratagem.ps.variables import remote_of
from stratagem.training.pieces import pieces_descriptor
from stratagem.training.storage import check_loadable, write_file

__all__ = ["checkpoint_handlers", "write_shards", "write_state"]

_FILE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*\.ps\d+\.pt$")

# ------------------------------------------------------------ on a parameter server


def write_shards(ps: Any, directory: str, file_name: str, var_ids: list[str]) -> dict:
    """Write the values and optimizer states of ``var_ids`` (shards of ``ps``, a
    ParameterServer) to ``directory/file_name``, fsynced; return its size and CRC-32."""
    folder = Path(directory)
    if not _FILE.match(str(file_name)):
        raise InvalidArgumentError(f"write_shards: {file_name!r} is not a shard file name (<name>.ps<k>.pt)")
    if ".tmp-" not in folder.name or not folder.is_dir():
        raise InvalidArgumentError(
            f"write_shards: {directory} is not a checkpoint being written on this host; the checkpoint "
            f"directory must be on a file system that the coordinator and every parameter server share")
    state = ps.get_state(list(var_ids))
    payload = {var_id: {"value": entry["value"], "optimizer_state": entry["optimizer_state"]}
               for var_id, entry in state.items()}
    check_loadable(payload, file_name)
    return write_file(folder / file_name, payload)


def checkpoint_handlers(ps: Any) -> dict[str, Callable[[Any], Any]]:
    """The RPC handlers a ParameterServer adds for checkpoints (its keyword arguments in a dict)."""
    def handler(request: Any) -> Any:
        if not isinstance(request, Mapping):
            raise InvalidArgumentError(f"the request of 'write_shards' must be a dict, got {type(request).__name__}")
        return write_shards(ps, **request)

    handler.__name__ = "write_shards"
    return {"write_shards": handler}


# ------------------------------------------------------------------ on the coordinator


def write_state(placement: Any, obj: Any, directory: Path, name: str) -> tuple[Any, dict[str, dict]] | None:
    """The ParameterServerPlacement's ``write_checkpoint_state``: None for what is not on the ps."""
    if isinstance(obj, nn.Module):
        return _write_module(placement, obj, directory, name)
    if isinstance(obj, torch.optim.Optimizer) and placement_of(obj) is placement:
        return _write_optimizer(placement, obj, directory, name)
    return None


def _pieces(remote: Any, name: str, wanted: dict[int, list[str]]) -> list[list[Any]]:
    for shard in remote.shards:
        wanted.setdefault(shard.ps, [])
        if shard.shard_id not in wanted[shard.ps]:
            wanted[shard.ps].append(shard.shard_id)
    return [[f"{name}.ps{s.ps}.pt", s.shard_id, s.start, s.stop] for s in remote.shards]


def _write_module(placement: Any, module: nn.Module, directory: Path, name: str) -> Any:
    placement.finalize()
    placement.loading = True   # only which tensors and where: no pull of their values
    try:
        tensors = module.state_dict(keep_vars=True)
    finally:
        placement.loading = False
    if not any(isinstance(t, torch.Tensor) and remote_of(t) is not None for t in tensors.values()):
        return None
    wanted: dict[int, list[str]] = {}
    skeleton: OrderedDict = OrderedDict()
    for key, tensor in tensors.items():
        remote = remote_of(tensor) if isinstance(tensor, torch.Tensor) else None
        if remote is None:
            skeleton[key] = tensor.detach().cpu() if isinstance(tensor, torch.Tensor) else tensor
        else:
            skeleton[key] = pieces_descriptor(_pieces(remote, name, wanted), remote.shape)
    if hasattr(tensors, "_metadata"):
        skeleton._metadata = tensors._metadata
    return skeleton, _write_on_ps(placement, directory, name, wanted)


def _write_optimizer(placement: Any, optimizer: torch.optim.Optimizer, directory: Path, name: str) -> Any:
    placement.finalize()
    result = optimizer._sg_base.state_dict(optimizer)   # hyperparameters and parameter indices
    wanted: dict[int, list[str]] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    result["state"] = {index: pieces_descriptor(_pieces(remote_of(p), name, wanted), remote_of(p).shape, state=True)
                       for index, p in enumerate(params)}
    return result, _write_on_ps(placement, directory, name, wanted)


def _write_on_ps(placement: Any, directory: Path, name: str, wanted: dict[int, list[str]]) -> dict[str, dict]:
    order = sorted(wanted)
    calls = [(placement.ps_clients[ps], "write_shards",
              {"directory": str(Path(directory).absolute()), "file_name": f"{name}.ps{ps}.pt",
               "var_ids": wanted[ps]}) for ps in order]
    return {f"{name}.ps{ps}.pt": entry for ps, entry in zip(order, call_each(calls))}
