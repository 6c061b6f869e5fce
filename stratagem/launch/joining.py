"""The launcher's join timeout: a job whose tasks never join their cluster is stopped.

A task *joins* its cluster when it marks the launcher's joined folder
(:mod:`stratagem.cluster.joined`): a multi-worker task once its
``sg.MultiWorkerMirroredStrategy()`` has met the other workers (its process group is
formed), the coordinator of parameter-server training once its
``sg.ParameterServerStrategy`` has reached every parameter server. A task that hangs
*before* that point — a deadlock, a data set that never loads, a process stopped by
SIGSTOP — hangs the job with nobody to notice: the other workers' timeouts start only once
they are at the rendezvous themselves, and when every task hangs before it, nothing ever
fails. :class:`JoinWatch` is the launcher's own bound: each watched process must join within
``timeout`` seconds of its start, or the job is stopped, naming the tasks that did not.

Which tasks are watched (the launcher decides): in collective training every task of a
group of two or more (a lone worker has nobody to join); in parameter-server training the
coordinator (the servers wait for it by design). An evaluator is never watched.

Example::

    import tempfile
    from stratagem.cluster.joined import JOINED_VARIABLE, mark_joined
    from stratagem.launch.joining import JoinWatch
    folder = tempfile.mkdtemp()
    watch = JoinWatch(folder, timeout=0.0)
    watch.started("worker 0"); watch.started("worker 1")
    import os; os.environ[JOINED_VARIABLE] = folder
    mark_joined("worker 0")                  # what the task's strategy does
    del os.environ[JOINED_VARIABLE]
    assert watch.late(["worker 0", "worker 1"]) == ["worker 1"]
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from stratagem.cluster.joined import mark_stamp

__all__ = ["JoinWatch", "join_timeout_message"]


class JoinWatch:
    """Which watched task processes have joined, and which are late (``timeout`` seconds)."""

    def __init__(self, folder: str | os.PathLike[str], timeout: float) -> None:
        self.folder, self.timeout = folder, timeout
        self._pending: dict[str, tuple[float, tuple[int, int] | None]] = {}   # name: (start, stamp then)

    def started(self, name: str) -> None:
        """A new process of task ``name`` started: it must join within the timeout."""
        self._pending[name] = (time.monotonic(), mark_stamp(self.folder, name))

    def joined(self, name: str) -> bool:
        """Whether the current process of ``name`` joined (True for a task not watched)."""
        if name not in self._pending:
            return True
        stamp = mark_stamp(self.folder, name)
        if stamp is not None and stamp != self._pending[name][1]:
            del self._pending[name]   # marked since it started
            return True
        return False

    def late(self, running: Sequence[str]) -> list[str]:
        """Once one of ``running`` (the tasks still running) is late: every one not joined yet.

        Empty while none is late. The tasks of a group start within moments of each other:
        when the first is late, the others not joined are named with it.
        """
        now = time.monotonic()
        waiting = [name for name in running if not self.joined(name)]
        if any(now - self._pending[name][0] >= self.timeout for name in waiting):
            return waiting
        return []


def join_timeout_message(late: Sequence[str], stopped: Sequence[str], *, timeout: float,
                         coordinator: bool, running: int) -> str:
    """The launcher's message when ``late`` tasks did not join within ``timeout`` seconds."""
    names = ", ".join(late)
    if coordinator:
        what = ("the coordinator joins once its sg.ParameterServerStrategy"
                "(sg.cluster.TFConfigClusterResolver()) has reached every parameter server")
    else:
        what = ("a task joins once its sg.MultiWorkerMirroredStrategy() has met the other "
                "workers (a script that trains without one never joins)")
    halted = "".join(f"; {name} is stopped (SIGSTOP or a debugger)" for name in stopped)
    return (f"{names} did not join the cluster within {timeout:g} s of starting (--join-timeout){halted}: "
            f"{what}; stopping {running} task(s), not restarting. Something before the strategy "
            "hangs (a deadlock, input that never arrives, a stopped process); if the start is only "
            "slow, raise --join-timeout (0 waits for ever)")
