"""The supervisor of a local launch: start every task, watch them, restart, stop.

:class:`Supervisor` runs one job's processes until the job ends and returns its exit
status. How a failure is answered depends on the kind of training.

**Collective training** (no parameter servers: every task runs the script and they form
one torch.distributed group). A group cannot lose a member and go on, and a new process
must never meet the old group's store or peers, so restarts are group-wide::

    running --every task exited 0--> done
    running --a task fails, restarts left--> stop every task --> start every task again
            (restart n: fresh ports, STRATAGEM_RESTART=n) --> running
    running --a task exits 75 (preempted: the group agreed to stop and saved)-->
            stop every task --> start every task again, without spending a restart
            (up to max_preemptions times; the next one fails the job with status 75)
    running --a task fails, no restarts left--> failed: every task is stopped

Preemption restarts have their own budget, ``max_preemptions``, because they are free
of ``max_restarts``: a script that exits 75 at every start (a SIGTERM that keeps coming,
or a bug that exits through the preemption path) would otherwise restart for ever.

The first task seen failing is blamed (one killed by a signal before one that exited
with an error, which may just be a survivor that lost its peer); the others' exits
belong to the stopped group and spend nothing. Tasks that had already finished run
again too: a script that resumes from its checkpoint finds its work done.

**Parameter-server training** (only the chief, the coordinator, runs the script): each
server restarts on its own with the same TF_CONFIG and port, since the coordinator
copes with a lost server; the job ends when the coordinator ends. A server that fails
beyond its restarts is reported and the coordinator decides.

**An evaluator** (TensorFlow's sidecar evaluation) watches training without taking part
in it: a group restart leaves it running, and a failure of it does not stop training but
fails the job at the end. Once training has succeeded the evaluator gets up to
``evaluator_timeout`` seconds to exit (after evaluating the last checkpoint); the job
succeeds when it exits 0::

    training done --evaluator exits 0--> done
    training done --evaluator exits != 0, or is still running after the timeout--> failed

**Stopping** means SIGTERM to each task's process group (a task's own children go too),
up to ``grace_period`` seconds for the tasks to exit, then SIGKILL to the groups. A
task that is stopped (SIGSTOP, or a debugger) cannot act on SIGTERM and is killed at
once. SIGINT or SIGTERM sent to the launcher (:meth:`Supervisor.interrupt`) stop the
job the same way, with status 130 or 143; a signal that comes while the tasks are being
stopped skips the rest of the grace period.

**Tied to the launcher**: each task gets SIGTERM from the kernel if the launcher dies, and a
reaper process stops every task's process group (SIGTERM, the grace period, SIGKILL) once
the launcher has exited without doing it itself (SIGKILL, the OOM killer): ``lifeline.py``.

**The join timeout** (``join_timeout`` seconds, 0 for none): a watched task still running
without having joined its cluster that long after its start stops the job with status 1,
naming it (``joining.py`` says which tasks are watched and what joining means). The job
is not restarted: a start that hangs before its strategy would most likely hang again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stratagem.errors import ClusterConfigError
from stratagem.launch.hang_watch import HangWatch
from stratagem.launch.joining import JoinWatch, join_timeout_message
from stratagem.launch.forks import ForkedProcess, start_process
from stratagem.launch.lifeline import Reaper
from stratagem.launch.output import TaskOutput
from stratagem.launch.tasks import Task
from stratagem.preemption import PREEMPTED_EXIT_CODE

__all__ = ["EXIT_STATUS_ON_SIGNAL", "Supervisor", "blame_order", "describe_exit"]

_POLL_SECONDS = 0.05
_READER_JOIN_SECONDS = 1.0
EXIT_STATUS_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}

#: ``environments(n)``: every task's environment for the group's ``n``-th start (0 first).
Environments = Callable[[int], list[dict[str, str]]]


def describe_exit(code: int) -> str:
    """``"exited with code 3"``, or ``"was killed by SIGKILL"`` for a negative ``code``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _exit_status(code: int) -> int:
    """The launcher's status for a task's failure: its exit code if 1..255, else 1."""
    return code if 1 <= code <= 255 else 1


def blame_order(code: int) -> int:
    """Which of several exits seen at once caused the others: lower comes first."""
    return 0 if code < 0 else 2 if code == PREEMPTED_EXIT_CODE else 1


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)  # start_new_session=True: the task's pid is its group's id


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t on Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


@dataclass
class _Slot:
    """A task and its current process."""

    task: Task
    env: dict[str, str]
    prefix: str
    process: subprocess.Popen[bytes] | ForkedProcess | None = None
    reader: threading.Thread | None = None
    restarts: int = 0       # parameter-server training: this task's own restarts
    finished: bool = False  # exited and not to be restarted


class Supervisor:
    """Supervises the processes of one job; :meth:`run` returns the job's exit status."""

    def __init__(self, tasks: Sequence[Task], environments: Environments, *, max_restarts: int,
                 output: TaskOutput, grace_period: float, max_preemptions: int = 100,
                 evaluator_timeout: float = 600.0, join_timeout: float = 0.0,
                 joined_folder: str | None = None, observe_folder: str | None = None,
                 hang_timeout: float = 0.0) -> None:
        width = max(len(f"[{task.name}]") for task in tasks)
        slots = [_Slot(task, env, f"[{task.name}]".ljust(width) + " ")
                 for task, env in zip(tasks, environments(0))]
        self._slots = [slot for slot in slots if slot.task.trains]   # training: the group or the servers
        self._evaluators = [slot for slot in slots if not slot.task.trains]
        self._evaluator_timeout = evaluator_timeout
        self._evaluator_status = 0   # the first evaluator failure's exit status
        self._environments = environments
        self._ps_mode = not all(task.runs_script for task in tasks)
        self._max_restarts = max_restarts
        self._restarts = 0     # collective training: the group's restarts after failures
        self._max_preemptions = max_preemptions
        self._preemptions = 0  # collective training: the group's restarts after preemptions
        self._starts = 1       # collective training: the group's starts, preemptions included
        self._output = output
        self._grace_period = grace_period
        self._signals: list[int] = []  # signals received by the launcher, in order
        self._reaper: Reaper | None = None   # while run() runs
        # The join timeout watches every task of a collective group of 2+, or the coordinator.
        watched = [slot for slot in self._slots if slot.task.runs_script]
        self._joining = [] if not (join_timeout and joined_folder) or (len(watched) < 2 and not self._ps_mode) \
            else watched
        self._join_watch = JoinWatch(joined_folder or "", join_timeout)
        self._hang_watch = HangWatch(observe_folder or "", hang_timeout if observe_folder else 0.0)

    def interrupt(self, signum: int) -> None:
        """Called by a signal handler: stop the job; while stopping, skip the grace period."""
        self._signals.append(signum)

    def run(self) -> int:
        trained_at = None   # time.monotonic() when training succeeded
        self._reaper = Reaper(self._grace_period, on_lost=self._output.say)
        try:
            for slot in self._slots + self._evaluators:
                self._start(slot)
            while True:
                if self._signals:
                    name = signal.Signals(self._signals[0]).name
                    self._output.say(f"received {name}; stopping {self._count_running()} task(s)")
                    return EXIT_STATUS_ON_SIGNAL.get(self._signals[0], 128 + self._signals[0])
                exits = [(slot, code) for slot in self._slots + self._evaluators
                         if not slot.finished and (code := slot.process.poll()) is not None]
                for slot, _ in exits:
                    slot.reader.join(_READER_JOIN_SECONDS)  # its last lines come before our message
                self._on_evaluator_exits([(slot, code) for slot, code in exits if not slot.task.trains])
                if trained_at is None:
                    on_exits = self._on_task_exits if self._ps_mode else self._on_group_exits
                    status = on_exits([(slot, code) for slot, code in exits if slot.task.trains])
                    if status is None:
                        status = self._peer_status()
                    if status is not None and status != 0:
                        return status
                    if status == 0 or self._all_trained():
                        trained_at = time.monotonic()
                if trained_at is not None:
                    status = self._evaluation_status(trained_at)
                    if status is not None:
                        return status
                elif late := self._join_watch.late([slot.task.name for slot in self._joining
                                                    if slot.process.poll() is None]):
                    return self._fail_to_join(late)
                elif self._hang_watch.hung():   # (the job is stopped, not restarted: it would hang again)
                    self._output.say(self._hang_watch.message({slot.task.name: slot.process.pid for slot in self._slots
                                                               if slot.process.poll() is None}, self._count_running()))
                    return 1
                time.sleep(_POLL_SECONDS)
        finally:
            self._stop_all(self._slots + self._evaluators)
            self._reaper.close()

    def _peer_status(self) -> int | None:
        """The job's status when others decided it (the nodes of a multi-node launch), else None."""
        return None

    def _all_trained(self) -> bool:
        """Whether training is over: every task that runs the script exited 0."""
        return all(slot.finished for slot in self._slots if slot.task.runs_script)

    def _start(self, slot: _Slot) -> None:
        if slot.process is not None:   # its group was killed already
            self._reaper.forget(slot.process.pid)
        if slot in self._joining:
            self._join_watch.started(slot.task.name)
        process = start_process(slot.task.command, slot.env)   # (forks.py: test infrastructure)
        self._reaper.watch(process.pid)   # start_new_session: its pid is its process group's id
        reader = threading.Thread(target=self._output.pump, args=(process.stdout, slot.prefix),
                                  name=f"stratagem-launch {slot.task.name}", daemon=True)
        reader.start()
        slot.process, slot.reader, slot.finished = process, reader, False

    # -- collective training: the group restarts together ----------------------------------

    def _on_group_exits(self, exits: list[tuple[_Slot, int]]) -> int | None:
        """Handles the exits seen in one poll; returns the job's exit status if it ends."""
        for slot, code in exits:
            slot.finished = code == 0
        failures = [(slot, code) for slot, code in exits if code != 0]
        if not failures:
            return None
        slot, code = min(failures, key=lambda failure: blame_order(failure[1]))
        count = len(self._slots)
        if code == PREEMPTED_EXIT_CODE and self._preemptions < self._max_preemptions:
            self._preemptions += 1
            self._output.say(
                f"the tasks stopped for preemption ({slot.task.name} exited with code {code}: "
                f"the group agreed on a step and saved); restarting all {count} tasks "
                f"(preemption {self._preemptions}/{self._max_preemptions}; a preemption does "
                f"not count against --max-restarts)")
        elif code == PREEMPTED_EXIT_CODE:
            return self._fail_preempted(slot, code)
        elif self._restarts < self._max_restarts:
            self._restarts += 1
            self._output.say(f"{slot.task.name} {describe_exit(code)}; restarting all {count} "
                             f"tasks (restart {self._restarts}/{self._max_restarts})")
        else:
            return self._fail(slot, code, self._restarts)
        started = time.monotonic()
        self._stop_all(self._slots)
        if self._signals:
            return None  # the launcher itself is being stopped: run() reports it
        try:
            environments = self._environments(self._starts)
        except ClusterConfigError as error:
            self._output.say(f"cannot start the tasks again: {error}")
            return _exit_status(code)
        for slot, env in zip(self._slots, environments):   # the evaluator (last) goes on as it is
            slot.env = env
            self._start(slot)
        self._hang_watch.restart()
        self._output.say(f"started all {count} tasks again with a new rendezvous "
                         f"(STRATAGEM_RESTART={self._starts}) "
                         f"{time.monotonic() - started:.1f} s after the exit was seen")
        self._starts += 1
        return None

    # -- parameter-server training: each server restarts alone -----------------------------

    def _on_task_exits(self, exits: list[tuple[_Slot, int]]) -> int | None:
        for slot, code in exits:
            status = self._on_task_exit(slot, code)
            if status is not None:
                return status
        return None

    def _on_task_exit(self, slot: _Slot, code: int) -> int | None:
        name = slot.task.name
        if code == 0:
            slot.finished = True
            if slot.task.runs_script:
                return 0  # the coordinator is done: so is the job
            self._output.say(f"{name} exited with code 0 before the job ended")
            return None
        if slot.restarts < self._max_restarts:
            slot.restarts += 1
            self._output.say(f"{name} {describe_exit(code)}; "
                             f"restarting ({slot.restarts}/{self._max_restarts})")
            _signal_group(slot.process.pid, signal.SIGKILL)  # leftovers may hold its port
            slot.env = {**slot.env, "STRATAGEM_RESTART": str(slot.restarts)}
            self._start(slot)
            return None
        if not slot.task.runs_script:
            slot.finished = True
            self._output.say(f"{self._failed(name, code, slot.restarts)}; the job goes on while "
                             "the chief (the coordinator) runs")
            return None
        return self._fail(slot, code, slot.restarts)

    # -- the evaluator: beside training, never restarted with it ----------------------------

    def _on_evaluator_exits(self, exits: list[tuple[_Slot, int]]) -> None:
        for slot, code in exits:
            slot.finished = True
            if code != 0:
                self._output.say(f"{self._failed(slot.task.name, code, 0)}; training goes on, and the job "
                                 "will fail when it ends")
                self._evaluator_status = self._evaluator_status or _exit_status(code)

    def _evaluation_status(self, trained_at: float) -> int | None:
        """After training succeeded: the job's status once the evaluators are done, else None."""
        if self._evaluator_status:
            return self._evaluator_status
        running = [slot.task.name for slot in self._evaluators if not slot.finished]
        if not running:
            return 0
        if time.monotonic() - trained_at > self._evaluator_timeout:
            self._output.say(f"{', '.join(running)} still running {self._evaluator_timeout:g} s after training "
                             "ended; stopping it (an evaluator exits after the last checkpoint: training must "
                             "call CheckpointManager.mark_training_finished())")
            return 1
        return None

    # -- the end ---------------------------------------------------------------------------

    @staticmethod
    def _failed(name: str, code: int, restarts: int) -> str:
        after = f" (after {restarts} restart(s))" if restarts else ""
        if code > 0:
            return f"{name} failed with exit code {code}{after}"
        return f"{name} failed: {describe_exit(code).removeprefix('was ')}{after}"

    def _fail(self, slot: _Slot, code: int, restarts: int) -> int:
        slot.finished = True
        failed = self._failed(slot.task.name, code, restarts)
        others = self._count_running()
        self._output.say(f"{failed}; stopping {others} other task(s)" if others else failed)
        return _exit_status(code)

    def _fail_preempted(self, slot: _Slot, code: int) -> int:
        slot.finished = True
        others = self._count_running()
        self._output.say(
            f"{slot.task.name} stopped for preemption again (exit code {code}) after "
            f"{self._preemptions} preemption restart(s), the most --max-preemptions "
            f"({self._max_preemptions}) allows; not restarting"
            + (f", stopping {others} other task(s)" if others else "")
            + ". A job that is preempted at every start is not making progress: check what "
            "sends the tasks SIGTERM (or why the script exits with 75), or raise --max-preemptions")
        return code

    def _fail_to_join(self, late: list[str]) -> int:
        stopped = [slot.task.name for slot in self._joining
                   if slot.task.name in late and _is_stopped(slot.process.pid)]
        self._output.say(join_timeout_message(late, stopped, timeout=self._join_watch.timeout,
                                              coordinator=self._ps_mode, running=self._count_running()))
        return 1

    def _count_running(self) -> int:
        return sum(1 for slot in self._slots + self._evaluators if slot.process and slot.process.poll() is None)

    def _stop_all(self, slots: list[_Slot]) -> None:
        started = [slot for slot in slots if slot.process is not None]
        for slot in started:
            if slot.process.poll() is None and _is_stopped(slot.process.pid):
                self._output.say(f"{slot.task.name} is stopped (SIGSTOP or a debugger) and cannot "
                                 "act on SIGTERM; killing it")
                _signal_group(slot.process.pid, signal.SIGKILL)
            else:
                _signal_group(slot.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_period
        signals_so_far = len(self._signals)  # a signal from now on means: don't wait
        while (time.monotonic() < deadline and len(self._signals) == signals_so_far
               and any(slot.process.poll() is None for slot in started)):
            time.sleep(_POLL_SECONDS)
        late = [slot.task.name for slot in started if slot.process.poll() is None]
        if late and len(self._signals) == signals_so_far:
            self._output.say(f"{', '.join(late)} still running {self._grace_period:g} s after "
                             "SIGTERM (the grace period); killing")
        # Whatever is left of each group now (the task, or children it left behind) is killed.
        for slot in started:
            _signal_group(slot.process.pid, signal.SIGKILL)
        for slot in started:
            slot.process.wait()
            self._reaper.forget(slot.process.pid)
        for slot in started:
            slot.reader.join(_READER_JOIN_SECONDS)
