"""``stratagem launch --join-timeout``: tasks that never join their cluster stop the job (real processes).

A job whose tasks all hang before their strategy (a deadlock, a data set that never
loads, a stopped process) has nobody at the rendezvous to time out: without the
launcher's join timeout it waits for ever. Each test checks the exit status, the message
naming the tasks, the time it took, and that no process is left behind.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.cluster.joined import JOINED_VARIABLE, mark_joined
from stratagem.errors import InvalidArgumentError
from stratagem.launch import launch_local
from stratagem.launch.command import build_parser
from stratagem.launch.joining import JoinWatch

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("forked_launches")]

# Shared by the scripts: the task's name, pid files, and how a stand-in task joins without
# torch (what a real strategy does once its group is formed: mark the launcher's folder).
_PRELUDE = '''
import json, os, signal, subprocess, sys, time
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = "chief" if TASK["type"] == "chief" else f"{TASK['type']} {TASK['index']}"
OUT = sys.argv[1]

def record_pids():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    for pid in (os.getpid(), child.pid):
        with open(os.path.join(OUT, f"{pid}.pid"), "w") as f:
            f.write(str(pid))

def join():
    from stratagem.cluster.joined import mark_joined
    mark_joined(NAME)
'''


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(_PRELUDE + textwrap.dedent(body))
    return path


def _cli(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "stratagem.launch", *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _assert_nothing_left(tmp_path: Path, expected: int, timeout: float = 10.0) -> None:
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == expected, pids
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes {alive} outlived the launcher"


@pytest.mark.multiprocess
def test_workers_that_hang_before_their_strategy_stop_the_job(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        record_pids()
        print("loading the data (for ever)", flush=True)
        time.sleep(600)
        import stratagem as sg
        sg.MultiWorkerMirroredStrategy()
    ''')
    result, elapsed = _cli(tmp_path, "--workers", "2", "--join-timeout", "5", str(script), str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "[worker 0] loading the data (for ever)" in result.stdout
    assert ("[launch] worker 0, worker 1 did not join the cluster within 5 s of starting "
            "(--join-timeout): a task joins once its sg.MultiWorkerMirroredStrategy() has met the "
            "other workers") in result.stderr
    assert "stopping 2 task(s), not restarting" in result.stderr
    assert "raise --join-timeout (0 waits for ever)" in result.stderr
    assert 5 < elapsed < 60
    _assert_nothing_left(tmp_path, expected=4)   # 2 tasks and their children


@pytest.mark.multiprocess
def test_a_worker_stopped_before_joining_is_named_and_killed(tmp_path: Path) -> None:
    # worker 0 waits at the rendezvous (its own timeout is minutes away); worker 1 is stopped
    script = _script(tmp_path, '''
        record_pids()
        if NAME == "worker 1":
            os.kill(os.getpid(), signal.SIGSTOP)
        import stratagem as sg
        sg.MultiWorkerMirroredStrategy()
        print("joined", flush=True)
    ''')
    result, elapsed = _cli(tmp_path, "--workers", "2", "--join-timeout", "5", "--max-restarts", "2",
                           str(script), str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert ("[launch] worker 0, worker 1 did not join the cluster within 5 s of starting "
            "(--join-timeout); worker 1 is stopped (SIGSTOP or a debugger)") in result.stderr
    assert "[launch] worker 1 is stopped (SIGSTOP or a debugger) and cannot act on SIGTERM; killing it" \
        in result.stderr
    assert "restart" not in result.stderr.replace("not restarting", "")   # a hang is not restarted
    assert "joined" not in result.stdout
    assert 5 < elapsed < 60
    _assert_nothing_left(tmp_path, expected=4)


@pytest.mark.multiprocess
def test_a_coordinator_that_hangs_before_its_strategy_stops_a_ps_job(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        record_pids()
        time.sleep(600)
    ''')
    result, elapsed = _cli(tmp_path, "--ps", "1", "--workers", "1", "--join-timeout", "5",
                           str(script), str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert ("[launch] chief did not join the cluster within 5 s of starting (--join-timeout): the "
            "coordinator joins once its sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver()) "
            "has reached every parameter server; stopping 3 task(s), not restarting") in result.stderr
    assert 5 < elapsed < 90
    _assert_nothing_left(tmp_path, expected=2)


@pytest.mark.multiprocess
def test_a_ps_coordinator_joins_once_its_strategy_reaches_the_servers(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        import stratagem as sg
        from stratagem.cluster.joined import JOINED_VARIABLE
        mark = os.path.join(os.environ[JOINED_VARIABLE], "chief")
        print("before:", os.path.exists(mark), flush=True)
        strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
        print("after:", os.path.exists(mark), flush=True)
    ''')
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, [str(tmp_path)], num_workers=1, num_ps=1, stdout=out, stderr=err)
    lines = [" ".join(line.split()) for line in out.getvalue().splitlines()]   # (prefixes are aligned)
    assert "[chief] before: False" in lines and "[chief] after: True" in lines, lines
    assert "did not join" not in err.getvalue()
    assert status == 1   # (it never created a variable: the launcher's end-of-job check says so)


@pytest.mark.multiprocess
def test_a_restarted_group_must_join_again(tmp_path: Path) -> None:
    # The first start joins (its marks stay in the folder), then fails; the second start hangs
    # before joining: the old marks must not count for the new processes.
    script = _script(tmp_path, '''
        if os.environ["STRATAGEM_RESTART"] == "0":
            join()
            print("joined", flush=True)
            sys.exit(3 if NAME == "worker 1" else 0)
        record_pids()
        time.sleep(600)
    ''')
    start = time.monotonic()
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, [str(tmp_path)], num_workers=2, max_restarts=1, join_timeout=8.0,
                          stdout=out, stderr=err)
    assert status == 1, err.getvalue()
    assert out.getvalue().count("joined") == 2
    assert "worker 1 exited with code 3; restarting all 2 tasks (restart 1/1)" in err.getvalue()
    assert "[launch] worker 0, worker 1 did not join the cluster within 8 s" in err.getvalue()
    assert time.monotonic() - start < 60
    _assert_nothing_left(tmp_path, expected=4)


@pytest.mark.multiprocess
def test_tasks_that_joined_may_run_past_the_join_timeout(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        join()
        time.sleep(3)
        print("done", flush=True)
    ''')
    out, err = io.StringIO(), io.StringIO()
    assert launch_local(script, [str(tmp_path)], num_workers=2, join_timeout=1.0,
                        stdout=out, stderr=err) == 0, err.getvalue()
    assert out.getvalue().count("done") == 2 and err.getvalue() == ""


@pytest.mark.multiprocess
@pytest.mark.parametrize("options", [
    {"num_workers": 1},                        # a lone worker has no cluster to join
    {"num_workers": 2, "join_timeout": 0},     # 0: no join timeout
])
def test_no_join_timeout_where_there_is_nothing_to_join(tmp_path: Path, options: dict) -> None:
    script = _script(tmp_path, '''
        time.sleep(3)
        print("done", flush=True)
    ''')
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, [str(tmp_path)], stdout=out, stderr=err,
                          **{"join_timeout": 1.0, **options})
    assert status == 0, err.getvalue()
    assert "did not join" not in err.getvalue()


def test_the_default_is_generous_and_the_flag_is_checked(tmp_path: Path) -> None:
    args = build_parser().parse_args(["train.py"])
    assert args.join_timeout == 600.0
    assert build_parser().parse_args(["--join-timeout", "30", "train.py"]).join_timeout == 30.0
    script = _script(tmp_path, 'raise SystemExit("must not run")')
    for bad in (-1, float("nan"), True, "5"):
        with pytest.raises(InvalidArgumentError, match=r"--join-timeout \(join_timeout\) must be a number"):
            launch_local(script, join_timeout=bad)


def test_join_watch_counts_only_marks_made_after_the_start(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "joined"
    folder.mkdir()
    (folder / "worker-0").touch()          # a mark of an earlier process of the task, a while ago
    os.utime(folder / "worker-0", ns=(10**18, 10**18))
    watch = JoinWatch(folder, timeout=0.0)
    watch.started("worker 0")
    watch.started("worker 1")
    assert watch.late(["worker 0", "worker 1"]) == ["worker 0", "worker 1"]
    monkeypatch.setenv(JOINED_VARIABLE, str(folder))
    mark_joined("worker 0")                # the new process marks again
    assert watch.late(["worker 0", "worker 1"]) == ["worker 1"]
    assert watch.late(["worker 0"]) == []  # worker 1 exited: no longer late
    assert JoinWatch(folder, timeout=60.0).late(["worker 0"]) == []   # not watched
