"""``stratagem launch`` with ``STRATAGEM_TEST_FORK_SERVER``: its tasks forked from the test fork
server (test infrastructure, ``stratagem/launch/forks.py``), still supervised as real processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.errors import ClusterConfigError
from stratagem.launch import launch_local
from stratagem.launch.forks import FORK_SERVER_VARIABLE
from stratagem.testing import task_environments

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server needs Linux"),
              pytest.mark.skipif(os.environ.get("STRATAGEM_TEST_FORKSERVER") == "0",
                                 reason="STRATAGEM_TEST_FORKSERVER=0: every task starts fresh"),
              pytest.mark.usefixtures("forked_launches")]

_SCRIPT = '''
import json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("REPORT " + json.dumps({"index": task["index"], "argv": sys.argv, "path0": sys.path[0], "ppid": os.getppid(),
                              "pid": os.getpid(),
                              "pgid": os.getpgid(0), "restart": os.environ["STRATAGEM_RESTART"],
                              "threads": os.environ.get("OMP_NUM_THREADS"), "name": __name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "fail-first" and task["index"] == 1 and os.environ["STRATAGEM_RESTART"] == "0":
    sys.exit(3)
if sys.argv[1] == "wait":
    import time
    print("waiting", flush=True)
    time.sleep(600)
'''


def _reports(output: str) -> list[dict]:
    return [json.loads(line.split("REPORT ", 1)[1]) for line in output.splitlines() if "REPORT " in line]


def _forked(parent: int) -> bool:
    """Whether ``parent`` is a fork server (``python .../forkserver.py FD``)."""
    args = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    return len(args) > 1 and os.path.basename(args[1]) == b"forkserver.py"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "task.py"
    path.write_text(_SCRIPT)
    return path


def _launch(script: Path, *args: str, **options: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, list(args), stdout=out, stderr=err, **options)
    return status, out.getvalue(), err.getvalue()


def test_the_tasks_are_forked_and_a_failure_restarts_the_group(script: Path) -> None:
    status, out, err = _launch(script, "fail-first", num_workers=2, max_restarts=1)
    assert status == 0, out + err
    reports = _reports(out)
    assert sorted(r["restart"] for r in reports) == ["0", "0", "1", "1"]
    for report in reports:
        assert _forked(report["ppid"]) and report["pgid"] == report["pid"] and report["name"] == "__main__"
        assert report["argv"] == [str(script), "fail-first"] and report["path0"] == str(script.parent)
    assert out.count("to stderr") == 4                             # stderr comes through the pipe too
    assert "worker 1 exited with code 3; restarting all 2 tasks" in err


def test_module_and_code_commands_are_forked_as_python_would_run_them(script: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # parameter-server training: the servers run the server command, here `python -c` (one
    # that exits 0 at once) and `python -m` (the json.tool module: reads nothing from stdin)
    monkeypatch.chdir(tmp_path)
    report = "import os, sys; print('SERVER', sys.argv, repr(sys.path[0]), os.getppid(), flush=True)"
    status, out, err = _launch(script, "ok", num_workers=1, num_ps=1,
                               server_command=[sys.executable, "-c", report, "x"])
    assert status == 0, out + err
    line = next(line for line in out.splitlines() if "SERVER" in line)
    assert "['-c', 'x'] ''" in line and _forked(int(line.split()[-1]))
    status, out, err = _launch(script, "ok", num_workers=1, num_ps=1,
                               server_command=[sys.executable, "-m", "json.tool", "--help"])
    assert status == 0 and "usage:" in out and "json.tool" in out, out + err


def test_a_task_with_other_start_up_variables_starts_fresh(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3" if os.environ.get("OMP_NUM_THREADS") != "3" else "2")
    status, out, err = _launch(script, "ok", num_workers=1)
    assert status == 0, out + err
    [report] = _reports(out)
    assert not _forked(report["ppid"]) and report["ppid"] == os.getpid()


def test_the_command_forks_its_tasks_and_signals_stop_them(script: Path, tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(script), "wait"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while seen.count("waiting") < 2:
            line = launcher.stdout.readline()
            assert line, f"the launcher exited ({launcher.poll()}) before its tasks waited: {seen}"
            seen += line
        pids = [r["pid"] for r in _reports(seen)]
        assert all(_forked(r["ppid"]) for r in _reports(seen))
        # found by the TF_CONFIG the launcher gave each (their /proc/PID/environ is the server's)
        tasks = {json.loads(env["TF_CONFIG"])["task"]["index"]: pid
                 for pid, env in task_environments(launcher.pid).items() if "TF_CONFIG" in env}
        assert tasks == {r["index"]: r["pid"] for r in _reports(seen)}, (tasks, seen)
        assert all(b"TF_CONFIG=" not in Path(f"/proc/{pid}/environ").read_bytes() for pid in pids)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 143
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) or set(pids) & set(task_environments(launcher.pid)):
        assert time.monotonic() < deadline, "a forked task (or its record) outlived its launcher's stop"
        time.sleep(0.05)


def test_a_variable_naming_no_server_is_an_error(script: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORK_SERVER_VARIABLE, str(tmp_path / "no-server"))
    with pytest.raises(ClusterConfigError, match=f"{FORK_SERVER_VARIABLE}=.*names no running fork server.*unset it"):
        _launch(script, "ok", num_workers=1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
