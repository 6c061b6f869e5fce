"""Start a test cluster's tasks by forking a process that has imported torch already.

Each task of :func:`stratagem.testing.run_local_cluster` is a process of its own that runs a
script, and most of such a process's start-up is ``import torch``: seconds on a busy 2-core
machine, paid by every task of every multi-process test. A fork server imports torch once;
each task is then a child forked from it that runs the script as ``python script.py`` would:
as ``__main__`` with its ``sys.argv``, the script's folder first on ``sys.path``, the task's
environment and working directory, its output (unbuffered) to the task's log, stdin from
``/dev/null``, a session of its own (one signal to its process group reaches all of it), an
uncaught exception's traceback and exit code 1, ``atexit`` handlers at the end. It is still a
real process: its own interpreter state, its own sockets, killed and stopped by signals. Its end
skips the teardown of every module (which would copy all of the server's memory it shares): the
script's own objects are finalized (a file it left open is flushed and closed), then it exits.

What a child inherits that a fresh interpreter would not is what the server's imports did
(torch, torch.distributed, DTensor, dynamo, and stratagem's core, none of whose modules reads the
environment when imported: most of a strategy's start-up), before any task's environment was
read. So the server is started with the cluster's environment, and replaced
when a later cluster's differs in a variable read at start-up or at those imports
(:data:`stratagem.launch.forks.READ_AT_IMPORT`; torch's compiler sets some in a process that compiles); a task whose
own variables differ from its server's starts as a fresh interpreter. So does every task when
``STRATAGEM_TEST_FORKSERVER=0``, or when the cluster is started from a thread other than the main thread (the server must live as long as
the test process: the kernel's parent-death signal follows the thread that started it).

The server (``forkserver.py`` beside this file) dies with the test process (parent-death
signal), and its children die with it.

``stratagem launch`` forks its tasks from the same server when ``STRATAGEM_TEST_FORK_SERVER``
names the server's socket (:func:`fork_server_variable`; :mod:`stratagem.launch.forks` says
which tasks, and what differs): tests that launch jobs set it (``tests/conftest.py``). A test that
starts one process itself -- ``python SCRIPT``, ``python -m MODULE``, ``python -c CODE`` -- forks it
from the server too with :func:`start_task` (its output to a file) or :func:`run_task` (as
``subprocess.run`` with ``capture_output=True``). A forked task's ``/proc/PID/environ`` is its
server's: :func:`task_environments` says which environment each task was given.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from stratagem.launch.forks import FORK_SERVER_VARIABLE, differs_at_import, fork_request
from stratagem.launch.lifeline import die_with_parent

_CLONE_NEWNET = 0x40000000
_READY_SECONDS = 300.0   # at most, for the server's imports on a loaded machine
#: the server: run as a script, it imports torch and stratagem.testing.preloaded before it forks
_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")


class ForkedTask:
    """A forked task, with the part of :class:`subprocess.Popen`'s interface that tests use."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, wait=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, wait=True, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked task {self.pid}", timeout)
        return self.returncode


class ForkServer:
    """The test process's side: asks the server for tasks and learns when they exit."""

    def __init__(self, env: dict[str, str], listener: socket.socket, namespace: str | None = None) -> None:
        self._env = dict(env)
        self._process = subprocess.Popen(
            [sys.executable, _SERVER, str(listener.fileno())], env=self._env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0,
            pass_fds=[listener.fileno()], preexec_fn=_started_in(namespace, die_with_parent(signal.SIGKILL)))
        self._lock = threading.Lock()            # one request at a time
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        self._gone = False
        self.ready = threading.Event()   # set once the server has imported torch (or exited)
        threading.Thread(target=self._read_replies, daemon=True, name="stratagem-forkserver").start()

    def can_start(self, env: dict[str, str]) -> bool:
        return not self._gone and not differs_at_import(env, self._env)

    def start(self, script: str, args: list[str], env: dict[str, str], log_path: str) -> ForkedTask:
        """``python SCRIPT ARGS`` with environment ``env``, its output appended to ``log_path``."""
        return self._ask({"script": os.path.abspath(script), "args": list(args), "env": env, "log": log_path})

    def start_command(self, command: list[str], env: dict[str, str], log_path: str, *,
                      stderr_path: str | None = None, cwd: str | None = None) -> ForkedTask | None:
        """``command`` (``python SCRIPT ...``, ``python -m MODULE ...`` or ``python -c CODE ...`` of
        this interpreter) as :meth:`start` runs a script, its stderr to ``stderr_path`` if given, in
        folder ``cwd``; None for any other command."""
        request = fork_request(command, sys.executable, cwd)
        if request is None:
            return None
        options = {"stderr": stderr_path} if stderr_path is not None else {}
        return self._ask({**request, **options, "env": env, "log": log_path}, cwd)

    def _ask(self, request: dict, cwd: str | None = None) -> ForkedTask:
        request = {**request, "cwd": os.path.abspath(cwd or os.getcwd())}
        with self._lock, self._changed:
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            while not self._started and not self._gone:
                self._changed.wait()
            if not self._started:
                raise RuntimeError("the test fork server exited")
            return ForkedTask(self, self._started.pop(0))

    def exit_code(self, pid: int, *, wait: bool, timeout: float | None = None) -> int | None:
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._exited or self._gone, timeout)
            if pid in self._exited:
                return self._exited.pop(pid)
            return -9 if self._gone else None    # the server's death killed its children

    def close(self) -> None:
        """The server exits (its tasks, all ended by now, would die with it)."""
        try:
            self._process.stdin.close()
            self._process.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()

    def _read_replies(self) -> None:
        for line in self._process.stdout:
            reply = json.loads(line)
            with self._changed:
                if "ready" in reply:
                    self.ready.set()
                elif "started" in reply:
                    self._started.append(reply["started"])
                else:
                    self._exited[reply["exited"]] = reply["code"]
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        self.ready.set()


_shared: dict[str | None, ForkServer] = {}   # network namespace (None: ours) -> its server


@atexit.register
def _close_shared() -> None:
    """The servers exit with the test process, which waits for them (their time counts as ours)."""
    for server in _shared.values():
        server.close()
_listeners: dict[str | None, socket.socket] = {}   # launchers connect here, to whichever server runs now


def _listening(namespace: str | None = None) -> socket.socket:
    """The socket of this process's fork servers in network namespace ``namespace``, one path for
    the whole test run (a launcher told it once reaches the server that runs when it connects)."""
    if not _listeners:
        folder = tempfile.mkdtemp(prefix="stratagem-forks-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _listeners[None] = _listen(os.path.join(folder, "server"))
    if namespace not in _listeners:
        folder = os.path.dirname(_listeners[None].getsockname())
        _listeners[namespace] = _listen(os.path.join(folder, f"server-in-{namespace}"))
    return _listeners[namespace]


def _listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    return listener


def shared_server(env: dict[str, str] | None = None, *, namespace: str | None = None) -> ForkServer | None:
    """The test process's fork server for tasks with environment ``env`` (this process's by
    default), or None where tasks start fresh. A server whose imports saw other values of the
    variables they read (torch's compiler sets some in the process that compiles) is replaced.
    ``namespace``: the server for tasks in that network namespace (``ip netns``), started in it."""
    if os.environ.get("STRATAGEM_TEST_FORKSERVER", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    env = dict(os.environ) if env is None else env
    server = _shared.get(namespace)
    if server is not None and not server._gone and server.can_start(env):
        return server
    if server is not None:
        server.close()
    _shared[namespace] = ForkServer(env, _listening(namespace), namespace)
    return _shared[namespace]


def fork_server_variable(env: dict[str, str] | None = None, *, namespace: str | None = None) -> dict[str, str]:
    """``{"STRATAGEM_TEST_FORK_SERVER": path}`` for launchers whose tasks have environment ``env``
    (this process's by default): ``stratagem launch`` then forks its tasks from the shared
    server; ``{}`` where tasks start fresh (see :func:`shared_server`). The path stays the same
    while this process lives: a later server, started for other variables, answers there.
    ``namespace``: for launchers in that network namespace, whose tasks a server there forks."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != FORK_SERVER_VARIABLE}
    server = shared_server(env, namespace=namespace)
    if server is None:
        return {}
    server.ready.wait(_READY_SECONDS)    # a launcher's first task does not wait for torch's import
    return {FORK_SERVER_VARIABLE: _listening(namespace).getsockname()}


def close_server(namespace: str) -> None:
    """The fork server in network namespace ``namespace`` exits, if one runs (before the namespace
    is deleted: it would keep it alive); its tasks, which die with it, should have ended."""
    server = _shared.pop(namespace, None)
    if server is not None:
        server.close()


def _started_in(namespace: str | None, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """A ``preexec_fn``: ``then``, and the child enters network namespace ``namespace`` (as
    ``ip netns exec`` does, by the file ``ip netns add`` made for it)."""
    if namespace is None:
        return then
    libc = ctypes.CDLL(None, use_errno=True)
    path = os.path.join("/run/netns", namespace)

    def preexec() -> None:
        if then is not None:
            then()
        fd = os.open(path, os.O_RDONLY)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {namespace!r}")
        os.close(fd)
    return preexec


def task_environments(parent: int | None = None) -> dict[int, dict[str, str]]:
    """The environment of each living task that process ``parent`` started, by pid (of every process
    when ``parent`` is None): its children's ``/proc/PID/environ``, and for the tasks that a test fork
    server forked at its request, the environment each was given (a forked task's
    ``/proc/PID/environ`` is its server's). A test finds a task of ``stratagem launch`` by its
    TF_CONFIG so, ``parent`` being the launcher; a task of a launch finds another with ``None``.

    Example::

        import os, signal, sys, tempfile
        from stratagem.testing import start_task, task_environments
        log = os.path.join(tempfile.mkdtemp(), "task.log")
        task = start_task([sys.executable, "-c", "import time; time.sleep(60)"],
                          env={**os.environ, "WHO": "task 1"}, log=log)
        assert task_environments(os.getpid())[task.pid]["WHO"] == "task 1"
        os.killpg(task.pid, signal.SIGKILL)
        task.wait(60)
    """
    found: dict[int, dict[str, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := _parent_of(int(entry))) is not None and parent in (None, ppid):
            try:
                with open(f"/proc/{entry}/environ", "rb") as file:
                    found[int(entry)] = dict(item.decode(errors="replace").split("=", 1)
                                             for item in file.read().split(b"\0") if b"=" in item)
            except OSError:
                pass
    # the servers' records: beside the sockets of this process's servers, or of the launch's
    sockets = [listener.getsockname() for listener in _listeners.values()] + [
        path for path in [os.environ.get(FORK_SERVER_VARIABLE)] if path]
    for folder in {os.path.dirname(path) for path in sockets}:
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.startswith("task-") and name.endswith(".json"):
                try:
                    with open(os.path.join(folder, name)) as file:
                        record = json.load(file)
                except (OSError, ValueError):
                    continue   # (its task has just exited)
                pid = int(name[len("task-"):-len(".json")])
                if parent in (None, record["asker"]) and _parent_of(pid) is not None:
                    found[pid] = record["env"]
    return found


def _parent_of(pid: int) -> int | None:
    """The parent of living process ``pid``; None once it has exited (a zombie too)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[1])


def start_task(command: list[str], *, env: dict[str, str], log: str) -> "ForkedTask | subprocess.Popen":
    """Start ``command`` as a process of its own session (one signal to its group reaches all of
    it), with environment ``env``, stdin from ``/dev/null`` and its output (stdout and stderr)
    appended to the file ``log``: forked from the shared fork server when it is ``python SCRIPT``,
    ``python -m MODULE`` or ``python -c CODE`` of this interpreter and ``env`` agrees with the
    server's at start-up (:func:`shared_server`); else a fresh process. Either way the result has
    ``pid``, ``poll()``, ``wait(timeout)`` and ``returncode``, as :class:`subprocess.Popen`.

    Example::

        import os, sys, tempfile
        from stratagem.testing import start_task
        log = os.path.join(tempfile.mkdtemp(), "task.log")
        task = start_task([sys.executable, "-c", "import sys; print('hello', sys.argv[1:])", "x"],
                          env=dict(os.environ), log=log)
        assert task.wait(120) == 0 and open(log).read() == "hello ['x']\\n"
    """
    open(log, "ab").close()
    server = shared_server(env)
    if server is not None and server.can_start(env):
        task = server.start_command(command, env, log)
        if task is not None:
            return task
    with open(log, "ab") as output:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_task(command: list[str], *, timeout: float, env: dict[str, str] | None = None,
             cwd: "str | os.PathLike | None" = None) -> "subprocess.CompletedProcess[str]":
    """What ``subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
    cwd=cwd)`` returns, with ``command`` forked from the shared fork server where
    :func:`start_task` would fork it (else run so, fresh), and its output as written: a carriage
    return stays one (``text=True`` would make it a newline). On the timeout its process group is
    killed and :class:`subprocess.TimeoutExpired` raised, with what it had printed.

    Example::

        import sys
        from stratagem.testing import run_task
        done = run_task([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                        timeout=120)
        assert (done.returncode, done.stdout, done.stderr) == (0, "out\\n", "err\\n")
    """
    env = dict(os.environ) if env is None else env
    server = shared_server(env)
    if server is None or not server.can_start(env) or fork_request(command, sys.executable) is None:
        done = subprocess.run(command, capture_output=True, timeout=timeout, env=env, cwd=cwd)
        return subprocess.CompletedProcess(command, done.returncode, *(
            raw.decode("utf-8", errors="replace") for raw in (done.stdout, done.stderr)))
    with tempfile.TemporaryDirectory(prefix="stratagem-run-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "wb").close()
        task = server.start_command(command, env, out, stderr_path=err, cwd=None if cwd is None else str(cwd))
        try:
            code = task.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(task.pid)
            task.wait()
            raise subprocess.TimeoutExpired(command, timeout, _text(out), _text(err)) from None
        finally:
            if task.poll() is None:    # (an exception in the wait: nothing is left behind)
                _kill_group(task.pid)
                task.wait()
        return subprocess.CompletedProcess(command, code, _text(out), _text(err))


def _text(path: str) -> str:
    # newline="": a carriage return the task wrote stays one (a progress bar's redraw is visible)
    with open(path, encoding="utf-8", errors="replace", newline="") as file:
        return file.read()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
