"""The launcher's hang timeout: a job whose tasks stopped making progress is located, then stopped.

Each task that joined its cluster touches ``progress/<task>`` in the job's observe folder
whenever its flight recorder moved (a step began, a collective ended; see
:mod:`stratagem.observe.answer`). :class:`HangWatch` looks at those files: once any task has
made progress, a job in which *no* task made any for ``timeout`` seconds is hung
(``stratagem launch --hang-timeout``). The launcher then asks every task where it stands
(:mod:`stratagem.observe.hang_report`), prints per task its last completed collective, the
collective it waits in and its line of the script -- or why it did not answer, from
``/proc`` -- writes the full stacks to a file the message names, and stops the job.

Example::

    import os, tempfile, time
    from stratagem.launch.hang_watch import HangWatch
    folder = tempfile.mkdtemp()
    watch = HangWatch(folder, timeout=0.05)
    assert not watch.hung()                  # nothing made progress yet: not armed
    os.makedirs(os.path.join(folder, "progress"))
    open(os.path.join(folder, "progress", "worker-0"), "w").close()
    assert not watch.hung()                  # progress just now
    time.sleep(0.1)
    assert watch.hung()
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from stratagem.observe import hang_report

__all__ = ["HangWatch", "hang_message"]

_LOOK_SECONDS = 0.5   # how often the progress files are read


class HangWatch:
    """Whether the tasks' progress stopped for ``timeout`` seconds (never when ``timeout`` is 0)."""

    def __init__(self, folder: str | os.PathLike[str], timeout: float) -> None:
        self.folder, self.timeout = folder, timeout
        self.restart()

    def restart(self) -> None:
        """The tasks started (again): watch from their first progress on."""
        self._stamps: dict[str, int] = self._read()
        self._moved: float | None = None   # time.monotonic() of the last progress seen
        self._looked = 0.0

    def _read(self) -> dict[str, int]:
        folder = os.path.join(self.folder, "progress")
        stamps = {}
        try:
            for name in os.listdir(folder):
                try:
                    stamps[name] = os.stat(os.path.join(folder, name)).st_mtime_ns
                except OSError:
                    continue
        except OSError:
            pass
        return stamps

    def hung(self) -> bool:
        if not self.timeout:
            return False
        now = time.monotonic()
        if now - self._looked >= _LOOK_SECONDS or self._moved is None:
            self._looked = now
            stamps = self._read()
            if stamps != self._stamps:
                self._stamps, self._moved = stamps, now
        return self._moved is not None and now - self._moved >= self.timeout

    def message(self, tasks: Mapping[str, int], running: int) -> str:
        """What the launcher says when :meth:`hung`: where each of ``tasks`` (name: pid) stands."""
        idle = 0.0 if self._moved is None else time.monotonic() - self._moved
        return hang_message(self.folder, tasks, idle=idle, timeout=self.timeout, running=running)


def hang_message(folder: str | os.PathLike[str], tasks: Mapping[str, int], *, idle: float, timeout: float,
                 running: int) -> str:
    """The launcher's message for a hung job: asks ``tasks`` (name: pid), describes, writes the stacks."""
    answers = hang_report.ask(folder, tasks)
    silent = hang_report.silent_reasons(folder, tasks, answers)
    path = hang_report.write_stacks(answers, silent)
    lines = hang_report.describe(answers, silent).splitlines()
    return (f"no task made progress (a step, a collective) for {idle:.0f} s (--hang-timeout {timeout:g}); "
            f"where each task stands:\n" + "".join(f"  {line}\n" for line in lines)
            + f"  the full stacks of every thread: {path}\n"
            f"stopping {running} task(s), not restarting. If the job is only slow between steps (a long "
            "evaluation or checkpoint without collectives), raise --hang-timeout (0 never stops it)")
