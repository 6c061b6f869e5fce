"""How a checkpoint lies on disk: a directory, a manifest, checksums, written atomically.

A checkpoint is a directory::

    ckpt-3/
      manifest.json     format and version, what each object is, each file's size and CRC-32
      model.pt          one torch.save file per tensor-holding object, named after it
      optimizer.pt

``manifest.json`` carries a sha256 of its own canonical content, so a flipped byte in it
is caught like one in a data file. Every ``.pt`` file holds only what
``torch.load(weights_only=True)`` reads back (tensors, numbers, strings, lists, dicts):
restoring never unpickles arbitrary objects, and saving refuses anything else up front.

Atomic write (:func:`write_directory`): the files go into ``<path>.tmp-<random>``, each is
fsynced, then the manifest, then the directory; the directory is renamed to ``<path>`` and
the parent is fsynced. A crash at any moment leaves either no ``<path>`` or a complete one;
leftover ``*.tmp-*`` directories are never read and are removed by the next writer
(:func:`remove_stale_temporaries`).

Speed: the checkpoint should cost about what ``torch.save`` / ``torch.load`` of the same
state cost. So ``torch.save`` streams each file straight to disk (tensors are written from
their own memory, no buffer in between) through a writer that keeps the file's CRC-32 on the
way; reading checks the size and CRC-32 over a memory map of the file, then
``torch.load(mmap=True)`` reads the tensors from the same page cache
(:meth:`CheckpointReader.load`), and only what the restored object keeps is copied out of
the map (:func:`owned_copy`). CRC-32 (the
one of zlib, gzip and zip) catches truncation, flipped bits and torn writes, which is what a
checkpoint meets; ISA-L's implementation (the ``isal`` package) computes the same values
several times faster than zlib's, and is used when installed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import mmap
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import CheckpointError, InvalidArgumentError
from stratagem.checkpoint.identity import check, record
from stratagem.checkpoint.writer_lock import hold_writer_lock, series_of

try:   # ISA-L: zlib's CRC-32, the same values, several times faster
    from isal.isal_zlib import crc32
except ImportError:   # pragma: no cover - isal is a dependency; zlib gives the same checksums
    from zlib import crc32

FORMAT = "stratagem-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_TEMP_MARK = ".tmp-"
_CHUNK = 64 << 20   # bytes checksummed per call while reading
_SAFE_LEAVES = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size, torch.device)


def check_loadable(value: Any, where: str) -> None:
    """Raise when ``value`` holds something ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_loadable(key, f"{where} (a key)")
            check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]")
    elif not isinstance(value, _SAFE_LEAVES):
        raise InvalidArgumentError(
            f"cannot checkpoint {where}: it is a {type(value).__name__}, and checkpoints hold only "
            f"tensors, numbers, strings, lists and dicts (so that restoring never unpickles code); "
            f"keep such objects out of the state_dict, or rebuild them from plain values")


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _Checksummed:
    """The file ``torch.save`` writes to: every chunk goes on to ``file`` and into a CRC-32.

    ``torch.save`` hands over each tensor's bytes as a view of its memory, so nothing is
    copied on the way (a file object that is not a path makes torch call ``write``)."""

    def __init__(self, file: Any):
        self._file = file
        self.crc32 = 0
        self.size = 0

    def write(self, data: Any) -> int:
        self.crc32 = crc32(data, self.crc32)
        written = self._file.write(data)
        self.size += written
        return written

    def flush(self) -> None:
        self._file.flush()


def _write_file(path: Path, value: Any) -> dict:
    with open(path, "wb", buffering=1 << 20) as f:
        out = _Checksummed(f)
        torch.save(value, out)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": out.size, "crc32": out.crc32}


def serialize(value: Any) -> bytes:
    """``torch.save`` of ``value`` into bytes (to send it; files are written by :func:`write_file`)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def write_file(path: Path, value: Any) -> dict:
    """``torch.save`` ``value`` to ``path`` and fsync it; return its manifest entry (size, CRC-32)."""
    return _write_file(path, value)


_OS_ADVICE = {errno.ENOSPC: "the file system is full: free space there, or save elsewhere",
              errno.EDQUOT: "the disk quota is exhausted: free space there, or save elsewhere",
              errno.EROFS: "the file system is mounted read-only: save to a writable directory",
              errno.EACCES: "this process may not write there: fix the permissions, or save elsewhere",
              errno.EPERM: "this process may not write there: fix the permissions, or save elsewhere"}


def write_failure(path: "str | os.PathLike", err: OSError) -> CheckpointError:
    """The CheckpointError for a save of ``path`` that the file system refused with ``err``."""
    code = errno.errorcode.get(err.errno or 0, "")
    where = f" ({err.filename})" if err.filename else ""
    advice = _OS_ADVICE.get(err.errno or 0, "make sure that this process can write that directory")
    return CheckpointError(
        f"cannot write the checkpoint {path}: {err.strerror or err}{f' [{code}]' if code else ''}{where}; "
        f"{advice}. Nothing was replaced: the checkpoints already in {Path(path).absolute().parent} are intact.")


class DirectoryWriter:
    """One atomic checkpoint write: files go into ``temporary``, ``commit`` makes them ``path``.

    ``add(name, value)`` saves a file here; ``adopt(name, entry)`` lists a file that another
    process (a parameter server) wrote into ``temporary`` itself. ``commit`` writes the
    manifest, fsyncs, renames; ``abort`` removes the temporary directory.
    """

    def __init__(self, path: "str | os.PathLike", holder: object = None):
        self.given = Path(path)
        self.path = self.given.absolute()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one live writer per series of checkpoints in a directory (held while `holder` lives)
        self.lock = hold_writer_lock(self.path.parent, series_of(self.path.name), holder, str(self.given))
        self.temporary = self.path.with_name(f"{self.path.name}{_TEMP_MARK}{secrets.token_hex(4)}")
        self.temporary.mkdir()
        self._entries: dict[str, dict] = {}

    def add(self, name: str, value: Any) -> None:
        self._entries[name] = write_file(self.temporary / name, value)

    def adopt(self, name: str, entry: dict) -> None:
        size = (self.temporary / name).stat().st_size if (self.temporary / name).is_file() else None
        if size != entry.get("bytes"):
            raise CheckpointError(f"{name} should have been written into {self.temporary} with "
                                  f"{entry.get('bytes')} bytes, but {'it is missing' if size is None else size}; "
                                  f"the directory must be on a file system the parameter servers share")
        self._entries[name] = {"bytes": entry["bytes"], "crc32": entry["crc32"]}

    def commit(self, objects: dict[str, dict], info: dict, identity: dict | None = None) -> Path:
        """Write the manifest (``identity``: what :func:`~stratagem.checkpoint.identity.record` made, else
        the name alone), then rename the directory into place; return the path."""
        manifest = {"format": FORMAT, "version": VERSION, "files": self._entries, "objects": objects, "info": info,
                    "identity": identity or record(self.path.name)}   # what it is: identity.py
        manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
        _write_bytes(self.temporary / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_directory(self.temporary)
        self.lock.check(str(self.given))   # still this process's directory to write
        old = None
        if self.path.exists():
            old = self.path.with_name(f"{self.path.name}.old-{secrets.token_hex(4)}")
            os.rename(self.path, old)
        try:
            os.rename(self.temporary, self.path)
        except BaseException:
            if old is not None:   # the checkpoint it replaces goes back under its name
                os.rename(old, self.path)
            raise
        _fsync_directory(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.given

    def abort(self) -> None:
        shutil.rmtree(self.temporary, ignore_errors=True)


def write_directory(path: Path, files: dict[str, Any], objects: dict[str, dict], info: dict) -> Path:
    """Write a checkpoint directory at ``path`` atomically; return ``path``.

    ``files`` maps file names to what each holds (saved with ``torch.save``); ``objects`` describes each saved object
    (the manifest's ``objects``); ``info`` is free-form (strategy, replicas) for humans.
    An existing ``path`` is replaced: the new directory is renamed into place and the old
    one removed afterwards (a crash in between leaves the old one under ``<path>.old-*``).
    """
    writer = DirectoryWriter(path)
    try:
        for name, value in files.items():
            writer.add(name, value)
        return writer.commit(objects, info)
    except BaseException:
        writer.abort()
        raise


def remove_stale_temporaries(directory: Path, prefix: str = "") -> list[Path]:
    """Remove ``<prefix>*.tmp-*`` directories that a crashed writer left in ``directory``."""
    removed = []
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.name.startswith(prefix) and _TEMP_MARK in entry.name and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


class CheckpointReader:
    """A checkpoint directory, verified before anything in it is used.

    ``read_manifest()`` checks the format, version and the manifest's own checksum;
    ``load(name)`` checks a file's size and CRC-32, then ``torch.load(weights_only=True)``.
    Every problem raises :class:`~stratagem.errors.CheckpointError` naming the file. Unless
    ``asked`` is False, the checkpoint must be the one asked for: saved under the directory's
    name, or as ``saved_as`` (:func:`~stratagem.checkpoint.identity.check`). ``digest`` is the
    sha256 of the manifest file as read.
    """

    def __init__(self, path: "str | os.PathLike", *, saved_as: str | None = None, asked: bool = True):
        self.path = Path(path)
        self.digest: str | None = None
        self.manifest = self._read_manifest()
        if asked:
            try:
                check(self.manifest, self.path, saved_as)
            except CheckpointError as err:
                raise self._fail(MANIFEST, str(err)) from None

    def _fail(self, name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path}: {name}: {problem}")

    def _read_manifest(self) -> dict:
        if _TEMP_MARK in self.path.name:
            raise CheckpointError(f"{self.path} is an unfinished write (a name with {_TEMP_MARK!r}) and is never "
                                  f"restored; restore a path that save() returned")
        if not self.path.is_dir():
            raise CheckpointError(
                f"checkpoint {self.path} does not exist or is not a directory; pass the path "
                f"that save() returned (in multi-worker training the directory must be on a file system "
                f"every worker can read)")
        file = self.path / MANIFEST
        try:
            data = file.read_bytes()
            self.digest = hashlib.sha256(data).hexdigest()
            manifest = json.loads(data)
        except FileNotFoundError:
            raise self._fail(MANIFEST, "missing: this is not a complete checkpoint") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise self._fail(MANIFEST, f"not valid JSON ({err}): the file is truncated or corrupt") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise self._fail(MANIFEST, f"not a stratagem checkpoint manifest (format {FORMAT!r} expected)")
        claimed = manifest.pop("manifest_sha256", None)
        if claimed != hashlib.sha256(_canonical(manifest)).hexdigest():
            raise self._fail(MANIFEST, "its checksum does not match its content: the file is corrupt")
        if manifest.get("version") != VERSION:
            raise self._fail(MANIFEST, f"format version {manifest.get('version')!r}, but this stratagem "
                                       f"reads version {VERSION}; restore it with the stratagem that wrote it")
        return manifest

    def load(self, name: str) -> Any:
        """What the file ``name`` holds, after its size and checksum were verified.

        Tensors are views of the file's memory map: copy them into live tensors (as a
        module's ``load_state_dict`` does), or keep :func:`owned_copy` of them."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise self._fail(name, "not listed in the manifest")
        file = self.path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise self._fail(name, "missing (listed in the manifest)") from None
        if size != entry.get("bytes"):
            raise self._fail(name, f"{size} bytes where the manifest says {entry.get('bytes')}: "
                                   f"the file is truncated or was changed")
        self._verify(name, file, entry)
        try:
            value = torch.load(file, weights_only=True, map_location="cpu", mmap=True)
        except Exception as err:   # checksum passed, content not loadable: written by something else
            raise self._fail(name, f"cannot be read safely ({type(err).__name__}: {err})") from None
        return value

    def _verify(self, name: str, file: Path, entry: dict) -> None:
        if "crc32" in entry:
            algorithm, expected = "CRC-32", entry["crc32"]
            running: Any = 0
            update = crc32
        elif "sha256" in entry:   # written by the first version of this format
            algorithm, expected = "sha256", entry["sha256"]
            running = hashlib.sha256()
            update = _sha256_update
        else:
            raise self._fail(name, "the manifest gives it no checksum: the manifest was changed")
        try:
            f = open(file, "rb")
        except FileNotFoundError:   # deleted since it was listed
            raise self._fail(name, "missing (listed in the manifest)") from None
        with f:
            if entry["bytes"]:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    if hasattr(mapped, "madvise"):
                        mapped.madvise(mmap.MADV_SEQUENTIAL)
                    with memoryview(mapped) as view:
                        for start in range(0, len(view), _CHUNK):
                            with view[start:start + _CHUNK] as part:
                                running = update(part, running)
        actual = running if algorithm == "CRC-32" else running.hexdigest()
        if actual != expected:
            raise self._fail(name, f"its {algorithm} does not match the manifest: the file is corrupt")


def _sha256_update(data: Any, running: Any) -> Any:
    running.update(data)
    return running


def owned_copy(value: Any, *, into: Any = None) -> Any:
    """``value`` with every tensor copied to CPU memory of its own (containers keep their type):
    out of a file's memory map, or away from live training state. A tensor of ``into`` (the
    same structure) with the same shape and dtype is reused instead of new memory."""
    if isinstance(value, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype
                and into.device.type == "cpu"):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = type(value)()
        for key, item in value.items():
            copied[key] = owned_copy(item, into=into.get(key) if isinstance(into, dict) else None)
        if hasattr(value, "_metadata"):
            copied._metadata = value._metadata
        return copied
    if type(value) in (list, tuple):
        others = into if type(into) is type(value) and len(into) == len(value) else [None] * len(value)
        return type(value)(owned_copy(item, into=other) for item, other in zip(value, others))
    return value
