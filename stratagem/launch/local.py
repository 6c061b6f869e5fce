"""The local launcher: start every task of a cluster, watch them, restart, stop.

:func:`launch_local` is ``stratagem launch``: it checks its arguments, plans the cluster
(``tasks.py``), and hands over to :class:`_Launcher`, which supervises the processes.

The life of a task (one process at a time per task)::

    running --exit 0--------------------------------> done
    running --fails, restarts left--> restarted (same TF_CONFIG, same port) --> running
    running --fails, no restarts left--> failed: the job fails, every task is stopped

The job succeeds when every task that runs the script has exited 0. In parameter-server
training only the chief (the coordinator) runs the script: the job ends when it ends, with
its exit status, and the servers are then stopped. A server that fails beyond its restarts
is reported but does not end the job; the coordinator sees the loss (a worker's steps are
run elsewhere, a lost parameter server raises UnavailableError there) and decides.

Stopping means SIGTERM to each task's process group (a task's own children go too), up to
``grace_period`` seconds for the tasks to exit, then SIGKILL to the groups. SIGINT (Ctrl-C)
or SIGTERM sent to the launcher stop the job the same way (the tasks, in sessions of their
own, get SIGTERM from the launcher, not the terminal's SIGINT); it then returns 130 or 143.
A signal that comes while the tasks are being stopped skips the rest of the grace period.

Each process has the environment of the launcher plus ``TF_CONFIG``, ``PYTHONUNBUFFERED=1``
and ``STRATAGEM_CLUSTER_TOKEN``, a secret made fresh for every job that the cluster's
servers use to refuse strangers; it is never printed. torchrun's variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...) are removed, since this cluster is described by
TF_CONFIG alone and an inherited, stale copy would contradict it.

Example::

    import os, io, tempfile
    from stratagem.launch import launch_local
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hello.py")
        with open(script, "w") as f:
            f.write("import json, os\\n"
                    "task = json.loads(os.environ['TF_CONFIG'])['task']\\n"
                    "print('hello from', task['type'], task['index'])\\n")
        out = io.StringIO()
        assert launch_local(script, num_workers=2, stdout=out) == 0
        assert "[worker 1] hello from worker 1" in out.getvalue()
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TextIO

from stratagem.cluster import ClusterSpec
from stratagem.cluster.spec import validate_address
from stratagem.cluster.torchrun import TORCHRUN_VARIABLES
from stratagem.errors import InvalidArgumentError
from stratagem.launch.ports import format_address, free_ports, ports_from_base
from stratagem.launch.tasks import Task, plan_cluster, tf_config

__all__ = ["launch_local"]

TOKEN_VARIABLE = "STRATAGEM_CLUSTER_TOKEN"
_POLL_SECONDS = 0.05
_READER_JOIN_SECONDS = 1.0
# A line ends at "\n", "\r\n" or a lone "\r" (progress bars redraw their line with "\r").
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
_EXIT_STATUS_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _describe_exit(code: int) -> str:
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


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)  # start_new_session=True: the task's pid is its group's id


@dataclass
class _Slot:
    """A task and its current process."""

    task: Task
    env: dict[str, str]
    prefix: str
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    restarts: int = 0
    finished: bool = False  # exited and not to be restarted


class _Launcher:
    """Supervises the processes of one job; :meth:`run` returns the job's exit status."""

    def __init__(self, tasks: Sequence[Task], envs: Sequence[dict[str, str]], *,
                 max_restarts: int, stdout: TextIO, stderr: TextIO, grace_period: float) -> None:
        width = max(len(f"[{task.name}]") for task in tasks)
        self._slots = [_Slot(task, env, f"[{task.name}]".ljust(width) + " ")
                       for task, env in zip(tasks, envs)]
        self._ps_mode = not all(task.runs_script for task in tasks)
        self._max_restarts = max_restarts
        self._stdout, self._stderr = stdout, stderr
        self._grace_period = grace_period
        self._lock = threading.Lock()  # one whole line at a time, whoever writes it
        self._signals: list[int] = []  # signals received by the launcher, in order

    def interrupt(self, signum: int) -> None:
        """Called by a signal handler: stop the job; while stopping, skip the grace period."""
        self._signals.append(signum)

    def run(self) -> int:
        try:
            for slot in self._slots:
                self._start(slot)
            while True:
                if self._signals:
                    name = signal.Signals(self._signals[0]).name
                    self._say(f"received {name}; stopping {self._count_running()} task(s)")
                    return _EXIT_STATUS_ON_SIGNAL.get(self._signals[0], 128 + self._signals[0])
                for slot in self._slots:
                    code = None if slot.finished else slot.process.poll()
                    if code is not None:
                        status = self._on_exit(slot, code)
                        if status is not None:
                            return status
                if all(slot.finished for slot in self._slots if slot.task.runs_script):
                    return 0
                time.sleep(_POLL_SECONDS)
        finally:
            self._stop_all()

    # -- one task --------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        process = subprocess.Popen(
            slot.task.command, env=slot.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, bufsize=0)
        reader = threading.Thread(target=self._pump, args=(process.stdout, slot.prefix),
                                  name=f"stratagem-launch {slot.task.name}", daemon=True)
        reader.start()
        slot.process, slot.reader = process, reader

    def _on_exit(self, slot: _Slot, code: int) -> int | None:
        """Handles a task's exit; returns the job's exit status if the job ends."""
        slot.reader.join(_READER_JOIN_SECONDS)  # its last lines come before our message
        name = slot.task.name
        if code == 0:
            slot.finished = True
            if self._ps_mode and slot.task.runs_script:
                return 0  # the coordinator is done: so is the job
            if not slot.task.runs_script:
                self._say(f"{name} exited with code 0 before the job ended")
            return None
        if slot.restarts < self._max_restarts:
            slot.restarts += 1
            self._say(f"{name} {_describe_exit(code)}; "
                      f"restarting ({slot.restarts}/{self._max_restarts})")
            _signal_group(slot.process.pid, signal.SIGKILL)  # leftovers may hold its port
            self._start(slot)
            return None
        after = f" (after {slot.restarts} restart(s))" if slot.restarts else ""
        failed = (f"{name} failed with exit code {code}" if code > 0 else
                  f"{name} failed: {_describe_exit(code).removeprefix('was ')}")
        slot.finished = True
        if self._ps_mode and not slot.task.runs_script:
            self._say(f"{failed}{after}; the job goes on while the chief (the coordinator) runs")
            return None
        others = self._count_running()
        self._say(f"{failed}{after}; stopping {others} other task(s)" if others
                  else f"{failed}{after}")
        return _exit_status(code)

    def _count_running(self) -> int:
        return sum(1 for slot in self._slots if slot.process and slot.process.poll() is None)

    # -- stopping --------------------------------------------------------------------------

    def _stop_all(self) -> None:
        started = [slot for slot in self._slots if slot.process is not None]
        for slot in started:
            _signal_group(slot.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_period
        signals_so_far = len(self._signals)  # a signal from now on means: don't wait
        while (time.monotonic() < deadline and len(self._signals) == signals_so_far
               and any(slot.process.poll() is None for slot in started)):
            time.sleep(_POLL_SECONDS)
        # Whatever is left of each group now (the task, or children it left behind) is killed.
        for slot in started:
            _signal_group(slot.process.pid, signal.SIGKILL)
        for slot in started:
            slot.process.wait()
        for slot in started:
            slot.reader.join(_READER_JOIN_SECONDS)

    # -- output ----------------------------------------------------------------------------

    def _pump(self, pipe: IO[bytes], prefix: str) -> None:
        """Copies a task's output to stdout, each line whole and prefixed with the task."""
        pending = b""
        with pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                # Up to the last line end, looking only at the new bytes (and a "\r" held
                # back): whole lines, in linear time however long a line is. A final "\r"
                # waits for the next read, which may bring the "\n" of a "\r\n".
                start = max(0, len(pending) - len(chunk) - 1)
                cut = max(pending.rfind(b"\n", start), pending.rfind(b"\r", start)) + 1
                if cut == len(pending) and pending.endswith(b"\r"):
                    cut -= 1
                lines = _LINE.findall(pending, 0, cut) if cut else []
                pending = pending[sum(map(len, lines)):]
                self._write(prefix, lines)
            if pending:
                self._write(prefix, [pending + b"\n"])

    def _write(self, prefix: str, lines: list[bytes]) -> None:
        # A lone "\r" with nothing before it is a progress bar going back to the start of its
        # line to redraw it: prefixing it would print an empty "[task]" line each time.
        text = "".join(prefix + line.decode("utf-8", "replace").replace("\r\n", "\n")
                       for line in lines if line != b"\r")
        if not text:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):  # a closed stdout drops output
            self._stdout.write(text)
            self._stdout.flush()

    def _say(self, message: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._stderr.write(f"[launch] {message}\n")
            self._stderr.flush()


@contextlib.contextmanager
def _signals_to(launcher: _Launcher) -> Iterator[None]:
    """Routes SIGINT and SIGTERM to ``launcher.interrupt`` (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = lambda signum, frame: launcher.interrupt(signum)  # noqa: E731
    previous = {signum: signal.signal(signum, handler) for signum in _EXIT_STATUS_ON_SIGNAL}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _check_count(value: object, flag: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{flag} must be an integer >= {minimum}, got {value!r}.")
    return value


def _check_script(script: str | os.PathLike[str]) -> str:
    path = os.fspath(script)
    if not os.path.exists(path):
        raise InvalidArgumentError(
            f"script {path!r} not found (looked from {os.getcwd()!r}); give the path of the "
            "Python script that the tasks run, like 'train.py'.")
    if os.path.isdir(path):
        raise InvalidArgumentError(
            f"script {path!r} is a directory; give the path of a Python script, like "
            f"{os.path.join(path, 'train.py')!r}.")
    return path


def _task_env(base: Mapping[str, str], spec: ClusterSpec, task: Task, token: str) -> dict[str, str]:
    # torchrun's variables: a child of this launcher is described by TF_CONFIG alone.
    env = {key: value for key, value in base.items() if key not in TORCHRUN_VARIABLES
           and not key.startswith("TORCHELASTIC_")}
    env.update({"TF_CONFIG": tf_config(spec, task), TOKEN_VARIABLE: token, "PYTHONUNBUFFERED": "1"})
    return env


def launch_local(script: str | os.PathLike[str], args: Sequence[str] = (), *,
                 num_workers: int = 2, num_ps: int = 0, chief: bool = False,
                 max_restarts: int = 0, port_base: int | None = None, host: str = "127.0.0.1",
                 grace_period: float = 5.0, stdout: TextIO | None = None,
                 stderr: TextIO | None = None,
                 server_command: Sequence[str] | None = None) -> int:
    """Runs ``script`` as a local cluster on ``host``; returns the job's exit status.

    The tasks are a chief (with ``chief=True``, or whenever ``num_ps > 0``), ``num_workers``
    workers and ``num_ps`` parameter servers, each one process with its TF_CONFIG and its
    own port (consecutive from ``port_base``, else free ones). Each task that fails is
    restarted up to ``max_restarts`` times. The status is 0 when the job succeeded, the
    failed task's exit code (1 if it was killed by a signal) when it failed, 130/143 when
    the launcher got SIGINT/SIGTERM. Task output goes to ``stdout`` (default
    ``sys.stdout``) and the launcher's messages to ``stderr``, each line prefixed with
    its task. ``server_command`` replaces ``stratagem server`` for the workers and
    parameter servers of parameter-server training.

    Bad arguments (a missing script, no task to run, a busy port) raise
    :class:`~stratagem.errors.InvalidArgumentError` or
    :class:`~stratagem.errors.ClusterConfigError` before anything starts.
    """
    path = _check_script(script)
    if isinstance(args, (str, bytes)) or not all(isinstance(arg, str) for arg in args):
        raise InvalidArgumentError(
            f"args must be a sequence of strings (the script's command line), got {args!r}.")
    _check_count(num_workers, "--workers (num_workers)")
    _check_count(num_ps, "--ps (num_ps)")
    _check_count(max_restarts, "--max-restarts (max_restarts)")
    if num_workers == 0 and not chief and not num_ps:
        raise InvalidArgumentError(
            "nothing to launch: --workers is 0 and there is no chief; ask for at least one "
            "worker (--workers 1) or a chief (--chief).")
    if num_ps and not num_workers:
        raise InvalidArgumentError(
            f"parameter-server training (--ps {num_ps}) needs at least one worker to run the "
            "coordinator's steps; add --workers 1 or more.")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"--host must be a host name or IP address, got {host!r}.")
    validate_address(format_address(host, 1), where=f"--host {host!r}")
    if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)) \
            or not grace_period >= 0:
        raise InvalidArgumentError(f"grace_period must be a number of seconds >= 0, got {grace_period!r}.")

    num_tasks = int(chief or num_ps > 0) + num_workers + num_ps
    if port_base is None:
        ports = free_ports(num_tasks, host)
    else:
        ports = ports_from_base(_check_count(port_base, "--port-base (port_base)", 1), num_tasks, host)
    spec, tasks = plan_cluster([path, *args], num_workers=num_workers, num_ps=num_ps, chief=chief,
                               ports=ports, host=host, server=server_command)
    token = secrets.token_hex(32)  # one per job; never printed
    envs = [_task_env(os.environ, spec, task, token) for task in tasks]
    launcher = _Launcher(tasks, envs, max_restarts=max_restarts,
                         stdout=sys.stdout if stdout is None else stdout,
                         stderr=sys.stderr if stderr is None else stderr,
                         grace_period=float(grace_period))
    with _signals_to(launcher):
        return launcher.run()
