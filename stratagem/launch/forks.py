"""Test infrastructure: a launch's tasks forked from a test's fork server, not started fresh.

Not a feature for users. A test suite runs ``stratagem launch`` hundreds of times, and most of
each task's start-up is ``import torch`` (seconds on a busy machine). When the launcher's
environment has ``STRATAGEM_TEST_FORK_SERVER`` (the path of the socket of
:mod:`stratagem.testing.forked`'s fork server, set by the tests that opt in), the launcher asks
that server for each task it can fork -- a command ``python SCRIPT ...``, ``python -m MODULE
...`` or ``python -c CODE ...`` of the same interpreter, in the same network namespace, whose
environment agrees with the server's on every variable read at start-up or at torch's import
(:data:`READ_AT_IMPORT`) -- and starts every other task fresh, as without the variable.

A forked task is still a real process that runs its command as a fresh interpreter would (see
:mod:`stratagem.testing.forked`): a session of its own, stdin from ``/dev/null``, its output
through a pipe to the launcher, stopped and killed through its process group. What differs is
its parent, the server: the launcher learns its exit code from the server, and its parent-death
signal comes from the server's death (SIGKILL); the launcher's death (its connection closing)
makes the server send it SIGTERM, as the launcher's own parent-death signal would.
A variable naming no running server is an error, not a silent fresh start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

from stratagem.errors import ClusterConfigError
from stratagem.launch.lifeline import die_with_parent

__all__ = ["FORK_SERVER_VARIABLE", "READ_AT_IMPORT", "ForkedProcess", "differs_at_import", "fork_request",
           "start_process"]

FORK_SERVER_VARIABLE = "STRATAGEM_TEST_FORK_SERVER"
#: variable prefixes read when the interpreter starts or torch is imported: a task whose value
#: differs from the server's cannot be forked from it (the two of _SET_PER_TASK aside)
READ_AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "OPENBLAS", "KMP_", "GOMP_", "TORCH", "CUDA", "LD_", "MALLOC",
                  "SYMPY")
_SET_PER_TASK = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")
_HELLO_SECONDS = 180.0   # a server still importing torch on a loaded machine answers late


def differs_at_import(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a task with ``env`` would see other values at start-up than the server saw."""
    keys = {k for k in {*env, *server_env} if k.startswith(READ_AT_IMPORT) and k not in _SET_PER_TASK}
    return any(env.get(k) != server_env.get(k) for k in keys)


def fork_request(command: list[str] | tuple[str, ...], executable: str, cwd: str | None = None) -> dict | None:
    """What to ask a fork server whose interpreter is ``executable`` for, to run ``command`` in
    folder ``cwd`` (this process's by default); None when it cannot be forked (another program,
    or interpreter options)."""
    if len(command) < 2 or command[0] != executable:
        return None
    if command[1] in ("-m", "-c") and len(command) >= 3:
        return {"module" if command[1] == "-m" else "code": command[2], "args": list(command[3:])}
    if command[1].startswith("-"):
        return None   # interpreter options: a fresh interpreter
    script = os.path.abspath(os.path.join(cwd or os.getcwd(), command[1]))
    return {"script": script, "argv0": command[1], "args": list(command[2:])}


class ForkedProcess:
    """A forked task, with the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, client: "_Client", pid: int, stdout) -> None:
        self._client, self.pid, self.stdout, self.returncode = client, pid, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._client.exit_code(self.pid, wait=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._client.exit_code(self.pid, wait=True)
        return self.returncode


class _Client:
    """One launcher's connection to the fork server."""

    def __init__(self, path: str) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._socket.connect(path)
            self._socket.settimeout(_HELLO_SECONDS)
            self.server = json.loads(self._socket.recv(1 << 20))
            self._socket.settimeout(None)
        except (OSError, ValueError) as error:
            self._socket.close()
            raise ClusterConfigError(
                f"{FORK_SERVER_VARIABLE}={path!r} names no running fork server ({error}); the variable is "
                "test infrastructure (stratagem.testing): unset it to start every task fresh.") from None
        self._lock = threading.Lock()   # one request at a time
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        self.gone = False
        threading.Thread(target=self._read_replies, daemon=True, name="stratagem-forks").start()

    def start(self, command: list[str] | tuple[str, ...], env: dict[str, str]) -> ForkedProcess | None:
        request = fork_request(command, self.server["executable"])
        if request is None or differs_at_import(env, self.server["env"]) or self.gone:
            return None
        read_end, write_end = os.pipe()
        try:
            with self._lock, self._changed:
                message = json.dumps({**request, "env": env, "cwd": os.getcwd()}).encode()
                socket.send_fds(self._socket, [message], [write_end])
                while not self._started and not self.gone:
                    self._changed.wait()
                if not self._started:
                    raise ClusterConfigError(f"the fork server of {FORK_SERVER_VARIABLE} exited; unset the "
                                             "variable to start every task fresh.")
                pid = self._started.pop(0)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)   # the task holds it now: end-of-file when the task's side is gone
        return ForkedProcess(self, pid, os.fdopen(read_end, "rb", buffering=0))

    def exit_code(self, pid: int, *, wait: bool) -> int | None:
        with self._changed:
            while wait and pid not in self._exited and not self.gone:
                self._changed.wait()
            if pid in self._exited:
                return self._exited.pop(pid)
            return -9 if self.gone else None    # the server's death killed its children

    def _read_replies(self) -> None:
        while reply := self._socket.recv(1 << 16):
            reply = json.loads(reply)
            with self._changed:
                if "started" in reply:
                    self._started.append(reply["started"])
                else:
                    self._exited[reply["exited"]] = reply["code"]
                self._changed.notify_all()
        with self._changed:
            self.gone = True
            self._changed.notify_all()


_clients: dict[str, _Client] = {}


def start_process(command: list[str] | tuple[str, ...], env: dict[str, str]) -> "subprocess.Popen[bytes] | ForkedProcess":
    """Start a task: output (stdout and stderr) to a pipe, a session of its own, dying with us.

    Forked from the test fork server when ``STRATAGEM_TEST_FORK_SERVER`` is set and the task
    can be; else a fresh process.
    """
    path = os.environ.get(FORK_SERVER_VARIABLE)
    if path and sys.platform.startswith("linux"):
        if path not in _clients or _clients[path].gone:   # (a later server answers at the same path)
            _clients[path] = _Client(path)
        if _clients[path].server["netns"] == _netns() and (task := _clients[path].start(command, env)):
            return task
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, bufsize=0,
                            preexec_fn=die_with_parent())


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
