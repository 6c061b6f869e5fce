"""One live writer per series of checkpoints: a lock file in the checkpoint directory naming its owner.

Two groups of one job can end up writing the same directory: a job manager restarts a
launcher whose tasks still run, or a job is started twice by hand. Each would then write
``ckpt-<n>`` over the other's and delete the other's "old" checkpoints. So the process that
writes a series of checkpoints -- the names of a directory that differ only in their digits:
``ckpt-1``, ``ckpt-2``, ... (the series ``ckpt-N``), or ``weights.01``, ``weights.02`` -- first
takes ``<directory>/.<series>.lock`` (``.ckpt-N.lock``), a small JSON file naming it: host, boot
id, pid, the process's start time, its task and script, and the last time it renewed its
lease. Only writers take it (the chief of a multi-worker job, the coordinator of a
parameter-server job; every :class:`~stratagem.checkpoint.storage.DirectoryWriter` asks for it),
never readers such as a sidecar evaluator.

Another process finds the lock:

- **live** when its owner runs on this host -- the same boot, a process with that pid, and
  that pid's start time in ``/proc/<pid>/stat`` the recorded one (a pid reused by another
  process does not count) -- or, for an owner on another host (a shared file system), when the
  owner renewed its lease within :data:`LEASE_S` seconds (a thread renews it every
  :data:`RENEW_S`): the write is refused with :class:`~stratagem.errors.CheckpointError` naming
  the owner;
- **stale** otherwise (the owner was killed, the host rebooted, the lease ran out): the lock is
  taken over, and the takeover is logged.

Before a checkpoint is renamed into place the writer checks that the lock is still its own: a
writer that was stopped (SIGSTOP, a frozen host) past its lease and taken over stops with an
error instead of writing over the new owner. The file is changed only under ``flock`` of it,
so two processes taking a stale lock at once cannot both win. The lock is released (the file
removed) when every object that took it is gone, when the process exits, or when the series
is deleted (``CheckpointManager.delete_all``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from stratagem.errors import CheckpointError

__all__ = ["LEASE_S", "RENEW_S", "WriterLock", "describe_owner", "hold_writer_lock", "lock_path",
           "release_writer_lock", "series_of"]

LEASE_S = 60.0    # an owner on another host is live while it renewed within this many seconds
RENEW_S = 15.0    # how often a holder renews
logger = logging.getLogger("stratagem.checkpoint")

_held: dict[str, "WriterLock"] = {}
_held_lock = threading.RLock()   # (re-entered by a holder's finalizer run by GC inside a hold)
_renewer: threading.Thread | None = None


def series_of(name: str) -> str:
    """The series a checkpoint name belongs to: its digits replaced by ``N`` (``ckpt-3`` -> ``ckpt-N``)."""
    return re.sub(r"\d+", "N", name)


def lock_path(directory: "str | os.PathLike", series: str) -> Path:
    """Where the lock of ``series`` in ``directory`` lies."""
    return Path(directory) / f".{series}.lock"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``); None if gone."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _boot_id() -> str:
    return (_read_text("/proc/sys/kernel/random/boot_id") or "").strip()


def _owner_record(token: str) -> dict[str, Any]:
    now = time.time()
    ticks = _start_ticks(os.getpid())
    uptime = _read_text("/proc/uptime")
    started = None
    if ticks is not None and uptime:
        started = now - float(uptime.split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
    task = None
    try:
        spec = json.loads(os.environ.get("TF_CONFIG", "") or "{}").get("task") or {}
        task = f"{spec['type']} {spec['index']}" if spec else None
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(), "start_ticks": ticks,
            "started": _when(started) if started else None, "task": task,
            "command": sys.argv[0][-200:] if sys.argv else None, "taken": _when(now), "renewed_at": now,
            "lease_s": LEASE_S, "holder": token}


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def describe_owner(owner: dict[str, Any]) -> str:
    """The owner a lock names, in words."""
    task = f" ({owner['task']})" if owner.get("task") else ""
    started = f", started {owner['started']}" if owner.get("started") else ""
    return (f"pid {owner.get('pid')} on host {owner.get('host')!r}{task}{started}, running "
            f"{owner.get('command')!r}")


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
_warned_no_flock: set[str] = set()


def _flock(fd: int, path: Path) -> None:
    """``flock`` the lock file; on a file system without locks, go on without (said once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            raise
        if str(path.parent) not in _warned_no_flock:
            _warned_no_flock.add(str(path.parent))
            logger.warning("the file system of %s does not lock files (%s): two processes taking its checkpoint "
                           "lock at the same moment could both get it", path.parent, err.strerror)


def _is_this_process(owner: dict[str, Any]) -> bool:
    return (owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
            and owner.get("boot_id") == _boot_id() and owner.get("start_ticks") == _start_ticks(os.getpid()))


def _liveness(owner: dict[str, Any]) -> str | None:
    """Why the owner counts as live, or None when it is gone (the lock is stale)."""
    if owner.get("host") == socket.gethostname() and owner.get("boot_id") == _boot_id() and _boot_id():
        ticks = _start_ticks(int(owner.get("pid", -1)))
        if ticks is not None and ticks == owner.get("start_ticks"):
            return "that process is running on this host"
        return None
    age = time.time() - float(owner.get("renewed_at", 0))
    if age < float(owner.get("lease_s", LEASE_S)):
        return (f"it renewed its lease {max(age, 0):.0f} s ago (a lease lasts {owner.get('lease_s', LEASE_S):g} s; "
                f"its host is not this one, or this host rebooted since)")
    return None


class WriterLock:
    """This process's hold of one series' lock (see the module docstring)."""

    def __init__(self, path: Path, series: str):
        self.path = path
        self.series = series
        self.token = secrets.token_hex(8)
        self.lost: str | None = None   # why it is no longer ours, once known
        self.held = False                # whether it was ever ours
        self.holders: set[int] = set()   # ids of the live objects that took it
        self.forever = False             # taken without a holder: kept until the process exits
        self.pid = os.getpid()           # (a forked child never releases its parent's lock)

    # -- the file, always changed under flock of the inode the path names

    def _locked(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                _flock(fd, self.path)
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    return fd
            except FileNotFoundError:
                pass   # removed meanwhile by its releasing owner: open the new one
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @staticmethod
    def _read(fd: int) -> dict[str, Any] | None:
        data = os.pread(fd, 1 << 16, 0)
        try:
            owner = json.loads(data) if data.strip() else None
        except ValueError:
            return None   # a torn write of a process killed while writing: nobody's
        return owner if isinstance(owner, dict) else None

    @staticmethod
    def _write(fd: int, owner: dict[str, Any], sync: bool = True) -> None:
        data = json.dumps(owner, indent=1).encode()
        os.pwrite(fd, data, 0)   # in place: a full disk still has the blocks it had
        os.ftruncate(fd, len(data))
        if sync:
            os.fsync(fd)

    def take(self, what: str) -> None:
        """Take the lock, or check that it is still ours; CheckpointError naming the owner if
        another live process holds it (``what`` is the checkpoint about to be written)."""
        fd = self._locked()
        try:
            owner = self._read(fd)
            if owner is not None and owner.get("holder") == self.token:
                owner["renewed_at"] = time.time()
                self._write(fd, owner, sync=False)   # (a renewal: only other hosts read it)
                return
            if owner is not None and (self.held or self.lost):   # ours once: another took it over since
                self._lose(owner)
                raise CheckpointError(f"did not write the checkpoint {what}: {self.lost}")
            why = _liveness(owner) if owner is not None and not _is_this_process(owner) else None
            if why is not None:
                raise CheckpointError(self._refusal(what, owner, why))
            if owner is not None:
                logger.warning("took over the checkpoint lock %s from %s, which is gone", self.path,
                               describe_owner(owner))
            self._write(fd, _owner_record(self.token))
            self.held = True
        finally:
            os.close(fd)

    def _lose(self, owner: dict[str, Any] | None) -> None:
        self.lost = ("another process took over the checkpoint directory while this one was stopped or out "
                     f"of reach past its {LEASE_S:g} s lease" + (f" (now {describe_owner(owner)})" if owner else "")
                     + "; this process no longer writes there")

    def check(self, what: str) -> None:
        """Raise CheckpointError unless the lock is still ours (before a checkpoint is renamed into place)."""
        fd = self._locked()
        try:
            owner = self._read(fd)
            if owner is None:   # the file was removed by hand: nobody else holds it
                owner = _owner_record(self.token)
                self._write(fd, owner)
        finally:
            os.close(fd)
        if owner.get("holder") != self.token:
            self._lose(owner)
            raise CheckpointError(f"did not write the checkpoint {what}: {self.lost}")

    def renew(self) -> None:
        fd = self._locked()
        try:
            owner = self._read(fd)
            if owner is None and self.lost is None:   # removed by hand: still ours
                self._write(fd, _owner_record(self.token))
            elif owner is not None and owner.get("holder") == self.token:
                owner["renewed_at"] = time.time()
                self._write(fd, owner, sync=False)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        if os.getpid() != self.pid:
            return
        try:
            fd = self._locked()
        except OSError:
            return
        try:
            owner = self._read(fd)
            if owner is not None and owner.get("holder") == self.token:
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _refusal(self, what: str, owner: dict[str, Any], why: str) -> str:
        return (f"cannot write the checkpoint {what}: another process writes the {self.series!r} checkpoints "
                f"in {self.path.parent}: {describe_owner(owner)} ({self.path} names it, and {why}). Two jobs "
                f"writing one checkpoint directory would write over each other's checkpoints (did a job "
                f"manager restart a launcher whose tasks still run?). Stop that process, or give this job "
                f"another directory; the lock is taken over once its owner is gone.")


def hold_writer_lock(directory: "str | os.PathLike", series: str, holder: object = None,
                     what: str | None = None) -> WriterLock:
    """Take (or confirm) this process's lock of ``series`` in ``directory`` and return it.

    Held while ``holder`` lives (the Checkpoint that writes; None: until the process exits)
    or until released. Raises CheckpointError naming the owner when another live process
    holds it; OSError when the directory cannot be written (the caller words it).
    """
    path = lock_path(Path(directory).absolute(), series)
    with _held_lock:
        lock = _held.get(str(path))
        if lock is None:
            lock = _held[str(path)] = WriterLock(path, series)
    lock.take(what or str(path.parent / series))
    with _held_lock:
        if holder is None:
            lock.forever = True
        elif id(holder) not in lock.holders:
            lock.holders.add(id(holder))
            weakref.finalize(holder, _let_go, lock, id(holder))
        _start_renewer()
    return lock


def release_writer_lock(directory: "str | os.PathLike", series: str) -> None:
    """Release this process's lock of ``series`` in ``directory`` now (the series was deleted)."""
    path = lock_path(Path(directory).absolute(), series)
    with _held_lock:
        lock = _held.pop(str(path), None)
    if lock is not None:
        lock.release()


def _let_go(lock: WriterLock, holder_id: int) -> None:
    """A holder of ``lock`` is gone: release the lock when it was the last."""
    with _held_lock:
        lock.holders.discard(holder_id)
        if lock.holders or lock.forever or _held.get(str(lock.path)) is not lock:
            return
        del _held[str(lock.path)]
    lock.release()


def _renew_all() -> None:
    while True:
        time.sleep(RENEW_S)
        with _held_lock:
            locks = list(_held.values())
        for lock in locks:
            try:
                lock.renew()
            except OSError:   # a full or read-only disk: the next save says so
                pass


def _start_renewer() -> None:
    global _renewer
    if _renewer is None or not _renewer.is_alive():
        _renewer = threading.Thread(target=_renew_all, name="stratagem checkpoint lock lease", daemon=True)
        _renewer.start()


@atexit.register
def _release_all() -> None:
    with _held_lock:
        locks = list(_held.values())
        _held.clear()
    for lock in locks:
        try:
            lock.release()
        except Exception:   # noqa: BLE001 - at exit: a lock left behind is taken over as stale
            pass
