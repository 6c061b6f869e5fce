"""What keeps a checkpoint directory's checkpoints what their names say, with real processes.

- two live processes writing one directory (a launcher restarted while its tasks still run):
  the second is refused, naming the first; once the first is SIGKILLed the next one takes over;
- a lock left by a process that is gone (a reused pid, an expired lease of another host) is
  taken over; a writer whose lock was taken over while it was away stops instead of writing;
- checkpoint directories swapped by hand (ckpt-2 <-> ckpt-3) are refused, not restored under
  the other's name;
- a read-only or full file system: CheckpointError naming the path, and the previous checkpoint
  restores (each in a mount namespace of its own, on a 1 MiB tmpfs: root and mount needed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import writer_lock
from stratagem.testing import start_task

pytestmark = pytest.mark.timeout(180)
SCRIPT = Path(__file__).with_name("directory_script.py")
REPO = Path(sg.__file__).resolve().parent.parent


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}


class Writer:
    """A directory_script.py process whose output lines the test reads as they come (from its log
    file): forked from the test fork server, or started fresh behind ``prefix`` (``unshare ...``)."""

    def __init__(self, mode: str, directory: Path, prefix: tuple[str, ...] = ()):
        self.lines: list[str] = []
        handle, self.log = tempfile.mkstemp(prefix="directory-script-", suffix=".log")
        os.close(handle)
        self._read = 0   # bytes of the log already split into lines
        self.proc = start_task([*prefix, sys.executable, str(SCRIPT), mode, str(directory)], env=env(), log=self.log)

    def _next_line(self) -> str | None:
        with open(self.log, "rb") as file:
            file.seek(self._read)
            line = file.readline()
        if not line.endswith(b"\n"):
            return None   # (nothing new, or a line still being written)
        self._read += len(line)
        return line.decode(errors="replace").rstrip("\n")

    def wait_for(self, prefix: str, timeout: float = 90.0) -> str:
        """The next line that starts with ``prefix`` (skipping others); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self._next_line()
            if line is None:
                if self.proc.poll() is not None and self._next_line() is None:
                    break   # it exited, and every line it wrote has been read
                time.sleep(0.02)
                continue
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        rest = Path(self.log).read_bytes()[self._read:].decode(errors="replace")
        self.kill()
        pytest.fail(f"no {prefix!r} line (exit {self.proc.poll()}); output:\n" + "\n".join(self.lines) + rest)

    def result(self, prefix: str = "RESULT ") -> dict:
        return json.loads(self.wait_for(prefix)[len(prefix):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        Path(self.log).unlink(missing_ok=True)


@pytest.fixture
def writers():
    started: list[Writer] = []

    def start(mode: str, directory: Path, prefix: tuple[str, ...] = ()) -> Writer:
        started.append(Writer(mode, directory, prefix))
        return started[-1]

    yield start
    for writer in started:
        writer.kill()


def saved_by(path: Path) -> int:
    """The pid of the process that wrote the checkpoint ``path`` (verified, as a restore does)."""
    ckpt = sg.Checkpoint(model=torch.nn.Linear(16, 16), writer=0, step=0)
    ckpt.restore(path)
    return ckpt.writer


# ------------------------------------------------------------------ two writers, one directory


@pytest.mark.multiprocess
def test_a_second_live_writer_is_refused_naming_the_first_until_it_is_killed(tmp_path: Path, writers) -> None:
    first = writers("writer", tmp_path)
    first.wait_for("SAVED")
    first.wait_for("SAVED")
    second = writers("once", tmp_path)   # a second group: a relaunched job, the first still training
    refusal = json.loads(second.wait_for("REFUSED ")[len("REFUSED "):])
    assert second.proc.wait(timeout=30) == 3
    message = refusal["message"]
    assert refusal["type"] == "CheckpointError"
    assert message.startswith(f"cannot write the checkpoint {tmp_path}/ckpt-"), message
    assert f"another process writes the 'ckpt-N' checkpoints in {tmp_path}: pid {first.proc.pid} on host " \
           f"{socket.gethostname()!r}" in message, message
    assert "directory_script.py" in message and "that process is running on this host" in message
    assert "Stop that process, or give this job another directory" in message

    first.wait_for("SAVED")             # the first goes on, untouched
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    written = sorted((p for p in tmp_path.glob("ckpt-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    assert written and all(saved_by(path) == first.proc.pid for path in written)   # nothing of the second's

    third = writers("once", tmp_path)   # the first is gone: its lock is taken over
    path = Path(third.wait_for("SAVED ")[len("SAVED "):])
    assert third.proc.wait(timeout=30) == 0
    assert path.name == f"ckpt-{len(written) + 1}" and saved_by(path) == third.proc.pid
    assert "took over the checkpoint lock" in "\n".join(third.lines)
    assert not list(tmp_path.glob("*.tmp-*"))   # what the killed one left half-written: removed
    assert not (tmp_path / ".ckpt-N.lock").exists()   # released when it exited


def forge(directory: Path, **owner) -> Path:
    """A lock file as another process would have left it."""
    record = {"host": socket.gethostname(), "boot_id": writer_lock._boot_id(), "pid": 1, "start_ticks": 1,
              "started": None, "task": "chief 0", "command": "train.py", "renewed_at": time.time(),
              "lease_s": 60.0, "holder": "f" * 16, **owner}
    path = writer_lock.lock_path(directory, "ckpt-N")
    path.write_text(json.dumps(record))
    return path


def test_a_stale_lock_is_taken_over_and_a_live_lease_is_not(tmp_path: Path) -> None:
    ckpt = sg.Checkpoint(model=torch.nn.Linear(2, 2))
    manager = sg.CheckpointManager(ckpt, tmp_path)
    # pid 1 is alive, but it started at another time than the lock says: a reused pid
    forge(tmp_path, start_ticks=writer_lock._start_ticks(1) + 12345)
    assert manager.save().endswith("ckpt-1")
    del ckpt, manager   # (its lock is released with it)
    ckpt = sg.Checkpoint(model=torch.nn.Linear(2, 2))
    manager = sg.CheckpointManager(ckpt, tmp_path)
    forge(tmp_path, start_ticks=writer_lock._start_ticks(1))   # pid 1 itself: alive
    with pytest.raises(sg.errors.CheckpointError, match=r"pid 1 on host .* \(chief 0\), running 'train.py' .*"
                       r"that process is running on this host"):
        manager.save()
    forge(tmp_path, host="other-host", boot_id="x")   # another host, its lease renewed just now
    with pytest.raises(sg.errors.CheckpointError, match=r"on host 'other-host' .* it renewed its lease 0 s ago"):
        manager.save()
    forge(tmp_path, host="other-host", boot_id="x", renewed_at=time.time() - 61)   # the lease ran out
    assert manager.save().endswith("ckpt-2")
    assert manager.checkpoints == [str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2")]


@pytest.mark.multiprocess
def test_a_writer_whose_lock_was_taken_over_stops_instead_of_writing(tmp_path: Path, writers) -> None:
    # a writer out of reach (a stopped process on another host) past its lease: another took over
    first = writers("writer", tmp_path)
    first.wait_for("SAVED")
    lock = writer_lock.WriterLock(writer_lock.lock_path(tmp_path, "ckpt-N"), "ckpt-N")
    fd = lock._locked()
    try:
        lock._write(fd, {**json.loads(os.pread(fd, 1 << 16, 0)), "holder": "new-owner", "host": "other-host",
                         "pid": 4242, "renewed_at": time.time()})
    finally:
        os.close(fd)
    refusal = json.loads(first.wait_for("REFUSED ")[len("REFUSED "):])
    assert first.proc.wait(timeout=30) == 3
    assert refusal["message"].startswith(f"did not write the checkpoint {tmp_path}/ckpt-"), refusal
    assert "another process took over the checkpoint directory" in refusal["message"]
    assert "pid 4242 on host 'other-host'" in refusal["message"]
    assert not list(tmp_path.glob("*.tmp-*"))   # its unfinished write removed


# ----------------------------------------------------------------------- swapped directories


@pytest.mark.multiprocess
def test_swapped_checkpoint_directories_are_refused_not_restored_under_the_other_name(tmp_path: Path,
                                                                                      writers) -> None:
    saving = writers("save3", tmp_path)
    for _ in range(3):
        saving.wait_for("SAVED")
    assert saving.proc.wait(timeout=30) == 0
    os.rename(tmp_path / "ckpt-2", tmp_path / "swap")
    os.rename(tmp_path / "ckpt-3", tmp_path / "ckpt-2")
    os.rename(tmp_path / "swap", tmp_path / "ckpt-3")

    result = writers("resume", tmp_path).result()
    assert result["path"] == str(tmp_path / "ckpt-1") and result["step"] == 1 and result["weight"] == [1.0]
    assert len(result["warnings"]) == 2, result   # ckpt-3, then ckpt-2: each is the other
    for name, saved in (("ckpt-3", "ckpt-2"), ("ckpt-2", "ckpt-3")):
        assert any(f"checkpoint {tmp_path / name} cannot be restored" in w and
                   f"asked for '{name}', found the checkpoint saved as '{saved}' (save {saved[-1]} of job " in w
                   for w in result["warnings"]), result
    assert result["direct"]["type"] == "CheckpointError"
    assert result["direct"]["message"].startswith(
        f"checkpoint {tmp_path / 'ckpt-3'}: manifest.json: asked for 'ckpt-3', found the checkpoint saved as "
        f"'ckpt-2' (save 2 of job "), result["direct"]
    assert "Rename it back to 'ckpt-2'" in result["direct"]["message"]

    # a copy under another name is refused too, unless the restore says which checkpoint it is
    shutil.copytree(tmp_path / "ckpt-3", tmp_path / "ckpt-2-copy")
    ckpt = sg.Checkpoint(model=torch.nn.Linear(16, 16), step=0)
    with pytest.raises(sg.errors.CheckpointError, match=r"asked for 'ckpt-2-copy', found the checkpoint saved as "
                                                         r"'ckpt-2' .* restore\(path, saved_as='ckpt-2'\)"):
        ckpt.restore(tmp_path / "ckpt-2-copy")
    ckpt.restore(tmp_path / "ckpt-2-copy", saved_as="ckpt-2")
    assert ckpt.step == 2


# ------------------------------------------------------------------- read-only and full disks


def run_on_tmpfs(mode: str, tmp_path: Path, writers) -> dict:
    directory = tmp_path / "mnt"
    directory.mkdir()
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "-o",
                            "size=1m", "probe", str(directory)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs root and mount namespaces to mount a small tmpfs: {probe.stderr.strip()}")
    return writers(mode, directory, ("unshare", "--mount", "--propagation", "private")).result()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, why", [("readonly", "Read-only file system [EROFS]"),
                                       ("full", "No space left on device [ENOSPC]")])
def test_a_read_only_or_full_file_system_says_so_and_keeps_the_previous_checkpoint(
        tmp_path: Path, writers, mode: str, why: str) -> None:
    result = run_on_tmpfs(mode, tmp_path, writers)
    directory = tmp_path / "mnt"
    for name, target in (("manager", "ckpt-2"), ("direct", "ckpt-9"), ("background", "other")):
        error = result[name]
        assert error is not None and error["type"] == "CheckpointError", result
        assert f"cannot write the checkpoint {directory / target}: {why}" in error["message"], error
        assert f"Nothing was replaced: the checkpoints already in {directory} are intact." in error["message"]
    checkpoints = [name for name in result["listing"] if not name.startswith(".")]
    assert checkpoints == (["ckpt-1"] if mode == "readonly" else ["ckpt-1", "filler"]), result
    assert result["restored"] == str(directory / "ckpt-1") and result["restored_step"] == 1, result
    assert result["restored_equal"], result
    if mode == "full":
        assert result["after"] == str(directory / "ckpt-2")   # room again: saving works
