"""Parameter-server checkpoints: every ps writes and reads its own shards, all at once.

``sg.Checkpoint.save`` asks the strategy's placement to write a module's or an optimizer's
state where it lives (:meth:`~stratagem.placement.scope.base.Placement.write_checkpoint_state`).
Here that means: the coordinator sends each parameter server one ``write_shards`` call
(in parallel, :func:`~stratagem.ps.client.call_each`); each ps writes the values (for a
module) or the optimizer states (for an optimizer) of its shards into ``<name>.ps<k>.pt``
inside the checkpoint's temporary directory and answers with the file's size and CRC-32; the
coordinator writes ``<name>.pt``, the state dict with each variable replaced by a descriptor
of its pieces (:mod:`stratagem.checkpoint.pieces`), and the manifest. No value travels through
the coordinator, and the directory must be on a file system that the coordinator and every
ps share.

Restoring under a parameter-server strategy whose shards are those the checkpoint names (same
model, same partitioner, same number of ps) goes the same way (:func:`read_state`): each ps
verifies its files (size, CRC-32, the pieces and their shapes, and that they are listed in the
manifest the coordinator verified: the same checkpoint, not another one found at that path
on the ps's host or swapped in meanwhile), then -- once every ps and
every other object of the checkpoint passed -- loads them into its variables, in parallel.
Otherwise (another layout, or restored under another strategy) the coordinator reads and
assembles the logical state dict from the pieces, and ``load_state_dict`` cuts it into the
shards of the new layout (another partitioner, another number of ps: resharding).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratagem.errors import CheckpointError, InvalidArgumentError
from stratagem.placement.scope.hooks import base_of, placement_of
from stratagem.ps.client import call_each
from stratagem.ps.variables import RemoteVariable, remote_of
from stratagem.checkpoint.pieces import PlacedRestore, pieces_descriptor
from stratagem.checkpoint.identity import describe
from stratagem.checkpoint.storage import CheckpointReader, check_loadable, write_file

__all__ = ["checkpoint_handlers", "load_shards", "read_state", "write_shards", "write_state"]

_FILE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*\.ps\d+\.pt$")

# ------------------------------------------------------------ on a parameter server


def _check_file_name(method: str, file_name: Any) -> None:
    if not _FILE.match(str(file_name)):
        raise InvalidArgumentError(f"{method}: {file_name!r} is not a shard file name (<name>.ps<k>.pt)")


def write_shards(ps: Any, directory: str, file_name: str, var_ids: list[str],
                 parts: tuple[str, ...] = ("value", "optimizer_state")) -> dict:
    """Write the ``parts`` (values, optimizer states) of ``var_ids`` (shards of ``ps``, a
    ParameterServer) to ``directory/file_name``, fsynced; return its size and CRC-32."""
    folder = Path(directory)
    _check_file_name("write_shards", file_name)
    if not set(parts) <= {"value", "optimizer_state"}:
        raise InvalidArgumentError(f"write_shards: parts {parts!r}; each is 'value' or 'optimizer_state'")
    if ".tmp-" not in folder.name or not folder.is_dir():
        raise InvalidArgumentError(
            f"write_shards: {directory} is not a checkpoint being written on this host; the checkpoint "
            f"directory must be on a file system that the coordinator and every parameter server share")
    state = ps.get_state(list(var_ids))
    payload = {var_id: {part: entry[part] for part in parts} for var_id, entry in state.items()}
    check_loadable(payload, file_name)
    return write_file(folder / file_name, payload)


def load_shards(ps: Any, directory: str, file_name: str, pieces: dict[str, dict], check_only: bool,
                expect: dict | None = None) -> str | None:
    """Verify ``directory/file_name`` (a checkpoint's file of this ps's shards), then unless
    ``check_only`` load its pieces into the variables; return the problem found, else None.

    ``pieces``: per shard id, ``{"part": "value" | "optimizer_state", "shape": [...],
    "optimizer_spec": ...}`` -- what to load and the shape the shard must have. ``expect``:
    the checkpoint the coordinator verified (``identity``, the file's manifest entry as
    ``file``, and the words that name it, ``checkpoint``); the file must be listed in that one."""
    _check_file_name("load_shards", file_name)
    try:
        reader = CheckpointReader(directory, asked=False)   # the coordinator checked the name it asked for
        if expect is not None and (reader.manifest.get("identity") != expect.get("identity")
                                   or reader.manifest["files"].get(file_name) != expect.get("file")):
            return (f"checkpoint {directory}: {file_name}: {getattr(ps, 'name', 'a parameter server')} reads "
                    f"{describe(reader.manifest)} there, but the coordinator restores {expect.get('checkpoint')}; "
                    f"nothing was restored. Every parameter server must see the coordinator's checkpoint "
                    f"directory (a shared file system), unchanged while it is restored")
        payload = reader.load(file_name)   # views of the file: set_state copies
    except CheckpointError as err:
        return str(err)
    problem = _pieces_problem(payload, pieces)
    if problem is not None:
        return f"checkpoint {directory}: {file_name}: {problem}"
    if not check_only:
        ps._count("load_shards", 0, 0)
        ps.set_state({shard_id: {want["part"]: payload[shard_id][want["part"]],
                                 "optimizer_spec": want.get("optimizer_spec")}
                      for shard_id, want in pieces.items()})
    return None


def _pieces_problem(payload: Any, pieces: dict[str, dict]) -> str | None:
    for shard_id, want in pieces.items():
        piece = payload.get(shard_id) if isinstance(payload, dict) else None
        if not isinstance(piece, dict) or want["part"] not in piece:
            return f"holds no {want['part']} of {shard_id!r}, which the checkpoint's skeleton names"
        shape = want["shape"]
        if want["part"] == "value":
            value = piece["value"]
            if not isinstance(value, torch.Tensor) or list(value.shape) != shape:
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                return f"the value of {shard_id!r} is {got}, not a tensor of shape {shape}"
            continue
        state = piece["optimizer_state"]
        entry = state.get("state", {}).get(0, {}) if isinstance(state, dict) else {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == len(shape) > 0 and list(value.shape) != shape:
                return (f"the optimizer's {key!r} of {shard_id!r} has shape {list(value.shape)}, but the shard "
                        f"has shape {shape}")
    return None


def checkpoint_handlers(ps: Any) -> dict[str, Callable[[Any], Any]]:
    """The RPC handlers a ParameterServer adds for checkpoints (its keyword arguments in a dict)."""
    def handler_of(name: str, method: Callable[..., Any]) -> Callable[[Any], Any]:
        def handler(request: Any) -> Any:
            if not isinstance(request, Mapping):
                raise InvalidArgumentError(f"the request of {name!r} must be a dict, got {type(request).__name__}")
            return method(ps, **request)

        handler.__name__ = name
        return handler

    return {"write_shards": handler_of("write_shards", write_shards),
            "load_shards": handler_of("load_shards", load_shards)}


# ------------------------------------------------------------------ on the coordinator


def write_state(placement: Any, obj: Any, directory: Path, name: str) -> tuple[Any, dict[str, dict]] | None:
    """The ParameterServerPlacement's ``write_checkpoint_state``: None for what is not on the ps."""
    if isinstance(obj, nn.Module):
        return _write_module(placement, obj, directory, name)
    if isinstance(obj, torch.optim.Optimizer) and placement_of(obj) is placement:
        return _write_optimizer(placement, obj, directory, name)
    return None


def _piece_list(remote: RemoteVariable, name: str) -> list[list[Any]]:
    """The pieces of a descriptor: ``[file, shard id, start, stop]`` per shard of ``remote``."""
    return [[f"{name}.ps{s.ps}.pt", s.shard_id, s.start, s.stop] for s in remote.shards]


def _pieces(remote: Any, name: str, wanted: dict[int, list[str]]) -> list[list[Any]]:
    for shard in remote.shards:
        wanted.setdefault(shard.ps, [])
        if shard.shard_id not in wanted[shard.ps]:
            wanted[shard.ps].append(shard.shard_id)
    return _piece_list(remote, name)


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
    return skeleton, _write_on_ps(placement, directory, name, wanted, "value")


def _write_optimizer(placement: Any, optimizer: torch.optim.Optimizer, directory: Path, name: str) -> Any:
    placement.finalize()
    result = base_of(optimizer).state_dict(optimizer)   # hyperparameters and parameter indices
    wanted: dict[int, list[str]] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    result["state"] = {index: pieces_descriptor(_pieces(remote_of(p), name, wanted), remote_of(p).shape, state=True)
                       for index, p in enumerate(params)}
    return result, _write_on_ps(placement, directory, name, wanted, "optimizer_state")


def _write_on_ps(placement: Any, directory: Path, name: str, wanted: dict[int, list[str]],
                 part: str) -> dict[str, dict]:
    order = sorted(wanted)
    calls = [(placement.ps_clients[ps], "write_shards",
              {"directory": str(Path(directory).absolute()), "file_name": f"{name}.ps{ps}.pt",
               "var_ids": wanted[ps], "parts": (part,)}) for ps in order]
    return {f"{name}.ps{ps}.pt": entry for ps, entry in zip(order, call_each(calls))}


def read_state(placement: Any, obj: Any, skeleton: Any, directory: Path, name: str,
               manifest: dict | None = None) -> PlacedRestore | None:
    """The ParameterServerPlacement's ``read_checkpoint_state``: a restore that every ps does
    from its own files, or None when the checkpoint's pieces are not this job's shards. Every
    ps checks that its files are those ``manifest`` (the coordinator's) lists."""
    placement.finalize()
    if isinstance(obj, nn.Module):
        placement.loading = True   # which tensors and where: no pull of their values
        try:
            tensors = obj.state_dict(keep_vars=True)
        finally:
            placement.loading = False
        if not isinstance(skeleton, dict) or set(skeleton) != set(tensors):
            return None
        remotes = [(remote_of(t) if isinstance(t, torch.Tensor) else None, skeleton[key], "sg_pieces")
                   for key, t in tensors.items()]
        after = None
    elif isinstance(obj, torch.optim.Optimizer) and placement_of(obj) is placement:
        saved_groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
        if (not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups)
                or not isinstance(skeleton.get("state"), dict)
                or [len(g["params"]) for g in obj.param_groups] != [len(g.get("params", ())) for g in saved_groups]):
            return None
        params = [p for group in obj.param_groups for p in group["params"]]
        if not set(skeleton["state"]) <= set(range(len(params))):
            return None
        remotes = [(remote_of(p), skeleton["state"][i], "sg_state_pieces")
                   for i, p in enumerate(params) if i in skeleton["state"]]

        def after() -> None:   # the coordinator's hyperparameters, sent to the ps too
            placement.load_param_groups(obj, saved_groups, send=True)
    else:
        return None
    per_ps: dict[int, dict[str, dict]] = {}
    for remote, desc, key in remotes:
        if (remote is None or not isinstance(desc, dict) or desc.get(key) != _piece_list(remote, name)
                or desc.get("shape") != list(remote.shape)):
            return None   # another layout: the coordinator assembles and reshards
        part = "value" if key == "sg_pieces" else "optimizer_state"
        for shard in remote.shards:
            shape = [shard.stop - shard.start, *remote.shape[1:]] if remote.shape else []
            per_ps.setdefault(shard.ps, {})[shard.shard_id] = {
                "part": part, "shape": shape, "optimizer_spec": placement.optimizer_spec(remote.var_id)}
    return ShardRestore(placement, Path(directory).absolute(), name, per_ps, after, manifest)


class ShardRestore(PlacedRestore):
    """Every ps verifies its own files now (``problem``) and loads them in :meth:`apply`: files of
    the checkpoint ``manifest`` (the coordinator's) describes, also when loading."""

    def __init__(self, placement: Any, directory: Path, name: str, per_ps: dict[int, dict[str, dict]],
                 after: Callable[[], None] | None, manifest: dict | None = None):
        self._placement = placement
        self._after = after
        self._requests = {ps: {"directory": str(directory), "file_name": f"{name}.ps{ps}.pt", "pieces": pieces}
                          for ps, pieces in sorted(per_ps.items())}
        if manifest is not None:   # each ps reads the checkpoint verified here, not another one at that path
            for request in self._requests.values():
                request["expect"] = {"identity": manifest.get("identity"), "checkpoint": describe(manifest),
                                     "file": manifest.get("files", {}).get(request["file_name"])}
        problems = self._call(check_only=True)
        self.problem = next((p for p in problems if p is not None), None)

    def _call(self, *, check_only: bool) -> list[str | None]:
        clients = self._placement.ps_clients
        for ps in self._requests:   # after a failure the ps may still be restarting
            clients[ps].wait_ready(timeout=self._placement.startup_timeout)
        return call_each([(clients[ps], "load_shards", {**request, "check_only": check_only})
                          for ps, request in self._requests.items()])

    def apply(self) -> None:
        problems = [p for p in self._call(check_only=False) if p is not None]
        self._placement.restored()
        if problems:   # the files changed since they were verified
            raise CheckpointError("; ".join(problems))
        if self._after is not None:
            self._after()
