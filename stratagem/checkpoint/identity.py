"""What a checkpoint is, recorded when it is saved and compared with what a restore asked for.

A checkpoint is asked for by its path, and its directory's name can lie: two checkpoints
swapped on disk (``ckpt-a`` and ``ckpt-b``, ``ckpt-2`` and ``ckpt-3``) would each restore as
the other, the wrong step and weights, without a word. So every save records in the
manifest's ``"identity"``:

- ``name``: the name of the directory it was saved as (``ckpt-3``, ``best``, ``weights.05``);
- ``job``: a random id made when the :class:`~stratagem.checkpoint.checkpoint.Checkpoint` was
  created, replaced by the checkpoint's own when it restores one (a resumed job is the job that
  saved it; only the chief's is written);
- ``save_counter``: how many saves that job had made, this one included;
- ``id``: a random id of this save alone.

:func:`check` compares it with the restore: the directory's name (or the symbolic link's
target's) must be the recorded one, unless the caller says which checkpoint it restores
(``restore(path, saved_as=...)``: a copy renamed on purpose). A copy under the same name
elsewhere (a whole checkpoint folder moved to another disk) restores as usual. Checkpoints of
older versions, which record no name, restore with a warning that says so.

Example::

    import os, shutil, tempfile, torch, stratagem as sg
    folder = tempfile.mkdtemp()
    ckpt = sg.Checkpoint(model=torch.nn.Linear(2, 2), step=3)
    ckpt.save(os.path.join(folder, "ckpt-3"))
    shutil.copytree(os.path.join(folder, "ckpt-3"), os.path.join(folder, "best"))
    try:
        ckpt.restore(os.path.join(folder, "best"))
        raise AssertionError("restored without a word")
    except sg.errors.CheckpointError as err:   # asked for 'best', found the checkpoint saved as 'ckpt-3' ...
        assert "found the checkpoint saved as 'ckpt-3'" in str(err)
    ckpt.restore(os.path.join(folder, "best"), saved_as="ckpt-3")   # a copy renamed on purpose
"""

from __future__ import annotations

import os
import secrets
import warnings
from typing import Any

from stratagem.errors import CheckpointError

__all__ = ["check", "describe", "new_job", "record"]


def new_job() -> str:
    """A fresh job id (16 hex digits)."""
    return secrets.token_hex(8)


def record(name: str, job: str | None = None, save_counter: int | None = None) -> dict[str, Any]:
    """The manifest's ``identity`` of a checkpoint saved as ``name`` (``job`` and ``save_counter`` where known)."""
    identity: dict[str, Any] = {"name": name, "id": secrets.token_hex(8)}
    if job is not None:
        identity.update(job=job, save_counter=save_counter)
    return identity


def describe(manifest: dict) -> str:
    """``the checkpoint saved as 'ckpt-b' (save 2 of job 3f9a01c2b4d5e6f7, at 2026-01-07T10:12:03Z)``."""
    identity = manifest.get("identity") or {}
    saved_at = (manifest.get("info") or {}).get("saved_at")
    details = []
    if identity.get("job") is not None:
        details.append(f"save {identity.get('save_counter')} of job {identity['job']}")
    if saved_at:
        details.append(f"at {saved_at}")
    name = identity.get("name")
    what = f"the checkpoint saved as {name!r}" if name is not None else "a checkpoint that records no name"
    return what + (f" ({', '.join(details)})" if details else "")


def check(manifest: dict, path: "str | os.PathLike", saved_as: str | None = None) -> None:
    """Raise CheckpointError when the manifest at ``path`` is not the checkpoint asked for:
    the one saved as ``saved_as``, else as the directory's name. Warn when it records no name."""
    identity = manifest.get("identity")
    name = identity.get("name") if isinstance(identity, dict) else None
    if not isinstance(name, str):   # written before checkpoints recorded their name
        warnings.warn(
            f"checkpoint {path} records no identity (it was written by an older stratagem), so it cannot be "
            f"checked that it is the checkpoint saved as {saved_as or os.path.basename(os.path.abspath(path))!r} "
            f"and not another one renamed or swapped on disk; restoring it as it is. Save it again to record one",
            RuntimeWarning, stacklevel=4)
        return
    if saved_as is not None:
        if name != saved_as:
            raise CheckpointError(
                f"asked for the checkpoint saved as {saved_as!r}, found {describe(manifest)}: it is another "
                f"checkpoint, and nothing was restored. Restore it with saved_as={name!r} if it is the one you "
                f"want")
        return
    asked = os.path.basename(os.path.abspath(path))
    if name in (asked, os.path.basename(os.path.realpath(path))):   # (a symbolic link: as its target)
        return
    raise CheckpointError(
        f"asked for {asked!r}, found {describe(manifest)}: the directories were swapped or renamed, and restoring "
        f"it under this name would bring back the state of {name!r}; nothing was restored. Rename it back to "
        f"{name!r}; to restore a copy renamed on purpose, say which checkpoint it is: "
        f"restore(path, saved_as={name!r})")
