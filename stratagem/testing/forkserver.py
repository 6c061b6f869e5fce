"""The test fork server (see :mod:`stratagem.testing.forked`), run as a script: it imports
torch once, then forks one child per task it is asked for, which becomes that task and runs
its script. The standard library and torch only: nothing here may read a task's environment
before the child has taken it."""

import ctypes
import faulthandler
import io
import json
import os
import runpy
import select
import signal
import sys


def _serve() -> dict:
    """Fork a child per request; report its pid, then its exit code. Returns in a child only,
    with its request; when the test process closes the pipe (or dies), the server exits."""
    # what a task of a strategy imports before its first step (most of its start-up): torch,
    # torch.distributed, DTensor and dynamo (the compiler's decorators; sympy with them)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    pending, children = b"", set()
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if children else 1.0)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                os._exit(0)    # the children get SIGKILL (their parent-death signal)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    replies.close()
                    _become_task(request)
                    os.write(ready_w, b"x")
                    os.close(ready_w)
                    return request
                os.close(ready_w)
                os.read(ready_r, 1)    # the child is in its own session: its group can be signalled
                os.close(ready_r)
                children.add(pid)
                replies.write(json.dumps({"started": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            replies.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _become_task(request: dict) -> None:
    """In the forked child: take the task's session, environment, files and arguments."""
    os.setsid()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG: die with the server
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(request["script"])
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()


if __name__ == "__main__":
    _task = _serve()
    runpy.run_path(_task["script"], run_name="__main__")
