"""The tasks of ``stratagem launch`` die with their launcher, however it dies (real processes).

Each test starts ``python -m stratagem.launch`` as a user would, waits until every task
prints that it trains, records every process below the launcher (tasks, their children:
a subprocess, a data-loader worker, ``stratagem server`` processes), stops the launcher
(SIGKILL, or SIGTERM), and polls ``/proc`` until every one of them is gone: no
task, child or reaper may outlive the launcher by more than a bounded time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stratagem.launch.lifeline import Reaper

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

_GONE_WITHIN = 30.0   # seconds after the launcher's death (the grace period is 2 s)

# A task of a collective job: joins the group, starts a child and a data-loader worker,
# says it trains, and trains until it is stopped.
_WORKER = '''
import os, subprocess, sys, time
import torch
import stratagem as sg

strategy = sg.MultiWorkerMirroredStrategy()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 9
    def __getitem__(self, index):
        return torch.ones(2)

loader = iter(torch.utils.data.DataLoader(Rows(), batch_size=4, num_workers=1))
with strategy.scope():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def step(x):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()

strategy.run(step, args=(next(loader),))
print("training", flush=True)
while True:
    strategy.run(step, args=(next(loader),))
    time.sleep(0.05)
'''

# The coordinator of a parameter-server job: its steps run on real `stratagem server` tasks.
_COORDINATOR = '''
import subprocess, sys, time
import torch
import stratagem as sg

strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
coordinator = sg.ClusterCoordinator(strategy)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with strategy.scope():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def step():
    optimizer.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()

coordinator.schedule(step)
coordinator.join()
print("training", flush=True)
while True:
    coordinator.schedule(step)
    time.sleep(0.05)
'''


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent has exited)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _descendants(root: int) -> set[int]:
    """Every living process below ``root``, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _assert_all_gone(pids: set[int], timeout: float = _GONE_WITHIN) -> float:
    """Waits until none of ``pids`` runs; returns how long that took. Kills leftovers on failure."""
    start = time.monotonic()
    while any(_alive(pid) for pid in pids) and time.monotonic() - start < timeout:
        time.sleep(0.05)
    alive = {pid: _command(pid) for pid in pids if _alive(pid)}
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"these processes outlived the launcher by {timeout:g} s: {alive}"
    return time.monotonic() - start


class _Launcher:
    """``python -m stratagem.launch ...`` with its output read as it comes."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "stratagem.launch", *args], cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(" ".join(line.split()))   # "[chief]    x" (prefixes are aligned): "[chief] x"

    def wait_for(self, *texts: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(any(text in line for line in self.lines) for text in texts):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                out = "\n".join(self.lines)
                raise AssertionError(f"never saw {texts}; launcher status {self.process.wait()}\n"
                                     f"{out}\n{self.process.stderr.read()}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _run_and_stop(tmp_path: Path, code: str, args: list[str], expect: list[str],
                  signum: int) -> tuple[_Launcher, list[str], str]:
    """Launches ``code``, waits for ``expect`` lines, sends ``signum`` to the launcher, and
    checks that every process it had below it is gone. Returns the launcher, the command
    lines of those processes, and the launcher's stderr."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    launcher = _Launcher("--grace-period", "2", *args, str(script), cwd=tmp_path)
    try:
        launcher.wait_for(*expect)
        below = _descendants(launcher.process.pid)
        commands = [_command(pid) for pid in below]
        launcher.process.send_signal(signum)
        launcher.process.wait(timeout=60)
        _assert_all_gone(below)
        err = launcher.process.stderr.read()   # EOF once the reaper (which shares it) is gone too
    finally:
        launcher.close()
    return launcher, commands, err


# SIGINT takes SIGTERM's path (local.py's _signals_to hands both to Supervisor.interrupt, which differ
# only in the exit status and the message; test_launch.py's test_a_signal_to_the_launcher_stops_every_task
# checks both signals): one of the two here
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_collective_job_dies_with_its_launcher(tmp_path: Path, signum: int) -> None:
    launcher, commands, err = _run_and_stop(tmp_path, _WORKER, ["--workers", "2"],
                                            ["[worker 0] training", "[worker 1] training"], signum)
    # two tasks, each with a child and a data-loader worker, and the reaper: all gone now
    assert sum("train.py" in command for command in commands) == 4, commands  # (forked workers too)
    assert sum("time.sleep(600)" in command for command in commands) == 2, commands
    assert sum("lifeline.py" in command for command in commands) == 1, commands
    assert len(commands) >= 7, commands
    if signum == signal.SIGKILL:
        assert launcher.process.returncode == -signal.SIGKILL
        assert "[launch] the launcher (pid" in err and "exited without stopping its tasks" in err
        assert "stopping 2 task(s) and their children" in err
    else:
        assert launcher.process.returncode == 143
        assert f"[launch] received {signal.Signals(signum).name}; stopping 2 task(s)" in err
        assert "exited without stopping its tasks" not in err   # the launcher did it itself


def test_a_parameter_server_job_dies_with_its_launcher(tmp_path: Path) -> None:
    launcher, commands, err = _run_and_stop(tmp_path, _COORDINATOR, ["--ps", "1", "--workers", "2"],
                                            ["[chief] training"], signal.SIGKILL)
    assert sum(command.endswith("-m stratagem server ") for command in commands) == 3, commands
    assert sum("time.sleep(600)" in command for command in commands) == 1, commands
    assert len(commands) >= 6, commands   # the chief and its child, 3 servers, the reaper
    assert launcher.process.returncode == -signal.SIGKILL
    assert "stopping 4 task(s) and their children" in err, err


def test_tasks_of_run_local_cluster_die_with_their_parent(tmp_path: Path) -> None:
    script = tmp_path / "task.py"
    script.write_text(textwrap.dedent('''
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("running", flush=True)
        time.sleep(600)
    '''))
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        from stratagem.testing import run_local_cluster
        run_local_cluster({str(script)!r}, num_workers=2, timeout=600)
    ''')])
    try:
        deadline = time.monotonic() + 60
        # 2 tasks, their 2 children, the reaper (and the fork server the tasks are forked from)
        while True:
            below = _descendants(parent.pid)
            if sum("time.sleep(600)" in _command(pid) for pid in below) == 2:
                break
            assert time.monotonic() < deadline, [_command(pid) for pid in below]
            time.sleep(0.05)
        assert len(below) >= 5, [_command(pid) for pid in below]
        parent.kill()
        parent.wait()
        _assert_all_gone(below)
    finally:
        parent.kill()
        parent.wait()


def test_without_the_reaper_the_tasks_still_get_the_parent_death_signal(tmp_path: Path) -> None:
    # The reaper killed together with the launcher (kill -9 of both, the OOM killer): the
    # kernel still sends each task SIGTERM when the launcher dies.
    script = tmp_path / "task.py"
    script.write_text('import time\nprint("running", flush=True)\ntime.sleep(600)\n')
    launcher = _Launcher("--workers", "2", str(script), cwd=tmp_path)
    try:
        launcher.wait_for("[worker 0] running", "[worker 1] running")
        below = _descendants(launcher.process.pid)
        reaper = [pid for pid in below if "lifeline.py" in _command(pid)]
        assert len(reaper) == 1 and len(below) == 3, [_command(pid) for pid in below]
        os.kill(reaper[0], signal.SIGKILL)
        launcher.process.kill()
        launcher.process.wait()
        assert _assert_all_gone(below) < 10
    finally:
        launcher.close()


def test_the_reaper_leaves_alone_a_group_whose_id_was_reused(tmp_path: Path) -> None:
    # A group id is a process id: once the launcher's task is gone, the id may name a new,
    # unrelated process. The reaper signals only the process the launcher started.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                start_new_session=True)
    try:
        reaper = Reaper(grace_period=0.0)
        reaper._send(f"+{stranger.pid} 1\n")   # "started at tick 1": another process than this one
        reaper._process.stdin.close()          # what the launcher's death does
        reaper._process.wait(timeout=30)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_lost_reaper_is_reported(tmp_path: Path) -> None:
    said: list[str] = []
    reaper = Reaper(grace_period=0.0, on_lost=said.append)
    reaper._process.kill()
    reaper._process.wait()
    reaper.watch(os.getpid())
    reaper.watch(os.getpid())
    assert len(said) == 1 and "the launcher's reaper process exited" in said[0], said
    assert "its tasks still get SIGTERM" in said[0]
    reaper.close()
