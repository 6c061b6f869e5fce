"""The life of a job on Ray: start the group, watch it, restart it whole, stop it.

:class:`RayJob` is the Ray counterpart of the local launcher's
:class:`~stratagem.launch.supervisor.Supervisor` for a group that restarts together::

    running --every task that runs the script exited 0--> done (servers are stopped)
    running --a task fails or its actor dies, restarts left--> stop every task, kill the
            actors --> a new group: placed again, new actors, new ports, STRATAGEM_RESTART=n
    running --a task exits 75 (preempted, its group saved)--> the same, without spending a
            restart (up to max_preemptions times; the next one fails the job with 75)
    running --a failure, no restarts left--> failed: every task is stopped; the status is the
            task's exit code (1 for a signal or a lost actor), and the message names it
    running --SIGINT / SIGTERM to the launcher--> every task stopped; 130 / 143
    running --a watched task not joined join_timeout s after the start--> stopped; 1

The first failure seen is blamed: a dead actor or a task killed by a signal before one that
exited with an error (likely a survivor that lost its peer), before a preemption.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Sequence

from stratagem.errors import ClusterConfigError
from stratagem.launch.joining import join_timeout_message
from stratagem.launch.output import TaskOutput
from stratagem.launch.ray_actor import NodeReport
from stratagem.launch.ray_group import RayGroup
from stratagem.launch.supervisor import EXIT_STATUS_ON_SIGNAL, describe_exit
from stratagem.launch.tasks import Task
from stratagem.preemption import PREEMPTED_EXIT_CODE

__all__ = ["RayJob"]

_POLL_SECONDS = 0.1

#: ``choose(reports, fresh)``: the token to send to the actors (``fresh`` or None); raises when unsafe.
ChooseToken = Callable[[Sequence[NodeReport], str], "str | None"]


def _exit_status(code: int | None) -> int:
    return code if code is not None and 1 <= code <= 255 else 1


def _blame_order(code: int | None) -> int:
    return 0 if code is None or code < 0 else 2 if code == PREEMPTED_EXIT_CODE else 1


class RayJob:
    """Runs one job's groups until it ends; :meth:`run` returns its exit status."""

    def __init__(self, tasks: Sequence[Task], make_group: Callable[[], RayGroup], choose_token: ChooseToken, *,
                 output: TaskOutput, max_restarts: int, max_preemptions: int, join_timeout: float,
                 cwd: str | None) -> None:
        self._tasks = list(tasks)
        width = max(len(f"[{task.name}]") for task in tasks)
        self._prefixes = [f"[{task.name}]".ljust(width) + " " for task in tasks]
        self._make_group, self._choose_token = make_group, choose_token
        self._output, self._cwd = output, cwd
        self._max_restarts, self._max_preemptions = max_restarts, max_preemptions
        self._restarts = self._preemptions = 0
        self._starts = 0        # the group's starts so far (STRATAGEM_RESTART of the next one)
        self._join_timeout = join_timeout
        self._ps_mode = not all(task.runs_script for task in tasks)
        watched = [i for i, task in enumerate(tasks) if task.runs_script]
        self._watched = watched if self._ps_mode or len(watched) > 1 else []
        self._token = secrets.token_urlsafe(32)   # the job's own, if the nodes hold none; never printed
        self._signals: list[int] = []
        self._group: RayGroup | None = None
        self._finished: set[int] = set()
        self._joined: set[int] = set()
        self._ever_joined = False

    def interrupt(self, signum: int) -> None:
        """Called by a signal handler: stop the job."""
        self._signals.append(signum)

    @property
    def interrupted(self) -> bool:
        """Whether the launcher got SIGINT or SIGTERM (placing the tasks stops waiting then)."""
        return bool(self._signals)

    def run(self) -> int:
        try:
            try:
                self._start()   # the first start's errors go to the caller: nothing ran yet
            except InterruptedError:   # a signal while placing: nothing started
                pass
            while True:
                if self._signals:
                    name = signal.Signals(self._signals[0]).name
                    self._output.say(f"received {name}; stopping {self._group.running()} task(s)")
                    return EXIT_STATUS_ON_SIGNAL.get(self._signals[0], 128 + self._signals[0])
                status = self._on_events(self._group.poll(_POLL_SECONDS))
                if status is None:
                    status = self._check_joining()
                if status is not None:
                    return status
        finally:
            if self._group is not None:
                self._group.stop()

    def _start(self) -> None:
        group = self._make_group()
        self._group = group
        group.place()
        token = self._choose_token(group.reports, self._token)
        group.start(self._starts, token, self._cwd)
        self._starts += 1
        self._finished, self._joined = set(), set()

    # -- what the tasks did ------------------------------------------------------------------

    def _on_events(self, events: list) -> int | None:
        exits: list[tuple[int, int | None, str | None]] = []
        for event in events:
            self._output.write(self._prefixes[event.index], event.lines)
            if event.joined:
                self._joined.add(event.index)
                self._ever_joined = True
            if event.died is not None or event.code is not None:
                exits.append((event.index, event.code, event.died))
        for index, code, _ in exits:
            if code == 0:
                self._finished.add(index)
                if not self._tasks[index].runs_script:
                    self._output.say(f"{self._tasks[index].name} exited with code 0 before the job ended")
        failures = [exit for exit in exits if exit[1] != 0]
        if failures:
            return self._on_failure(*min(failures, key=lambda failure: _blame_order(failure[1])))
        if all(i in self._finished for i, task in enumerate(self._tasks) if task.runs_script):
            self._warn_if_never_joined()
            return 0
        return None

    def _on_failure(self, index: int, code: int | None, died: str | None) -> int | None:
        name = self._tasks[index].name
        what = f"'s Ray actor died ({died})" if died is not None else f" {describe_exit(code)}"
        count = len(self._tasks)
        if code == PREEMPTED_EXIT_CODE and self._preemptions < self._max_preemptions:
            self._preemptions += 1
            self._output.say(
                f"the tasks stopped for preemption ({name} exited with code {code}: the group agreed on a "
                f"step and saved); restarting all {count} tasks (preemption {self._preemptions}/"
                f"{self._max_preemptions}; a preemption does not count against --max-restarts)")
        elif code == PREEMPTED_EXIT_CODE:
            self._output.say(
                f"{name} stopped for preemption again (exit code {code}) after {self._preemptions} preemption "
                f"restart(s), the most --max-preemptions ({self._max_preemptions}) allows; not restarting, "
                f"stopping the other task(s)")
            return code
        elif self._restarts < self._max_restarts:
            self._restarts += 1
            self._output.say(f"{name}{what}; restarting all {count} tasks "
                             f"(restart {self._restarts}/{self._max_restarts})")
        else:
            after = f" (after {self._restarts} restart(s))" if self._restarts else ""
            failed = (f"{name} failed: its Ray actor died ({died}){after}" if died is not None
                      else f"{name} failed with exit code {code}{after}" if code > 0
                      else f"{name} failed: {describe_exit(code).removeprefix('was ')}{after}")
            others = self._group.running()
            self._output.say(f"{failed}; stopping {others} other task(s)" if others > 0 else failed)
            return _exit_status(code)
        seen = time.monotonic()
        self._group.stop()
        if self._signals:
            return None   # the launcher itself is being stopped: run() reports it
        try:
            self._start()
        except InterruptedError:
            return None   # the launcher itself is being stopped: run() reports it
        except (ClusterConfigError, OSError) as error:
            self._output.say(f"cannot start the tasks again: {error}")
            return _exit_status(code)
        self._output.say(f"started all {count} tasks again with a new rendezvous "
                         f"(STRATAGEM_RESTART={self._starts - 1}) {time.monotonic() - seen:.1f} s after the "
                         "exit was seen")
        return None

    # -- joining --------------------------------------------------------------------------------

    def _check_joining(self) -> int | None:
        if not self._join_timeout or not self._watched:
            return None
        if time.monotonic() - self._group.started_at < self._join_timeout:
            return None
        late = [self._tasks[i].name for i in self._watched if i not in self._joined and i not in self._finished]
        if not late:
            return None
        self._output.say(join_timeout_message(late, [], timeout=self._join_timeout, coordinator=self._ps_mode,
                                              running=self._group.running()))
        return 1

    def _warn_if_never_joined(self) -> None:
        trained = [task for task in self._tasks if task.runs_script]
        if not self._ps_mode and len(trained) > 1 and not self._ever_joined:
            self._output.say(
                f"warning: the {len(trained)} tasks never formed a cluster: each ran the script on its own, "
                f"so this was {len(trained)} independent trainings, not one distributed training. Create the "
                "strategy with sg.MultiWorkerMirroredStrategy() in the script (it reads the TF_CONFIG the "
                "launcher sets).")
