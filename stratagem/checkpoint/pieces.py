"""Tensors saved in pieces by the processes that hold them, put together again when read.

A strategy whose state is spread over processes (parameter servers) may save a module's or
an optimizer's state as a skeleton -- its usual state dict, with each spread tensor replaced
by a *pieces* descriptor -- plus files that each holder wrote with its pieces, keyed by piece
id. Reading assembles the one logical state dict again, so it restores under any strategy:

- ``{"sg_pieces": [[file, piece_id, start, stop], ...], "shape": [...]}``: a tensor whose rows
  ``start:stop`` are the ``"value"`` of piece ``piece_id`` in ``file``;
- ``{"sg_state_pieces": [[file, piece_id, start, stop], ...], "shape": [...]}``: one parameter's
  optimizer state, kept per piece (the ``"optimizer_state"`` of the piece: a one-parameter
  optimizer state dict); tensors with the parameter's rows are joined, the rest (``step``) are
  the first piece's.

When the processes holding the pieces can also read them back in place (the same layout),
the strategy's placement restores them itself (:class:`PlacedRestore`): the checkpoint then
never assembles the logical tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from stratagem.errors import CheckpointError


class PlacedRestore:
    """A restore that the processes holding an object's state do from their own files.

    Made while the checkpoint is verified: ``problem`` is the first problem those processes
    found in their files (None: all good); :meth:`apply` loads them, after every object of
    the checkpoint passed verification.
    """

    problem: str | None = None

    def apply(self) -> None:
        raise NotImplementedError


def pieces_descriptor(pieces: list[list[Any]], shape: tuple[int, ...], *, state: bool = False) -> dict:
    return {"sg_state_pieces" if state else "sg_pieces": [list(p) for p in pieces], "shape": list(shape)}


def _piece(load: Callable[[str], Any], cache: dict, file: str, piece_id: str) -> dict:
    if file not in cache:
        cache[file] = load(file)
    entry = cache[file].get(piece_id) if isinstance(cache[file], dict) else None
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file}: holds no piece {piece_id!r}, which the checkpoint's skeleton names")
    return entry


def _tensor(desc: dict, load: Callable, cache: dict) -> torch.Tensor:
    parts = [_piece(load, cache, file, pid)["value"] for file, pid, _, _ in desc["sg_pieces"]]
    value = parts[0] if len(parts) == 1 else torch.cat(parts)
    if list(value.shape) != desc["shape"]:
        raise CheckpointError(f"pieces {[p[1] for p in desc['sg_pieces']]} make a tensor of shape "
                              f"{list(value.shape)}, not {desc['shape']} as the skeleton says")
    return value


def _state(desc: dict, load: Callable, cache: dict) -> dict:
    rows = desc["shape"][0] if desc["shape"] else None
    states = []
    for file, pid, _, _ in desc["sg_state_pieces"]:
        saved = _piece(load, cache, file, pid).get("optimizer_state") or {}
        states.append(saved.get("state", {}).get(0, {}))
    merged = {}
    for key, first in states[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0 and len(states) > 1:
            merged[key] = torch.cat([s[key] for s in states])
            if rows is not None and merged[key].shape[0] != rows:
                raise CheckpointError(f"the optimizer's {key!r} pieces make {merged[key].shape[0]} rows, not {rows}")
        else:
            merged[key] = first
    return merged


def assemble(state: Any, load: Callable[[str], Any]) -> Any:
    """``state`` with every pieces descriptor replaced by what it describes (``load(file)`` reads a file)."""
    cache: dict[str, Any] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if "sg_pieces" in value:
                return _tensor(value, load, cache)
            if "sg_state_pieces" in value:
                return _state(value, load, cache)
            result = type(value)()
            for key, item in value.items():
                item_value = walk(item)
                # a parameter that has no optimizer state yet has no entry
                if not (isinstance(item, dict) and "sg_state_pieces" in item and not item_value):
                    result[key] = item_value
            if hasattr(value, "_metadata"):   # a module state dict's versions
                result._metadata = value._metadata
            return result
        return value

    if not _has_descriptor(state):
        return state
    return walk(state)


def _has_descriptor(value: Any) -> bool:
    if isinstance(value, dict):
        return "sg_pieces" in value or "sg_state_pieces" in value or any(_has_descriptor(v) for v in value.values())
    return False
