"""``stratagem launch`` with real processes: TF_CONFIG, output, restarts, stopping, errors.

Each test writes small scripts to ``tmp_path`` and launches them, either through the Python
API (:func:`launch_local`, in-process) or as ``python -m stratagem.launch`` (the command a
user types). Scripts that must be stopped write their pid (and their children's) to files,
and the test checks that those processes are gone afterwards.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.cluster import TFConfigClusterResolver
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.launch import add_launch_parser, launch_local
from stratagem.launch.command import main as command_main, run_launch
from stratagem.cluster import ClusterSpec
from stratagem.launch.tasks import Task, plan_cluster, server_command, torchrun_variables

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("forked_launches")]

# Shared by the scripts: record what the task was given; wait for files; write a pid file.
_PRELUDE = '''
import json, os, signal, subprocess, sys, time
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = f"{TASK['type']}-{TASK['index']}"
OUT = sys.argv[1]

def write(name, text):
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)

def wait_for(*names, timeout=20):
    deadline = time.time() + timeout
    while not all(os.path.exists(os.path.join(OUT, n)) for n in names):
        if time.time() > deadline:
            sys.exit(99)
        time.sleep(0.02)
'''


def _script(tmp_path: Path, body: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(_PRELUDE + textwrap.dedent(body))
    return path


def _launch(script: Path, *args: str, **options: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, list(args), stdout=out, stderr=err, **options)
    return status, out.getvalue(), err.getvalue()


def _cli(*args: str, cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stratagem.launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _assert_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:  # never leave a process behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes {alive} outlived the launcher"


def _pids(out: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(out.glob("*.pid"))]


# -- what every task is given ---------------------------------------------------------------

@pytest.mark.multiprocess
def test_every_task_gets_its_tf_config_and_the_job_token(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "7")  # stale torchrun variables must not reach the tasks
    monkeypatch.setenv("MASTER_PORT", "29500")
    script = _script(tmp_path, '''
        write(NAME + ".json", json.dumps({
            "tf_config": os.environ["TF_CONFIG"], "token": os.environ["STRATAGEM_CLUSTER_TOKEN"],
            "argv": sys.argv[2:], "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
            "torchrun": {name: os.environ.get(name) for name in
                         ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}}))
        print("recorded", NAME)
    ''')
    status, out, err = _launch(script, str(tmp_path), "--lr", "0.5", chief=True, num_workers=2)
    assert status == 0, err

    records = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert sorted(records) == ["chief-0", "worker-0", "worker-1"]
    configs = {name: json.loads(r["tf_config"]) for name, r in records.items()}
    cluster = configs["chief-0"]["cluster"]
    assert sorted(cluster) == ["chief", "worker"]
    assert len(cluster["chief"]) == 1 and len(cluster["worker"]) == 2
    addresses = cluster["chief"] + cluster["worker"]
    assert len(set(addresses)) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    for name, config in configs.items():
        assert set(config) == {"cluster", "task"}            # TensorFlow's exact format
        assert config["cluster"] == cluster                   # one cluster, seen alike by all
        task_type, index = name.split("-")
        assert config["task"] == {"type": task_type, "index": int(index)}
        resolver = TFConfigClusterResolver(environment={"TF_CONFIG": records[name]["tf_config"]})
        assert (resolver.task_type, resolver.task_id) == (task_type, int(index))
        assert resolver.is_chief == (task_type == "chief")
    assert all(r["argv"] == ["--lr", "0.5"] for r in records.values())
    assert all(r["unbuffered"] == "1" for r in records.values())
    # torchrun's variables as torchrun would set them, from TF_CONFIG: the chief is rank 0
    for name, rank in {"chief-0": "0", "worker-0": "1", "worker-1": "2"}.items():
        assert records[name]["torchrun"] == {"RANK": rank, "WORLD_SIZE": "3", "LOCAL_RANK": rank,
                                             "LOCAL_WORLD_SIZE": "3", "MASTER_PORT": None}

    tokens = {r["token"] for r in records.values()}
    assert len(tokens) == 1
    token = tokens.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert token not in out and token not in err
    assert sorted(out.splitlines()) == ["[chief]    recorded chief-0",
                                        "[worker 0] recorded worker-0",
                                        "[worker 1] recorded worker-1"]


@pytest.mark.multiprocess
def test_each_job_gets_a_fresh_token(tmp_path: Path) -> None:
    script = _script(tmp_path, 'print(os.environ["STRATAGEM_CLUSTER_TOKEN"])')
    tokens = [_launch(script, str(tmp_path), num_workers=1)[1] for _ in range(2)]
    assert tokens[0] != tokens[1]


@pytest.mark.multiprocess
def test_port_base_gives_consecutive_ports(tmp_path: Path) -> None:
    base = next(port for port in range(20000, 60000, 97) if _block_is_free(port, 3))
    script = _script(tmp_path, 'print(json.loads(os.environ["TF_CONFIG"])["cluster"])')
    status, out, _ = _launch(script, str(tmp_path), chief=True, num_workers=2, port_base=base)
    assert status == 0
    assert f"'chief': ['127.0.0.1:{base}'], 'worker': ['127.0.0.1:{base + 1}', " \
           f"'127.0.0.1:{base + 2}']" in out


def _block_is_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


# -- output ---------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_command_prefixes_every_line_with_its_task(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        print("out", NAME)
        print("err", NAME, file=sys.stderr, flush=True)
        sys.stdout.write("crlf " + NAME + "\\r\\n")
        for i in range(100):
            print(f"{NAME} line {i} " + "x" * 200)
        print(NAME + " long " + "y" * 200_000)
        sys.stdout.write("partial " + NAME)
    ''')
    result = _cli("--chief", "--workers", "2", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    prefixes = {"chief-0": "[chief]    ", "worker-0": "[worker 0] ", "worker-1": "[worker 1] "}
    for name, prefix in prefixes.items():
        mine = [line[len(prefix):] for line in lines if line.startswith(prefix)]
        assert mine[:3] == [f"out {name}", f"err {name}", f"crlf {name}"]
        assert mine[3:103] == [f"{name} line {i} " + "x" * 200 for i in range(100)]  # whole lines
        assert mine[103:] == [f"{name} long " + "y" * 200_000, f"partial {name}"]
    assert len(lines) == 3 * 105                             # nothing unprefixed, nothing torn
    assert "\r" not in result.stdout


@pytest.mark.multiprocess
def test_progress_bars_redraw_without_empty_prefixed_lines(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        for percent in (0, 50, 100):   # as tqdm draws: "\\r" first, then the bar
            sys.stdout.write("\\r" + NAME + f" {percent}%")
            sys.stdout.flush()
        sys.stdout.write("\\n")
    ''')
    result = _cli("--chief", "--workers", "1", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    segments = [seg for seg in re.split(r"[\r\n]", result.stdout) if seg]
    for name, prefix in {"chief-0": "[chief]    ", "worker-0": "[worker 0] "}.items():
        assert [seg for seg in segments if seg.startswith(prefix)] == [
            f"{prefix}{name} {percent}%" for percent in (0, 50, 100)]
    assert all(seg.strip() not in ("[chief]", "[worker 0]") for seg in segments)


# -- failures, restarts, stopping -----------------------------------------------------------

@pytest.mark.multiprocess
def test_a_failed_task_fails_the_job_and_stops_the_others(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        if TASK["index"] == 0:
            wait_for("worker-1.pid", "worker-1-child.pid", "worker-2.pid")
            print("giving up")
            sys.exit(3)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write(NAME + "-child.pid", str(child.pid))
        write(NAME + ".pid", str(os.getpid()))
        time.sleep(60)
    ''')
    start = time.monotonic()
    result = _cli("--workers", "3", str(script), str(tmp_path), cwd=tmp_path)
    elapsed = time.monotonic() - start
    pids = _pids(tmp_path)
    assert len(pids) == 4
    _assert_gone(pids, timeout=2)
    assert result.returncode == 3
    assert "[worker 0] giving up" in result.stdout
    assert "[launch] worker 0 failed with exit code 3; stopping 2 other task(s)" in result.stderr
    assert elapsed < 15


@pytest.mark.multiprocess
def test_tasks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        if TASK["index"] == 0:
            wait_for("worker-1.pid")
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write(NAME + ".pid", str(os.getpid()))
        time.sleep(60)
    ''')
    start = time.monotonic()
    status, _, err = _launch(script, str(tmp_path), num_workers=2, grace_period=0.5)
    assert status == 1
    assert "[launch] worker 0 failed: killed by SIGKILL; stopping 1 other task(s)" in err
    assert time.monotonic() - start < 10
    _assert_gone(_pids(tmp_path), timeout=1)


@pytest.mark.multiprocess
def test_a_failed_task_restarts_the_whole_group_on_fresh_ports(tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        with open(os.path.join(OUT, NAME + ".log"), "a") as f:
            f.write(json.dumps([os.environ["TF_CONFIG"], os.environ["STRATAGEM_RESTART"]]) + "\\n")
        if NAME == "worker-1" and not os.path.exists(os.path.join(OUT, "failed-once")):
            write("failed-once", "")
            sys.exit(1)
        print("done")
    ''')
    status, out, err = _launch(script, str(tmp_path), num_workers=2, max_restarts=2)
    assert status == 0, err
    # (the stand-in tasks never form a cluster, which the launcher warns about at the end)
    lines = [line for line in err.splitlines() if not line.startswith("[launch] warning: the 2 tasks never")]
    assert lines[0] == "[launch] worker 1 exited with code 1; restarting all 2 tasks (restart 1/2)"
    assert lines[1].startswith("[launch] started all 2 tasks again with a new rendezvous "
                               "(STRATAGEM_RESTART=1)") and len(lines) == 2
    runs = {name: [json.loads(line) for line in (tmp_path / f"{name}.log").read_text().splitlines()]
            for name in ("worker-0", "worker-1")}
    for name, attempts in runs.items():   # worker 0 had finished: it runs again with the group
        assert [restart for _, restart in attempts] == ["0", "1"], name
        before, after = (json.loads(config) for config, _ in attempts)
        assert before["task"] == after["task"]
        assert before["cluster"] != after["cluster"]           # a new rendezvous: new ports
        assert len(set(before["cluster"]["worker"] + after["cluster"]["worker"])) == 4
    assert runs["worker-0"][1][0] == runs["worker-1"][1][0].replace('"index": 1', '"index": 0')
    assert out.count("done") == 3


@pytest.mark.multiprocess
def test_with_port_base_a_restarted_group_gets_the_same_ports(tmp_path: Path) -> None:
    base = next(port for port in range(30000, 60000, 89) if _block_is_free(port, 2))
    script = _script(tmp_path, '''
        print(os.environ["STRATAGEM_RESTART"], json.loads(os.environ["TF_CONFIG"])["cluster"])
        sys.exit(1 if NAME == "worker-0" and os.environ["STRATAGEM_RESTART"] == "0" else 0)
    ''')
    status, out, err = _launch(script, str(tmp_path), num_workers=2, max_restarts=1, port_base=base)
    assert status == 0, err
    cluster = f"{{'worker': ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']}}"
    assert f"[worker 0] 0 {cluster}" in out and f"[worker 0] 1 {cluster}" in out


@pytest.mark.multiprocess
def test_restarts_run_out(tmp_path: Path) -> None:
    script = _script(tmp_path, 'sys.exit(5 if NAME == "worker-0" else 0)')
    status, _, err = _launch(script, str(tmp_path), num_workers=2, max_restarts=1)
    assert status == 5
    assert "[launch] worker 0 exited with code 5; restarting all 2 tasks (restart 1/1)" in err
    assert "[launch] worker 0 failed with exit code 5 (after 1 restart(s))" in err


@pytest.mark.multiprocess
def test_a_task_killed_by_a_signal_gives_status_1(tmp_path: Path) -> None:
    script = _script(tmp_path, 'os.kill(os.getpid(), signal.SIGTERM)')
    status, _, err = _launch(script, str(tmp_path), num_workers=1)
    assert status == 1
    assert err == "[launch] worker 0 failed: killed by SIGTERM\n"


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_every_task(tmp_path: Path, signum: int, status: int) -> None:
    script = _script(tmp_path, '''
        write(NAME + ".pid", str(os.getpid()))
        time.sleep(60)
    ''')
    launcher = subprocess.Popen([sys.executable, "-m", "stratagem.launch", "--chief",
                                 "--workers", "2", str(script), str(tmp_path)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = _pids(tmp_path)
        assert len(pids) == 3
        start = time.monotonic()
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=20)
        assert time.monotonic() - start < 10
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == status
    assert f"[launch] received {signal.Signals(signum).name}; stopping 3 task(s)" in err
    _assert_gone(pids, timeout=2)


# -- parameter-server mode --------------------------------------------------------------------

def _fake_server(tmp_path: Path) -> list[str]:
    """A stand-in for ``stratagem server``: records its TF_CONFIG, serves until SIGTERM."""
    server = _script(tmp_path, '''
        def stop(signum, frame):
            write(NAME + ".stopped", "")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        write(NAME + ".json", os.environ["TF_CONFIG"])
        write(NAME + ".pid", str(os.getpid()))
        print("serving")
        while True:
            time.sleep(1)
    ''', name="server.py")
    return [sys.executable, str(server), str(tmp_path)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("chief_status", [0, 4])
def test_ps_mode_runs_the_script_as_chief_and_ends_with_it(tmp_path: Path, chief_status: int) -> None:
    script = _script(tmp_path, f'''
        assert NAME == "chief-0", NAME
        wait_for("worker-0.pid", "worker-1.pid", "ps-0.pid")
        print("coordinating")
        sys.exit({chief_status})
    ''')
    status, out, err = _launch(script, str(tmp_path), num_workers=2, num_ps=1,
                               server_command=_fake_server(tmp_path))
    assert status == chief_status, err
    assert "[chief]    coordinating" in out and "[ps 0]     serving" in out
    servers = ["worker-0", "worker-1", "ps-0"]
    configs = [json.loads((tmp_path / f"{name}.json").read_text()) for name in servers]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0},
                                            {"type": "worker", "index": 1},
                                            {"type": "ps", "index": 0}]
    assert sorted(configs[0]["cluster"]) == ["chief", "ps", "worker"]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    assert all((tmp_path / f"{name}.stopped").exists() for name in servers)  # asked with SIGTERM
    _assert_gone(_pids(tmp_path), timeout=1)


@pytest.mark.multiprocess
def test_ps_mode_a_lost_server_is_reported_and_the_chief_decides(tmp_path: Path) -> None:
    server = _script(tmp_path, '''
        write("server-ran", "")
        sys.exit(1)
    ''', name="server.py")
    script = _script(tmp_path, '''
        wait_for("server-ran")
        time.sleep(1)  # time for the launcher to see the server's exit
        print("still fine")
    ''')
    status, out, err = _launch(script, str(tmp_path), num_workers=1, num_ps=1,
                               server_command=[sys.executable, str(server), str(tmp_path)])
    assert status == 0
    assert "[chief]    still fine" in out
    assert "[launch] ps 0 failed with exit code 1; the job goes on" in err


@pytest.mark.multiprocess
def test_ps_mode_a_failed_server_restarts_alone_with_the_same_tf_config(tmp_path: Path) -> None:
    server = _script(tmp_path, '''
        with open(os.path.join(OUT, NAME + ".log"), "a") as f:
            f.write(json.dumps([os.environ["TF_CONFIG"], os.environ["STRATAGEM_RESTART"]]) + "\\n")
        if NAME == "ps-0" and os.environ["STRATAGEM_RESTART"] == "0":
            sys.exit(1)
        write(NAME + ".up", "")
        time.sleep(60)
    ''', name="server.py")
    script = _script(tmp_path, '''
        wait_for("worker-0.up", "ps-0.up")
        print("coordinated")
    ''')
    status, out, err = _launch(script, str(tmp_path), num_workers=1, num_ps=1, max_restarts=1,
                               server_command=[sys.executable, str(server), str(tmp_path)])
    assert status == 0, err
    assert err == "[launch] ps 0 exited with code 1; restarting (1/1)\n"
    ps = [json.loads(line) for line in (tmp_path / "ps-0.log").read_text().splitlines()]
    assert [restart for _, restart in ps] == ["0", "1"] and ps[0][0] == ps[1][0]
    assert len((tmp_path / "worker-0.log").read_text().splitlines()) == 1
    assert "[chief]    coordinated" in out


def test_servers_run_stratagem_server_by_default() -> None:
    _, tasks = plan_cluster(["train.py"], num_workers=2, num_ps=1, chief=False,
                            ports=[1001, 1002, 1003, 1004])
    assert [(task.name, task.runs_script) for task in tasks] == [
        ("chief", True), ("worker 0", False), ("worker 1", False), ("ps 0", False)]
    assert tasks[0].command == (sys.executable, "train.py")
    assert all(task.command == tuple(server_command()) for task in tasks[1:])
    assert server_command() == [sys.executable, "-m", "stratagem", "server"]


def test_torchrun_variables_follow_tf_config_for_the_collective_only() -> None:
    # several hosts (as `stratagem launch --nnodes` plans them): local ranks count per host
    spec = ClusterSpec({"chief": ["10.0.0.1:1"], "worker": ["10.0.0.1:2", "10.0.0.2:1", "10.0.0.2:2"],
                        "evaluator": ["10.0.0.1:3"]})
    assert [torchrun_variables(spec, Task(*task, (), True)) for task in
            [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]] == [
        {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2"}
        for rank, local in [(0, 0), (1, 1), (2, 0), (3, 1)]]
    assert torchrun_variables(spec, Task("evaluator", 0, (), True)) == {}   # not in the group
    spec, tasks = plan_cluster(["train.py"], num_workers=2, num_ps=1, chief=False, ports=[1, 2, 3, 4])
    assert all(torchrun_variables(spec, task) == {} for task in tasks)   # parameter-server training


# -- bad input --------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_command_reports_a_missing_script(tmp_path: Path) -> None:
    result = _cli("--workers", "2", "missing.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("stratagem launch: error: script 'missing.py' not found")
    assert result.stdout == ""


@pytest.mark.parametrize("argv,message", [
    (["--workers", "0", "{script}"], "nothing to launch: --workers is 0 and there is no chief"),
    (["--workers", "-1", "{script}"], "--workers (num_workers) must be an integer >= 0, got -1"),
    (["--ps", "-1", "{script}"], "--ps (num_ps) must be an integer >= 0, got -1"),
    (["--max-restarts", "-2", "{script}"], "--max-restarts (max_restarts) must be an integer >= 0"),
    (["--max-preemptions", "-1", "{script}"],
     "--max-preemptions (max_preemptions) must be an integer >= 0"),
    (["--ps", "1", "--workers", "0", "{script}"], "needs at least one worker"),
    (["--workers", "3", "--port-base", "65534", "{script}"], "outside 1..65535"),
    (["--port-base", "0", "{script}"], "--port-base (port_base) must be an integer >= 1"),
    (["--host", "not a host", "{script}"], "is not a host name or IP address"),
    (["--host", "10.255.255.1", "{script}"], "cannot listen on host '10.255.255.1'"),
    (["--host", "0.0.0.0", "{script}"], "--host '0.0.0.0' means every interface"),
    (["--ps", "1", "--host", "::", "{script}"], "--host '::' means every interface"),
    (["{tmp}"], "is a directory"),
])
def test_bad_input_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                    argv: list[str], message: str) -> None:
    script = _script(tmp_path, 'raise SystemExit("must not run")')
    argv = [arg.format(script=script, tmp=tmp_path) for arg in argv]
    assert command_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratagem launch: error: ") and message in err, err


def test_a_busy_port_is_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, 'raise SystemExit("must not run")')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ClusterConfigError, match=f"port {port} on '127.0.0.1' is not free"):
            launch_local(script, num_workers=1, port_base=port)


def test_python_api_rejects_bad_arguments(tmp_path: Path) -> None:
    script = _script(tmp_path, 'raise SystemExit("must not run")')
    with pytest.raises(InvalidArgumentError, match="args must be a sequence of strings"):
        launch_local(script, "--lr 0.1")
    with pytest.raises(InvalidArgumentError, match="num_workers"):
        launch_local(script, num_workers=True)
    with pytest.raises(InvalidArgumentError, match="grace_period"):
        launch_local(script, grace_period=-1)


def test_add_launch_parser_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="stratagem")
    add_launch_parser(parser.add_subparsers())
    args = parser.parse_args(["launch", "--workers", "3", "--chief", "--grace-period", "30",
                              "train.py", "--workers", "9"])
    assert args.func is run_launch and args.handler is run_launch
    assert (args.workers, args.chief, args.grace_period, args.script, args.args) == (
        3, True, 30.0, "train.py", ["--workers", "9"])


@pytest.mark.multiprocess
def test_the_command_line_starts_its_tasks_without_importing_torch() -> None:
    # ``stratagem launch`` only starts processes: importing torch first would cost every job
    # about a second before its tasks even start (they import torch themselves).
    code = ("import sys\nfrom stratagem.cli import build_parser\n"
            "args = build_parser('launch').parse_args(['launch', '--workers', '2', 'train.py'])\n"
            "assert args.workers == 2\n"
            "import stratagem as sg\nsg.errors, sg.cluster\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('grpc', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.multiprocess
def test_a_multi_node_launch_reaches_its_rendezvous_without_importing_torch() -> None:
    # its node agent speaks RPC to the rendezvous host; the RPC client's profiler labels must not
    # load torch either (about two seconds of CPU per node, before any task starts)
    code = ("import sys\nfrom stratagem.launch import nodes, node_agent\nfrom stratagem.rpc import client\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
