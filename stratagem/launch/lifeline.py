"""Tasks die with their launcher, however it dies: a reaper process and a parent-death signal.

Every task of ``stratagem launch`` runs in a session of its own, so that one signal to its
process group stops the task and the children it started (data-loader workers, a
subprocess). A session of its own also means that nothing ties the task to the launcher:
a launcher killed with SIGKILL (or by the OOM killer) cannot stop its tasks, and they
would go on training; a job manager that then starts the launcher again would have two
groups writing one checkpoint directory. Two mechanisms close that gap:

- **The reaper** (:class:`Reaper`; portable, whole process groups). Each launch starts one
  small process (this file run as a script: the standard library only, so it starts in
  milliseconds), in a session of its own so that Ctrl-C at a terminal or a signal to the
  launcher's process group does not reach it. It reads a pipe whose other end only the
  launcher holds; the launcher writes each task's process group to it when the task starts
  and again when the group is gone. When the pipe reaches end-of-file, the launcher has
  exited: whatever groups it has not said are gone get SIGTERM, up to the grace period to
  exit, then SIGKILL, and the reaper exits. (The tasks' output went to the launcher: a task
  that prints after its death gets a broken pipe. A job stopped with SIGTERM, not SIGKILL,
  keeps its output and the tasks' chance to save.) When the launcher ends
  normally it has stopped and forgotten every group, and the reaper exits at once.
- **A parent-death signal** (Linux, :func:`die_with_parent`). Each task is started with
  ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, so that the kernel sends the task itself SIGTERM
  when the launcher dies. It covers the moment between starting a task and telling the
  reaper, and a reaper killed together with the launcher. It reaches the task only, not its
  children (the setting is not inherited), which is why the reaper exists.

The kernel sends the parent-death signal when the *thread* that started the task ends:
the tasks are started by the thread that runs the launch, which outlives them (it stops
them before it returns). A child that leaves its task's process group (``setsid``) is out
of reach of both, as it is of the launcher's own stop.

A group id is a process id, and ids are reused: the reaper signals a group only while the
process with that id is the one the launcher started (same start time in ``/proc``) or
is gone (then the id still names the old group's remaining members, if any).

Example::

    import subprocess, sys, time
    from stratagem.launch.lifeline import Reaper, die_with_parent
    reaper = Reaper(grace_period=1.0)
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True, preexec_fn=die_with_parent())
    reaper.watch(task.pid)
    task.kill(); task.wait()
    reaper.forget(task.pid)
    reaper.close()          # nothing left to stop: the reaper exits at once
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["Reaper", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.05
_CLOSE_SECONDS = 5.0   # how long close() waits for a reaper with nothing to stop

if sys.platform.startswith("linux"):
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
else:   # no parent-death signal: the reaper alone stops the tasks
    _prctl = None


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``signum`` when this process dies (Linux).

    Give it to :class:`subprocess.Popen` from a thread that lives as long as the child must
    (the kernel signals on the death of the starting thread). If this process died before
    the setting took effect, the child exits at once. None where the platform has no
    parent-death signal.
    """
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:   # in the child, between fork and exec: no allocation-heavy work
        _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:   # the parent died before the line above: nobody will tell us
            os._exit(1)
    return preexec


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


class Reaper:
    """The launcher's side of the reaper: tells it which process groups to stop if we die.

    ``grace_period``: seconds between SIGTERM and SIGKILL when it stops them. ``on_lost``
    is called once with a message if the reaper cannot be told (it exited): the tasks'
    own parent-death signal still stops them, but not their children.
    """

    def __init__(self, grace_period: float, *, on_lost: Callable[[str], None] | None = None) -> None:
        self._on_lost = on_lost
        self._lost = False
        # -I: no user site, no PYTHON* variables, no script folder on sys.path (this folder's
        # modules must not shadow the standard library's); stdout is not needed.
        self._process = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), repr(float(grace_period)), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, bufsize=0)

    def watch(self, pgid: int) -> None:
        """Stop process group ``pgid`` if this process dies (call it right after starting it)."""
        self._send(f"+{pgid} {_start_time(pgid) or '-'}\n")

    def forget(self, pgid: int) -> None:
        """Group ``pgid`` is gone (killed and its leader waited for): never signal it."""
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        """Ends the reaper: it stops the groups not forgotten (none, normally) and exits."""
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:  # it is stopping groups left behind: let it finish
            pass

    def _send(self, line: str) -> None:
        if self._lost:
            return
        try:
            self._process.stdin.write(line.encode())
        except (OSError, ValueError) as error:
            self._lost = True
            if self._on_lost is not None:
                self._on_lost(
                    f"the launcher's reaper process exited ({type(error).__name__}; its exit status "
                    f"{self._process.poll()}): if the launcher is killed with SIGKILL now, its tasks "
                    "still get SIGTERM (Linux), but their children are not stopped")


# -- the reaper process (``python -I lifeline.py GRACE LAUNCHER_PID``) ------------------------

def _ours(pgid: int, start: str) -> bool:
    """Whether group ``pgid`` is still the one the launcher started (its id was not reused)."""
    now = _start_time(pgid)
    return now is None or start == "-" or now == start


def _signal(groups: dict[int, str], signum: int) -> list[int]:
    """Sends ``signum`` to each group still ours; returns those that had a process."""
    reached = []
    for pgid, start in groups.items():
        if _ours(pgid, start):
            try:
                os.killpg(pgid, signum)
                reached.append(pgid)
            except (ProcessLookupError, PermissionError):
                pass
    return reached


def _reap(grace_period: float, launcher: int) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    groups: dict[int, str] = {}
    for line in sys.stdin.buffer:   # until end-of-file: the launcher has exited
        fields = line.decode().split()
        if fields and fields[0].startswith("+"):
            groups[int(fields[0][1:])] = fields[1]
        elif fields and fields[0].startswith("-"):
            groups.pop(int(fields[0][1:]), None)
    live = _signal(groups, signal.SIGTERM)
    if not live:
        return
    with contextlib.suppress(OSError, ValueError):
        print(f"[launch] the launcher (pid {launcher}) exited without stopping its tasks (was it "
              f"killed?); stopping {len(live)} task(s) and their children: SIGTERM, then SIGKILL "
              f"after {grace_period:g} s", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_period
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        live = _signal({pgid: groups[pgid] for pgid in live}, 0)
    _signal(groups, signal.SIGKILL)


if __name__ == "__main__":
    _reap(float(sys.argv[1]), int(sys.argv[2]))
