"""Tasks forked from the test fork server behave as fresh ``python script.py`` processes
(real processes: the server, its children, signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster, run_task, start_task
from stratagem.testing.forked import close_server, shared_server
from stratagem.testing.hosts import HostsUnavailable, network_hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server needs Linux"),
              pytest.mark.skipif(os.environ.get("STRATAGEM_TEST_FORKSERVER") == "0",
                                 reason="STRATAGEM_TEST_FORKSERVER=0: every task starts fresh")]

_SCRIPT = '''
import atexit, json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
atexit.register(lambda: print("atexit ran", flush=True))
print("REPORT " + json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                              "ppid": os.getppid(), "pgid": os.getpgid(0), "pid": os.getpid(),
                              "stdin": sys.stdin.read(), "extra": os.environ.get("EXTRA"),
                              "torch": "torch" in sys.modules,
                              "threads": __import__("torch").get_num_threads()}), flush=True)
if sys.argv[1] == "raise" and task["index"] == 1:
    raise ValueError("worker 1 fails")
if sys.argv[1] == "wait":
    import time
    print("waiting", flush=True)
    time.sleep(600)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
'''


def _report(output: str) -> dict:
    return json.loads(output.split("REPORT ", 1)[1].splitlines()[0])


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "task.py"
    path.parent.mkdir()
    path.write_text(_SCRIPT)
    return path


def test_a_forked_task_runs_as_a_fresh_interpreter_would(script: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert shared_server() is not None
    results = run_local_cluster(script, 2, args=["ok", "7"], env={"EXTRA": "x"}, timeout=120)
    for r in results:
        report = _report(r.output)
        assert r.returncode == 7
        assert report["name"] == "__main__" and report["argv"] == [str(script), "ok", "7"]
        assert report["path0"] == str(script.parent) and report["cwd"] == str(tmp_path)
        assert report["pgid"] == report["pid"]          # a session of its own
        assert _forked(report["ppid"])                  # forked: torch came imported
        assert report["torch"] and report["stdin"] == "" and report["extra"] == "x"
        assert "atexit ran" in r.output


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(script: Path) -> None:
    results = run_local_cluster(script, 2, args=["raise"], timeout=120)
    assert [r.returncode for r in results] == [0, 1]
    assert "ValueError: worker 1 fails" in results[1].output and "Traceback" in results[1].output
    assert "atexit ran" in results[1].output


def test_an_environment_read_at_import_gets_a_server_started_with_it(script: Path) -> None:
    # torch reads OMP_NUM_THREADS when it is imported: a server started without it would give
    # its tasks the machine's thread count
    for threads in (1, 2, 1):
        results = run_local_cluster(script, 1, args=["ok"], env={"OMP_NUM_THREADS": str(threads)}, timeout=120)
        report = _report(results[0].output)
        assert results[0].returncode == 0 and _forked(report["ppid"]) and report["threads"] == threads


def test_kill_and_stop_reach_a_forked_task(script: Path) -> None:
    results = run_local_cluster(script, 2, args=["wait"], kill_after={"worker 0": "waiting"},
                                stop_after={"worker 1": "waiting"}, timeout=120)
    assert [r.returncode for r in results] == [-signal.SIGKILL, -signal.SIGKILL]


def test_the_tasks_die_with_the_server(script: Path, tmp_path: Path) -> None:
    server = shared_server()
    log = tmp_path / "task.log"
    log.touch()
    task = server.start(str(script), ["wait"], {**os.environ, "TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}})}, str(log))
    deadline = time.monotonic() + 60
    while "waiting" not in log.read_text():
        assert time.monotonic() < deadline and task.poll() is None, log.read_text()
        time.sleep(0.05)
    os.kill(server._process.pid, signal.SIGKILL)
    server._process.wait()
    assert task.wait() == -9    # what the server's death means for its tasks
    while os.path.exists(f"/proc/{task.pid}") and _state(task.pid) not in ("Z", "X"):
        assert time.monotonic() < deadline, f"task {task.pid} outlived the fork server"
        time.sleep(0.05)
    assert shared_server() is not server    # the next cluster gets a new server


def _forked(parent: int) -> bool:
    """Whether ``parent`` is a fork server (the one :func:`run_local_cluster` uses, whichever
    copy of the module started it)."""
    return "forkserver.py" in Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_a_forked_task_ends_as_an_interpreter_would(tmp_path: Path) -> None:
    # its end skips the teardown of torch's modules, not the script's own: a non-daemon thread is
    # joined, a file left open is flushed, SystemExit's code is the exit status
    script = tmp_path / "end.py"
    script.write_text(textwrap.dedent('''
        import sys, threading, time
        left_open = open(sys.argv[1], "w")
        left_open.write("flushed")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        sys.exit(5)
    '''))
    [result] = run_local_cluster(script, 1, args=[str(tmp_path / "out.txt")], timeout=120)
    assert result.returncode == 5 and "thread done" in result.output, result.output
    assert (tmp_path / "out.txt").read_text() == "flushed"


_COMMAND = '''
import os, sys
print("out", sys.argv[1:], os.getcwd(), os.getpgid(0) == os.getpid(), "torch" in sys.modules, flush=True)
print("err", file=sys.stderr, flush=True)
if sys.argv[1:] == ["wait"]:
    print("waiting", flush=True)
    __import__("time").sleep(600)
sys.exit(3)
'''


def test_run_task_forks_a_command_and_returns_what_subprocess_run_would(tmp_path: Path) -> None:
    script = tmp_path / "command.py"
    script.write_text(_COMMAND)
    for command in ([sys.executable, str(script), "a"], [sys.executable, "command.py", "a"],   # (in cwd)
                    [sys.executable, "-c", _COMMAND, "a"]):
        done = run_task(command, timeout=120, cwd=tmp_path)
        assert (done.returncode, done.args) == (3, command)
        assert done.stdout == f"out ['a'] {tmp_path} True True\n" and done.stderr == "err\n", done
    plain = run_task(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=120)   # not python: fresh
    assert (plain.returncode, plain.stdout, plain.stderr) == (3, "out\n", "err\n")
    # a carriage return stays one, forked or fresh (a progress bar's redraw must be visible to a test)
    forked = run_task([sys.executable, "-c", "print('a', end='\\r'); print('b')"], timeout=120)
    fresh = run_task(["sh", "-c", "printf 'a\\rb\\n'"], timeout=120)
    assert forked.stdout == fresh.stdout == "a\rb\n", (forked, fresh)


def test_run_task_past_its_timeout_kills_the_command_and_says_what_it_printed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"open({str(pid_file)!r}, 'w').write(str(__import__('os').getpid()))\n" + _COMMAND
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_task([sys.executable, "-c", code, "wait"], timeout=2)
    # what it had printed by then (all of it, unless the machine was too busy to get that far)
    assert f"out ['wait'] {os.getcwd()} True True\nwaiting\n".startswith(raised.value.output), raised.value
    assert "err\n".startswith(raised.value.stderr), raised.value
    if pid_file.exists() and pid_file.read_text():   # killed and reaped: no process left
        assert not os.path.exists(f"/proc/{pid_file.read_text()}"), pid_file.read_text()


def test_start_task_logs_a_forked_command_and_wait_takes_a_timeout(tmp_path: Path) -> None:
    log = tmp_path / "task.log"
    task = start_task([sys.executable, "-c", _COMMAND, "wait"], env=dict(os.environ), log=str(log))
    assert _forked(int(Path(f"/proc/{task.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]))
    with pytest.raises(subprocess.TimeoutExpired):
        task.wait(0.1)
    deadline = time.monotonic() + 60
    while "waiting" not in log.read_text():
        assert time.monotonic() < deadline and task.poll() is None, log.read_text()
        time.sleep(0.05)
    os.killpg(task.pid, signal.SIGKILL)
    assert task.wait(60) == -signal.SIGKILL
    assert log.read_text().startswith("out ['wait'] ") and "err\n" in log.read_text()


def test_a_server_in_a_network_namespace_forks_its_tasks_there(tmp_path: Path) -> None:
    try:
        with network_hosts(1) as [(namespace, _)]:
            server = shared_server(namespace=namespace)
            log = tmp_path / "task.log"
            log.touch()
            task = server.start_command([sys.executable, "-c", "import os; print(os.readlink('/proc/self/ns/net'))"],
                                        dict(os.environ), str(log))
            assert task.wait(120) == 0, log.read_text()
            there = subprocess.run(["ip", "netns", "exec", namespace, "readlink", "/proc/self/ns/net"],
                                   capture_output=True, text=True, timeout=30).stdout
            ours = os.readlink("/proc/self/ns/net") + "\n"
            assert log.read_text() == there != ours, (log.read_text(), there)
            assert shared_server(namespace=namespace) is server and shared_server() is not server
            close_server(namespace)
            assert server._process.poll() is not None   # (it would keep the namespace alive)
    except HostsUnavailable as reason:
        pytest.skip(str(reason))
