"""The test fork server (see :mod:`stratagem.testing.forked`), run as a script: it imports
torch and stratagem's core once, then forks one child per task it is asked for, which becomes
that task and runs its script (or module, or code). Nothing imported here may read a task's
environment before the child has taken it: the standard library, torch, and of stratagem only
modules that read none when imported (:mod:`stratagem.testing.preloaded`, imported with every
``STRATAGEM_*`` variable out of the server's environment), whose one use of the environment the
child makes once it has its own (``preloaded.task_started``).

Two kinds of client ask: the test process, over stdin (a request names a log file, and may name
another for stderr) with replies on stdout; and launchers (``stratagem launch`` under
``STRATAGEM_TEST_FORK_SERVER``, :mod:`stratagem.launch.forks`), over the listening Unix socket
whose descriptor is the first argument (a request comes with the task's output descriptor).
Each client gets its tasks' pids, then their exit codes; a launcher's connection that closes
sends its live tasks SIGTERM. Each live task has a file ``task-PID.json`` beside the socket: the pid
of the process that asked for it and the environment it was given (its ``/proc/PID/environ`` is the
server's), written before anyone learns the pid (``forked.task_environments``)."""

import atexit
import ctypes
import faulthandler
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import types

_START_ENV = dict(os.environ)   # what the imports below read


def _serve() -> dict:
    """Fork a child per request; report its pid, then its exit code. Returns in a child only,
    with its request; when the test process closes the pipe (or dies), the server exits."""
    # what a task of a strategy imports before its first step (most of its start-up): torch,
    # torch.distributed, DTensor and dynamo (the compiler's decorators; sympy with them)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    _preload()

    # what exists now is never collected: a child's collections, which would touch (and so copy)
    # every page of torch's objects, leave them alone
    gc.freeze()
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    replies.write(b'{"ready": true}\n')
    listener = socket.socket(fileno=int(sys.argv[1])) if len(sys.argv) > 1 else None
    hello = json.dumps({"env": _START_ENV, "executable": sys.executable,
                        "netns": os.readlink("/proc/self/ns/net")}).encode()
    pending, children, launchers = b"", {}, []   # children: pid -> the launcher that asked (None: stdin)
    folder = os.path.dirname(listener.getsockname()) if listener is not None else None
    askers: dict[socket.socket, int] = {}   # a launcher's connection -> the launcher's pid

    def fork(request: dict, output: int | None, client: socket.socket | None) -> int:
        asker = os.getppid() if client is None else askers.get(client, 0)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            replies.close()
            for s in [listener, *launchers]:
                if s is not None:
                    s.close()
            _become_task(request, output)
            _record(folder, asker, request["env"])
            os.write(ready_w, b"x")
            os.close(ready_w)
            return 0
        os.close(ready_w)
        os.read(ready_r, 1)    # the child is in its own session: its group can be signalled
        os.close(ready_r)
        if output is not None:
            os.close(output)
        children[pid] = client
        return pid

    while True:
        waiting = [0, *([listener] if listener else []), *launchers]
        ready, _, _ = select.select(waiting, [], [], 0.05 if children else 1.0)
        for source in ready:
            if source == 0:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    os._exit(0)    # the children get SIGKILL (their parent-death signal)
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    if (pid := fork(request, None, None)) == 0:
                        return request
                    replies.write(json.dumps({"started": pid}).encode() + b"\n")
            elif source is listener:
                client, _ = listener.accept()
                launchers.append(client)
                askers[client] = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                       struct.calcsize("3i")))[0]
                _send(client, hello)
            else:
                try:
                    message, fds, _, _ = socket.recv_fds(source, 1 << 20, 1)
                except OSError:
                    message, fds = b"", []
                if not message:   # the launcher exited: what its own parent-death signal would do
                    for fd in fds:
                        os.close(fd)
                    for pid in [pid for pid, owner in children.items() if owner is source]:
                        os.kill(pid, signal.SIGTERM)    # (its exit code then goes to no one)
                    launchers.remove(source)
                    askers.pop(source, None)
                    source.close()
                    continue
                request = json.loads(message)
                if (pid := fork(request, fds[0], source)) == 0:
                    return request
                _send(source, json.dumps({"started": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if folder is not None:
                try:
                    os.unlink(os.path.join(folder, f"task-{pid}.json"))
                except FileNotFoundError:
                    pass
            reply = {"exited": pid, "code": os.waitstatus_to_exitcode(status)}
            client = children.pop(pid)
            if client is None:
                replies.write(json.dumps(reply).encode() + b"\n")
            elif client in launchers:
                _send(client, json.dumps(reply).encode())


def _preload() -> None:
    """Import :mod:`stratagem.testing.preloaded` with no ``STRATAGEM_*`` variable in sight; an import
    that fails is left to the task, whose own import then says why."""
    hidden = {key: os.environ.pop(key) for key in [k for k in os.environ if k.startswith("STRATAGEM_")]}
    try:
        import stratagem.testing.preloaded  # noqa: F401
    except Exception:  # noqa: BLE001 - (the task's import raises it again, in the task)
        pass
    finally:
        os.environ.update(hidden)


def _record(folder: str | None, asker: int, env: dict) -> None:
    """In the forked child: ``folder/task-PID.json``, who asked for this task and its environment."""
    if folder is None:
        return
    path = os.path.join(folder, f"task-{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as file:
            json.dump({"asker": asker, "env": env}, file)
        os.replace(path + ".tmp", path)
    except OSError:   # (the test process is removing the folder: it is exiting)
        pass


def _send(client: socket.socket, message: bytes) -> None:
    try:
        client.sendall(message)
    except OSError:
        pass    # the launcher is gone: its end-of-file comes next


def _become_task(request: dict, output: int | None) -> None:
    """In the forked child: take the task's session, environment, files and arguments."""
    os.setsid()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG: die with the server
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND) if output is None else output
    errors = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND) if "stderr" in request else log
    os.dup2(log, 1)
    os.dup2(errors, 2)
    for fd in {null, log, errors}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "script" in request:    # as `python SCRIPT ARGS`
        sys.argv = [request.get("argv0", request["script"]), *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])
    else:                      # as `python -m MODULE ARGS` or `python -c CODE ARGS`
        sys.argv = ["-m" if "module" in request else "-c", *request["args"]]
        sys.path[0] = os.getcwd() if "module" in request else ""
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()


def _run(task: dict) -> None:
    """Run the task's code as ``python`` would, then exit as it would (non-daemon threads joined,
    ``atexit`` handlers, the script's objects finalized, std streams flushed), less the teardown of
    every module: in a child of the server that would touch, and so copy, all of torch's memory."""
    scope, code = {}, 0
    try:
        if (preloaded := sys.modules.get("stratagem.testing.preloaded")) is not None:
            preloaded.task_started()   # (what the imports do with the environment in a fresh interpreter)
        if "script" in task:
            scope = runpy.run_path(task["script"], run_name="__main__")
        elif "module" in task:
            scope = runpy.run_module(task["module"], run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            scope = main.__dict__
            exec(compile(task["code"], "<string>", "exec"), scope)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException as error:   # noqa: BLE001 (what the interpreter does with it)
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
        if isinstance(error, KeyboardInterrupt):   # the interpreter ends by SIGINT then
            code = -signal.SIGINT
    threading._shutdown()   # (what interpreter exit calls: multiprocessing's children do the same)
    atexit._run_exitfuncs()
    scope.clear()
    gc.collect()            # the script's own objects: files flushed and closed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    _run(_serve())
