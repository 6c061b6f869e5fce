"""What runs on a Ray node: one task's process, started, streamed and stopped by an actor.

:func:`~stratagem.launch.ray_launch.launch_ray` makes one Ray actor of :class:`TaskRunner`
per task and per start of the job's group. The runner lives in a Ray worker process on its
node and owns one task process there, from start to stop::

    report(exclude)  where the task will listen: this node's address and a free port on it
                     (not one of ``exclude``), and what this node holds of the cluster token
    start(...)       runs the task: this node's Python, the script, the environment of the
                     Ray worker plus TF_CONFIG, STRATAGEM_RESTART, the token, ...; returns its pid
    read(timeout)    the output lines since the last read (whole lines, bytes), the exit code
                     once the process has exited and every line was read, whether it joined
    stop(grace)      SIGTERM (and SIGCONT, so that a stopped process can act on it) to the task's
                     process group, ``grace`` seconds, SIGKILL; returns the exit code

The actor is threaded (a ``read`` waits while ``stop`` runs). The task runs in a session of
its own, like a task of ``stratagem launch``, and dies with the actor however the actor dies
(``ray.kill``, SIGKILL of the worker process, the job's driver gone): it gets the kernel's
parent-death signal (SIGTERM), and a reaper process stops its process group (SIGTERM, the
grace period, SIGKILL) once the actor's process has exited (``lifeline.py``).

Whether the task joined its cluster is read from a folder of this node (the launcher's
joined folder, ``STRATAGEM_JOINED_DIR``), made for this runner.

The cluster token: when this node's environment has ``STRATAGEM_CLUSTER_TOKEN`` (set where
Ray started on the node, so every Ray worker inherits it), the task uses it and
:meth:`TaskRunner.report` tells only whether it is strong and a SHA-256 digest to compare
nodes with; the token itself never leaves the node. Otherwise the launcher may hand one to
:meth:`TaskRunner.start` (``ray_launch.py`` says when). The token never appears in a
command line or in output.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratagem.cluster.joined import JOINED_VARIABLE, mark_stamp
from stratagem.cluster.torchrun import TORCHRUN_VARIABLES
from stratagem.launch.lifeline import Reaper, die_with_parent
from stratagem.launch.local import TOKEN_VARIABLE
from stratagem.launch.output import TaskOutput
from stratagem.launch.ports import free_ports

__all__ = ["NodeReport", "TaskRunner"]

_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class NodeReport:
    """Where a task will run and listen, as its actor sees it; never the token itself."""

    host: str                  # the node's address (Ray's node IP)
    port: int                  # a port free on it now, for the task's TF_CONFIG entry
    node_id: str               # Ray's id of the node
    token_digest: str | None   # SHA-256 of the node's STRATAGEM_CLUSTER_TOKEN; None if unset or weak
    token_problem: str | None  # why the node's token is refused (too weak), else None
    cwd: str                   # the actor's working directory


def _token_check(token: str) -> str | None:
    """Why ``token`` is refused (the message), or None when it is strong enough."""
    # Lazy: the strength rule lives in stratagem.rpc, whose package loads grpc and
    # cryptography, which the launcher's own process must not pay for.
    from stratagem.rpc.tokens import check_token_strength
    try:
        check_token_strength(token, source=f"{TOKEN_VARIABLE} in this node's environment")
    except ValueError as error:
        return str(error)
    return None


class _Lines(TaskOutput):
    """The task's output lines, kept for :meth:`TaskRunner.read` instead of written."""

    def __init__(self) -> None:
        super().__init__(sys.stdout, sys.stderr)
        self.changed = threading.Condition()
        self.lines: list[bytes] = []

    def write(self, prefix: str, lines: list[bytes]) -> None:
        with self.changed:
            self.lines.extend(lines)
            self.changed.notify_all()


class TaskRunner:
    """One task's process on this node (the body of a Ray actor; see the module docstring)."""

    def __init__(self, grace_period: float) -> None:
        self._grace_period = grace_period
        self._output = _Lines()
        self._joined = tempfile.mkdtemp(prefix="stratagem-joined-")
        self._name = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._code: int | None = None      # the exit code, once every line has been read
        self._reaper: Reaper | None = None

    def report(self, exclude: Sequence[int] = ()) -> NodeReport:
        """This node's address, a free port on it not in ``exclude``, and its token's digest."""
        import ray   # the actor runs inside Ray: it is loaded already
        host = ray.util.get_node_ip_address()
        port = next(port for port in iter(lambda: free_ports(1, host)[0], None) if port not in exclude)
        token = os.environ.get(TOKEN_VARIABLE)
        problem = None if token is None else _token_check(token)
        digest = hashlib.sha256(token.encode()).hexdigest() if token is not None and problem is None else None
        return NodeReport(host, port, ray.get_runtime_context().get_node_id(), digest, problem, os.getcwd())

    def start(self, name: str, command: Sequence[str], env: Mapping[str, str], cwd: str | None,
              token: str | None) -> int:
        """Starts the task ``name``: this node's Python runs ``command``; returns its pid.

        ``env`` is added to the environment of this Ray worker (its torchrun variables are
        removed first); ``token``, when given, becomes ``STRATAGEM_CLUSTER_TOKEN``. ``cwd`` is the
        driver's working directory: used when it exists here, else the actor's.
        """
        assert self._process is None, "one task process per runner"
        self._name = name
        where = cwd if cwd and os.path.isdir(cwd) else os.getcwd()
        script = command[0] if command and command[0] != "-m" else None
        if script is not None and not os.path.isfile(os.path.join(where, script)):
            raise FileNotFoundError(
                f"{name}: script {script!r} not found on this node (looked from {where!r}); every node "
                "needs the script at the same path, or give it to Ray with runtime_env={'working_dir': ...}")
        full = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES
                and not key.startswith("TORCHELASTIC_")}
        full.update(env)
        full[JOINED_VARIABLE] = self._joined
        if token is not None:
            full[TOKEN_VARIABLE] = token
        self._reaper = Reaper(self._grace_period)
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            # This thread starts the task and outlives it: the parent-death signal is tied to it.
            try:
                self._process = subprocess.Popen(
                    [sys.executable, *command], env=full, cwd=where, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, bufsize=0,
                    preexec_fn=die_with_parent())
                self._reaper.watch(self._process.pid)
            except BaseException as error:   # handed to start()'s caller
                failure.append(error)
                return
            finally:
                started.set()
            self._output.pump(self._process.stdout, "")
            code = self._process.wait()
            with self._output.changed:
                self._code = code
                self._output.changed.notify_all()

        threading.Thread(target=run, name=f"stratagem-ray {name}", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        return self._process.pid

    def read(self, timeout: float) -> tuple[list[bytes], int | None, bool]:
        """Waits up to ``timeout`` s for output; returns (lines, exit code or None, joined)."""
        changed = self._output.changed
        with changed:
            changed.wait_for(lambda: self._output.lines or self._code is not None, timeout)
            lines, self._output.lines = self._output.lines, []
            return lines, self._code, mark_stamp(self._joined, self._name) is not None

    def stop(self, grace_period: float) -> int | None:
        """Stops the task's process group (SIGTERM, ``grace_period`` s, SIGKILL); its exit code."""
        process = self._process
        if process is not None:
            if process.poll() is None:
                for signum in (signal.SIGTERM, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(process.pid, signum)
            deadline = time.monotonic() + grace_period
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)   # the task, or children it left behind
            process.wait()
            self._reaper.forget(process.pid)
        if self._reaper is not None:
            self._reaper.close()
        shutil.rmtree(self._joined, ignore_errors=True)
        return None if process is None else process.returncode
