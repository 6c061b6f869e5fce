"""Restoring when the workers do not share the checkpoint directory: the chief's copy, sent.

In multi-worker training only the chief writes checkpoints. When the directory is on a
file system every worker reads (NFS, a shared disk, one host), every worker reads the
checkpoint itself. When each host has its own disk, the other workers find nothing under
that path -- or worse, an older checkpoint of the same name left there by another job.

:func:`open_checkpoint` finds out which case this is before anything is read: every worker
hashes the ``manifest.json`` it sees under the path (or sees none), and the workers gather
the hashes. The chief's checkpoint is the truth, so:

- every worker sees the chief's manifest: each reads the files itself (no extra traffic);
- the chief sees none: each worker reads what it sees, and the restore fails on every worker
  with the chief's reason (as a restore of a missing checkpoint always does);
- some worker sees none or another manifest: the chief reads and verifies every file (sizes,
  CRC-32s) and broadcasts their contents over the workers' process group, as one
  ``torch.save`` payload that the others load with ``weights_only=True``; every worker then
  restores from that copy, and a worker that saw none or another says so in a warning.

The copy passes through memory once on every worker, and through the network once per
worker: fine for the checkpoints this fallback is for, slower than a shared file system for
very large ones.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import CheckpointError
from stratagem.checkpoint.identity import describe
from stratagem.checkpoint.storage import MANIFEST, CheckpointReader, serialize

__all__ = ["ChiefCopy", "manifest_digest", "open_checkpoint"]


def manifest_digest(path: "str | os.PathLike") -> str | None:
    """The sha256 of the manifest this process sees at ``path``, or None if it cannot read one."""
    try:
        return hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return None


class ChiefCopy:
    """A checkpoint as the chief read and verified it: what :class:`CheckpointReader` offers a restore.

    ``path`` is the chief's path, ``manifest`` its manifest, ``load(name)`` a file's content.
    """

    def __init__(self, path: "str | os.PathLike", manifest: dict, files: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
        self._files = files

    @classmethod
    def read(cls, path: "str | os.PathLike", saved_as: str | None = None) -> "ChiefCopy":
        """Read and verify every file of the checkpoint at ``path`` (raises CheckpointError)."""
        reader = CheckpointReader(path, saved_as=saved_as)
        return cls(path, reader.manifest, {name: reader.load(name) for name in reader.manifest["files"]})

    def load(self, name: str) -> Any:
        if name not in self._files:
            raise CheckpointError(f"checkpoint {self.path}: {name}: not listed in the manifest")
        return self._files[name]

    def to_bytes(self) -> bytes:
        return serialize({"manifest": self.manifest, "files": self._files})

    @classmethod
    def from_bytes(cls, path: "str | os.PathLike", data: bytes) -> "ChiefCopy":
        content = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return cls(path, content["manifest"], content["files"])


def open_checkpoint(path: "str | os.PathLike", strategy: Any,
                    saved_as: str | None = None) -> "CheckpointReader | ChiefCopy":
    """What this worker restores ``path`` from: its own files, or the chief's copy (module docstring).

    A collective when the strategy has several workers: every worker calls it, and every
    one completes the same exchanges before anything is raised (CheckpointError, on the
    workers that cannot read what they must). The checkpoint must be the one asked for
    (``saved_as``: :func:`~stratagem.checkpoint.identity.check`), and every worker reads the
    same one: a manifest that changed since the workers compared theirs is refused.
    """
    collective = strategy.checkpoint_collective   # every process that restores; its worker 0 is the chief
    if collective.num_workers == 1:
        return CheckpointReader(path, saved_as=saved_as)
    mine = manifest_digest(path)
    views = collective.all_gather_object(mine, "Checkpoint.restore (the checkpoint each worker sees)")
    if views[0] is None or all(view == views[0] for view in views):
        reader = CheckpointReader(path, saved_as=saved_as)
        if views[0] is not None and reader.digest != views[0]:   # replaced meanwhile (renamed, swapped)
            raise CheckpointError(
                f"checkpoint {path}: manifest.json changed while the workers opened it: worker "
                f"{collective.worker_index} now reads {describe(reader.manifest)}, which is not the checkpoint "
                f"every worker saw a moment before; was it replaced, renamed or swapped during the restore?")
        return reader
    outcome: tuple[str, Any] | None = None
    if collective.worker_index == 0:
        try:
            copy = ChiefCopy.read(path, saved_as)
            outcome = ("ok", copy.to_bytes())
        except Exception as err:   # told to every worker, then raised everywhere
            outcome = ("error", f"{type(err).__name__}: {err}")
    outcome = collective.broadcast_object(outcome)
    status, detail = outcome
    if status != "ok":
        raise CheckpointError(f"the chief could not read checkpoint {path} to send it to the workers "
                              f"that do not see it: {detail}")
    if collective.worker_index == 0:
        return copy
    if mine != views[0]:
        seen = "nothing" if mine is None else "another checkpoint (a different manifest)"
        warnings.warn(f"worker {collective.worker_index} sees {seen} at {path}, where the chief sees the "
                      f"checkpoint it wrote: the checkpoint directory is not shared, so this worker restores "
                      f"the chief's copy, sent over the process group", RuntimeWarning, stacklevel=3)
    return ChiefCopy.from_bytes(path, detail)
