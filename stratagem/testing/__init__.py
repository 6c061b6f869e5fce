"""Helpers to run real multi-process clusters on one machine, for tests.

:func:`run_local_cluster` starts one process per task of a loopback cluster, each
with its TF_CONFIG, waits for all of them with a deadline, and always cleans up:
on timeout or failure every process group is killed. Ports are free ports. The tasks
die with the process that started them even when it is killed (a test run stopped
with SIGKILL, or a timeout that ends the interpreter): SIGKILL from the kernel to each
task, and from a reaper process to each task's process group
(:mod:`stratagem.launch.lifeline`).

Example::

    import sys, tempfile, pathlib
    from stratagem.testing import run_local_cluster
    script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    script.write_text("import json, os; print(json.loads(os.environ['TF_CONFIG'])['task'])")
    results = run_local_cluster(script, num_workers=2, timeout=60)
    assert all(r.returncode == 0 for r in results)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from stratagem.launch.lifeline import Reaper, die_with_parent
from stratagem.launch.ports import free_ports
from stratagem.testing.forked import run_task, shared_server, start_task, task_environments

__all__ = ["TaskResult", "assert_succeeded", "free_ports", "local_cluster", "run_local_cluster", "run_task",
           "start_task", "task_environments"]


def local_cluster(num_workers: int, *, chief: bool = False, num_ps: int = 0,
                  host: str = "127.0.0.1") -> dict[str, list[str]]:
    """A cluster dict of loopback addresses on free ports."""
    ports = iter(free_ports(num_workers + int(chief) + num_ps, host))
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster["chief"] = [f"{host}:{next(ports)}"]
    if num_workers:
        cluster["worker"] = [f"{host}:{next(ports)}" for _ in range(num_workers)]
    if num_ps:
        cluster["ps"] = [f"{host}:{next(ports)}" for _ in range(num_ps)]
    return cluster


@dataclass
class TaskResult:
    task: str
    returncode: int
    output: str


def run_local_cluster(script: "str | Path", num_workers: int, *, args: Sequence[str] = (),
                      chief: bool = False, timeout: float = 120, env: dict[str, str] | None = None,
                      kill_after: dict[str, "float | str"] | None = None,
                      stop_after: dict[str, "float | str"] | None = None) -> list[TaskResult]:
    """Run ``script`` once per task of a local cluster; return each task's exit code and output.

    ``kill_after={"worker 1": 3.0}`` SIGKILLs that task after 3 s, ``kill_after={"worker 1":
    "reached step 1"}`` once its output contains that text (observable progress: what a fault test
    should wait for, whatever the machine's load); ``stop_after`` SIGSTOPs it (a hung peer).
    Raises ``TimeoutError`` (after killing everything) when the deadline passes. Tasks are
    forked from a process that imported torch once (:mod:`stratagem.testing.forked`: the
    same script, arguments, environment and signals, without each task's seconds of import).
    """
    cluster = local_cluster(num_workers, chief=chief)
    tasks = [(job, i) for job in ("chief", "worker") for i in range(len(cluster.get(job, [])))]
    procs: list[tuple[str, subprocess.Popen]] = []
    logs: list = []
    # a task that crashes in C (a signal) prints every thread's Python stack before it dies
    base_env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {}), "PYTHONUNBUFFERED": "1"}
    reaper = Reaper(grace_period=0.0)
    server = shared_server(base_env)
    try:
        for job, index in tasks:
            task_env = {**base_env, "TF_CONFIG": json.dumps({"cluster": cluster,
                                                           "task": {"type": job, "index": index}})}
            name = "chief" if job == "chief" else f"{job} {index}"
            log = tempfile.NamedTemporaryFile(mode="w+", prefix="stratagem-task-")  # never a pipe that could fill up
            logs.append(log)
            if server is not None and server.can_start(task_env):
                proc = server.start(str(script), list(args), task_env, log.name)
            else:
                proc = subprocess.Popen([sys.executable, str(script), *args], env=task_env,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True,
                                        preexec_fn=die_with_parent(signal.SIGKILL))
            reaper.watch(proc.pid)
            procs.append((name, proc))
        deadline = time.monotonic() + timeout
        kills = {name: (after, signal.SIGKILL) for name, after in (kill_after or {}).items()}
        kills.update({name: (after, signal.SIGSTOP) for name, after in (stop_after or {}).items()})
        started = time.monotonic()
        stopped: set[str] = set()
        while any(p.poll() is None for _, p in procs):
            now = time.monotonic()
            if now > deadline:
                for _, proc in procs:
                    _kill(proc)
                    proc.wait()
                raise TimeoutError(f"the cluster did not finish within {timeout} s; outputs:\n" +
                                   "\n".join(f"--- {n} ---\n{_read(log)}" for (n, _), log in zip(procs, logs)))
            for (name, proc), log in zip(procs, logs):
                when = kills[name][0] if name in kills else None
                if when is not None and (now - started >= when if not isinstance(when, str)
                                         else when in _peek(log)):
                    sig = kills.pop(name)[1]
                    _kill(proc, sig)
                    if sig == signal.SIGSTOP:
                        stopped.add(name)
            if all(p.poll() is not None or n in stopped for n, p in procs):
                break  # everyone still running is stopped on purpose: the finally clause kills them
            time.sleep(0.05)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                _kill(proc)
            proc.wait()
            reaper.forget(proc.pid)
        reaper.close()
    results = [TaskResult(name, proc.returncode, _read(log)) for (name, proc), log in zip(procs, logs)]
    for log in logs:
        log.close()
    return results


def assert_succeeded(results: Sequence[TaskResult], *, tail: int = 8000) -> None:
    """Raise ``AssertionError`` unless every task exited 0, showing the output of each one that
    did not (the last ``tail`` characters): the task that failed first is often not worker 0,
    whose error only says that a peer stopped answering.

    Example::

        import tempfile, pathlib
        from stratagem.testing import assert_succeeded, run_local_cluster
        script = pathlib.Path(tempfile.mkdtemp()) / "ok.py"
        script.write_text("print('trained')")
        assert_succeeded(run_local_cluster(script, num_workers=2, timeout=60))
    """
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise AssertionError(
            f"{', '.join(f'{r.task} exited {r.returncode}' for r in failed)}:\n" +
            "\n".join(f"--- {r.task} (exit {r.returncode}) ---\n{r.output[-tail:]}" for r in failed))


def _peek(log) -> str:
    """What the task wrote so far, without moving the file offset it shares with the task."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def _kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
