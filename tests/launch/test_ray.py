"""The launcher on Ray (``launch_ray``, ``stratagem launch --ray``) on a real local Ray cluster.

The module starts one Ray cluster for all its tests (``ray start --head`` on 127.0.0.1, free
ports, its own temporary folder; about 5 s) in a session of its own, and stops exactly that
session's processes at the end (SIGTERM, then SIGKILL), never another Ray on the machine.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray on loopback: without it Ray replaces
127.0.0.1 with the machine's own address and listens there. The test process connects once
(``ray.init``) and the API tests launch on that connection; the command-line tests run
``python -m stratagem.launch --ray ADDRESS`` as a user would.

The training job is ``ray_script.py``: two MultiWorkerMirroredStrategy workers, float64, a
backup every step. Its oracle is plain one-process PyTorch on the same global batches.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .ray_fixtures import (ONE_MACHINE, ROOT, SCRIPT, assert_as_plain_pytorch, assert_gone, listeners, ray_env, session,
                          start_node, stop_session)
from stratagem.errors import ClusterConfigError
from stratagem.launch.ports import free_ports
from stratagem.launch.ray_actor import NodeReport
from stratagem.launch.ray_group import choose_token

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (pip install 'stratagem[ray]')"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

def _assert_loopback_only(pids: list[int]) -> list[str]:
    listening = listeners(pids)
    beyond = [entry for entry in listening if not re.match(r"(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.[\d.]+\]):",
                                                           entry)]
    assert not beyond, f"listening beyond loopback: {beyond}"
    return listening


@dataclass
class RayCluster:
    address: str
    env: dict[str, str]
    sid: int


@pytest.fixture(scope="module")
def ray_cluster():
    previous, real_print = os.environ.get(ONE_MACHINE), builtins.print
    os.environ[ONE_MACHINE] = "0"   # before ray is imported: it reads this once (for this process)
    import ray
    from ray._private import ray_constants
    # a ray imported earlier in cluster mode would swap 127.0.0.1 for the machine's own address
    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before this module set " + ONE_MACHINE
    port, client_port = free_ports(2)
    temp = tempfile.mkdtemp(prefix="sg-ray-", dir="/tmp")   # short: Ray's socket paths must fit
    env = ray_env(**{ONE_MACHINE: "0"})
    sid = None
    try:
        started = time.monotonic()
        sid = start_node(["--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                          f"--ray-client-server-port={client_port}", "--num-cpus=4", "--include-dashboard=false",
                          f"--temp-dir={temp}"], env)
        daemons = session(sid)
        listening = _assert_loopback_only(daemons)
        print(f"\nRay head up in {time.monotonic() - started:.1f} s; {len(daemons)} processes listen on "
              f"{', '.join(listening)}")
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False, logging_level="WARNING")
        yield RayCluster(f"127.0.0.1:{port}", env, sid)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if sid is not None:
            stop_session(sid)
        shutil.rmtree(temp, ignore_errors=True)
        builtins.print = real_print   # (Ray's driver puts its own there: tqdm_ray.instance())
        if previous is None:
            del os.environ[ONE_MACHINE]
        else:
            os.environ[ONE_MACHINE] = previous


def _launch(script: Path, *args: str, **options: object) -> tuple[int, str, str]:
    from stratagem.launch.ray_launch import launch_ray
    out, err = io.StringIO(), io.StringIO()
    status = launch_ray(script, list(args), stdout=out, stderr=err, **options)
    return status, out.getvalue(), err.getvalue()


def _cli(cluster: RayCluster, *args: str, env: dict[str, str] | None = None,
         **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "stratagem.launch", "--ray", *args],
                            env=cluster.env if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


# -- training: equal to plain PyTorch, and after a lost actor too ------------------------------------

@pytest.mark.multiprocess
def test_two_workers_as_ray_actors_train_as_plain_pytorch(ray_cluster: RayCluster, tmp_path: Path) -> None:
    status, out, err = _launch(SCRIPT, str(tmp_path), num_workers=2)
    assert status == 0, out + err
    assert err == ""
    for rank in (0, 1):
        assert f"[worker {rank}] restart 0 rank {rank} finished" in out
    assert_as_plain_pytorch(tmp_path)


class _Watched(io.TextIOBase):
    """A stream that lets a test wait for a line written to it."""

    def __init__(self) -> None:
        self._text = ""
        self._changed = threading.Condition()

    def write(self, text: str) -> int:
        with self._changed:
            self._text += text
            self._changed.notify_all()
        return len(text)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        with self._changed:
            self._changed.wait_for(lambda: re.search(pattern, self._text), timeout)
            match = re.search(pattern, self._text)
        assert match, f"no {pattern!r} within {timeout} s:\n{self._text}"
        return match

    def getvalue(self) -> str:
        with self._changed:
            return self._text


@pytest.mark.multiprocess
def test_an_actor_killed_mid_training_restarts_the_group_which_resumes_from_its_backup(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    from stratagem.launch.ray_launch import launch_ray
    out, err, result = _Watched(), _Watched(), {}
    job = threading.Thread(target=lambda: result.update(status=launch_ray(
        SCRIPT, [str(tmp_path), "--hold", "0:1:3"], num_workers=2, max_restarts=1, stdout=out, stderr=err)))
    job.start()
    try:
        out.wait_for(r"rank 1 holds after step 3", timeout=120)
        starts = {int(rank): (int(pid), int(actor)) for rank, pid, actor in
                  re.findall(r"restart 0 rank (\d) pid (\d+) actor (\d+)", out.getvalue())}
        # Ray's processes, the actors and the tasks (gloo, the rendezvous store) stay on loopback
        tasks = [pid for pid, _ in starts.values()]
        listening = _assert_loopback_only(session(ray_cluster.sid) + tasks + [os.getpid()])   # + this driver
        assert any(str(tasks[0]) in entry for entry in listening), listening   # the chief's store
        killed_at = time.monotonic()
        os.kill(starts[1][1], signal.SIGKILL)   # rank 1's actor: its Ray worker process
        job.join(200)
    finally:
        if job.is_alive():   # stop the job rather than leave it running
            stop_session(ray_cluster.sid)
    assert result.get("status") == 0, out.getvalue() + err.getvalue()
    messages = err.getvalue()
    assert re.search(r"\[launch\] (worker 1's Ray actor died \(.*\)|worker 0 exited with code 1); restarting "
                     r"all 2 tasks \(restart 1/1\)", messages), messages
    restarted = re.search(r"started all 2 tasks again with a new rendezvous \(STRATAGEM_RESTART=1\) "
                          r"([\d.]+) s after", messages)
    assert restarted, messages
    for rank in (0, 1):
        assert f"restart 1 rank {rank} resumes at step 4" in out.getvalue()
        assert f"restart 1 rank {rank} finished" in out.getvalue()
    assert_as_plain_pytorch(tmp_path)
    assert_gone([pid for start in starts.values() for pid in start], timeout=10)
    print(f"\nactor killed -> job done in {time.monotonic() - killed_at:.1f} s "
          f"(group restarted {restarted[1]} s after the exit was seen)")


# -- placement, failures, the token ------------------------------------------------------------------

_RECORD = '''
import hashlib, json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}-{task['index']}"
'''


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(_RECORD + textwrap.dedent(body))
    return path


@pytest.mark.multiprocess
def test_spread_on_a_one_node_cluster_is_refused_at_once(ray_cluster: RayCluster, tmp_path: Path) -> None:
    script = _script(tmp_path, "print('ran')\n")
    started = time.monotonic()
    with pytest.raises(ClusterConfigError, match=r"spread=True .* each of the 2 tasks on a node of its own, "
                                                 r"but the Ray cluster has 1 node\(s\) alive"):
        _launch(script, num_workers=2, spread=True)
    assert time.monotonic() - started < 30


@pytest.mark.multiprocess
def test_a_placement_ray_cannot_satisfy_is_refused_within_the_placement_timeout(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    import ray
    script = _script(tmp_path, "print('ran')\n")
    started = time.monotonic()
    with pytest.raises(ClusterConfigError, match=r"Ray could not place 2 tasks with \{'CPU': 3.0\} each, on the "
                                                 r"cluster's nodes, within 2 s \(placement_timeout\): the cluster "
                                                 r"has 1 node\(s\) alive with \{'CPU': 4.0\}"):
        _launch(script, num_workers=2, cpus_per_task=3.0, placement_timeout=2)
    assert time.monotonic() - started < 30
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups), groups   # nothing left holding CPUs


@pytest.mark.multiprocess
def test_a_task_failing_beyond_max_restarts_fails_the_job_naming_it(ray_cluster: RayCluster, tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        print("start", os.environ["STRATAGEM_RESTART"], flush=True)
        if task["index"] == 1:
            sys.exit(3)
        time.sleep(120)   # worker 0 waits to be stopped
    ''')
    started = time.monotonic()
    status, out, err = _launch(script, num_workers=2, max_restarts=1, grace_period=2)
    assert status == 3, out + err
    assert time.monotonic() - started < 90
    assert "[launch] worker 1 exited with code 3; restarting all 2 tasks (restart 1/1)" in err
    assert "[launch] worker 1 failed with exit code 3 (after 1 restart(s)); stopping 1 other task(s)" in err
    assert out.count("[worker 1] start") == 2 and "[worker 1] start 1" in out


@pytest.mark.multiprocess
def test_each_task_gets_its_tf_config_and_a_token_that_never_shows(ray_cluster: RayCluster, tmp_path: Path) -> None:
    script = _script(tmp_path, '''
        with open(os.path.join(sys.argv[1], name + ".json"), "w") as f:
            json.dump({"tf_config": os.environ["TF_CONFIG"], "token": os.environ["STRATAGEM_CLUSTER_TOKEN"],
                       "argv": sys.argv[1:], "restart": os.environ["STRATAGEM_RESTART"],
                       "rank": [os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")],
                       "cmdline": open("/proc/self/cmdline").read(),
                       "actor_cmdline": open(f"/proc/{os.getppid()}/cmdline").read()}, f)
        print("recorded", name)
    ''')
    status, out, err = _launch(script, str(tmp_path), "--lr", "0.5", num_workers=2, chief=True)
    assert status == 0, out + err
    records = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert sorted(records) == ["chief-0", "worker-0", "worker-1"]
    cluster = json.loads(records["chief-0"]["tf_config"])["cluster"]
    addresses = cluster["chief"] + cluster["worker"]
    assert len(set(addresses)) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    for name, record in records.items():
        config = json.loads(record["tf_config"])
        assert config["cluster"] == cluster
        assert config["task"] == {"type": name.split("-")[0], "index": int(name.split("-")[1])}
        assert record["argv"] == [str(tmp_path), "--lr", "0.5"] and record["restart"] == "0"
        rank = str({"chief-0": 0, "worker-0": 1, "worker-1": 2}[name])   # torchrun's, from TF_CONFIG
        assert record["rank"] == [rank, "3", rank]
    tokens = {record["token"] for record in records.values()}
    assert len(tokens) == 1
    token = tokens.pop()
    assert len(token) >= 43   # secrets.token_urlsafe(32)
    assert all(token not in record["cmdline"] + record["actor_cmdline"] for record in records.values())
    assert token not in out and token not in err
    assert sorted(out.splitlines()) == ["[chief]    recorded chief-0", "[worker 0] recorded worker-0",
                                        "[worker 1] recorded worker-1"]


@pytest.mark.multiprocess
def test_a_token_in_the_nodes_environment_is_used_and_a_weak_one_refused(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    # runtime_env's variables stand for the environment of `ray start` on every node
    script = _script(tmp_path, '''
        print("digest", hashlib.sha256(os.environ["STRATAGEM_CLUSTER_TOKEN"].encode()).hexdigest())
    ''')
    token = "Qm3xV9-pL2sK8dR4tY7wZ1nB6cF0hJ5gA_eU3iO9kM2"
    status, out, err = _launch(script, num_workers=2, runtime_env={"env_vars": {"STRATAGEM_CLUSTER_TOKEN": token}})
    assert status == 0, out + err
    digest = __import__("hashlib").sha256(token.encode()).hexdigest()
    assert out.count(f"digest {digest}") == 2, out
    with pytest.raises(ClusterConfigError, match=r"worker 0, worker 1: STRATAGEM_CLUSTER_TOKEN in this node's "
                                                 r"environment is too weak"):
        _launch(script, num_workers=2, runtime_env={"env_vars": {"STRATAGEM_CLUSTER_TOKEN": "hunter2hunter2"}})


@pytest.mark.multiprocess
def test_parameter_server_training_runs_with_its_servers_as_actors(ray_cluster: RayCluster) -> None:
    # the chief (coordinator) runs the script; the worker and the ps run `stratagem server`, which
    # refuses to start without the job's token: the run shows that it reached them
    status, out, err = _launch(ROOT / "examples" / "train_ps.py", "--steps", "100", num_workers=1, num_ps=1)
    assert status == 0, out + err
    assert re.search(r"\[ps 0\]\s+\[stratagem server\] ps 0 listening on 127\.0\.0\.1:\d+", out), out
    assert "[chief]    training accuracy" in out
    assert "exited with code 0 before the job ended" not in err   # the servers were stopped after the chief


def _report(host: str, digest: str | None = None, problem: str | None = None) -> NodeReport:
    return NodeReport(host, 2222, "node", digest, problem, "/")


def test_the_token_is_sent_only_where_it_stays_on_the_machine_and_nodes_must_agree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["worker 0", "worker 1"]
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    assert choose_token(names, [_report("127.0.0.1"), _report("127.0.0.1")], "fresh") == "fresh"
    assert choose_token(names, [_report("10.0.0.1", "a"), _report("10.0.0.2", "a")], "fresh") is None
    with pytest.raises(ClusterConfigError, match=r"would travel through Ray unencrypted to the nodes at 10.0.0.2"):
        choose_token(names, [_report("127.0.0.1"), _report("10.0.0.2")], "fresh")
    monkeypatch.setenv("RAY_USE_TLS", "1")
    assert choose_token(names, [_report("10.0.0.1"), _report("10.0.0.2")], "fresh") == "fresh"
    with pytest.raises(ClusterConfigError, match=r"different STRATAGEM_CLUSTER_TOKENs: one token on worker 0 "
                                                 r"\(10.0.0.1\); one token on worker 1 \(10.0.0.2\)"):
        choose_token(names, [_report("10.0.0.1", "a"), _report("10.0.0.2", "b")], "fresh")
    with pytest.raises(ClusterConfigError, match=r"set on the nodes of worker 0 but not on the nodes of worker 1 "
                                                 r"\(10.0.0.2\)"):
        choose_token(names, [_report("10.0.0.1", "a"), _report("10.0.0.2")], "fresh")


# -- the command line: signals, a driver killed, addresses that cannot work ------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_launcher_leaves_no_task_or_actor_behind(ray_cluster: RayCluster, tmp_path: Path,
                                                           signum: int) -> None:
    # the tasks ignore SIGTERM: only the grace period's SIGKILL ends them
    script = _script(tmp_path, '''
        import signal
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("running", os.getpid(), os.getppid(), flush=True)
        time.sleep(120)
    ''')
    launcher = _cli(ray_cluster, ray_cluster.address, "--workers", "2", "--grace-period", "1", str(script))
    lines, pids = [], []
    try:
        for line in launcher.stdout:
            lines.append(line)
            pids += [int(pid) for pid in re.findall(r"running (\d+) (\d+)", line)[0]] if "running" in line else []
            if len(pids) == 4:
                break
        assert len(pids) == 4, "".join(lines)
        stopped_at = time.monotonic()
        launcher.send_signal(signum)
        rest, _ = launcher.communicate(timeout=60)
        expected = 143 if signum == signal.SIGTERM else -signal.SIGKILL
        assert launcher.returncode == expected, "".join(lines) + rest
        if signum == signal.SIGTERM:
            assert "[launch] received SIGTERM; stopping 2 task(s)" in rest
        assert_gone(pids, timeout=60)   # the tasks and their actors
        print(f"\n{signal.Signals(signum).name}: every task and actor gone "
              f"{time.monotonic() - stopped_at:.1f} s after the signal")
    finally:
        launcher.kill()
        launcher.communicate()


@pytest.mark.multiprocess
def test_a_signal_while_ray_places_the_tasks_stops_the_launch_at_once(ray_cluster: RayCluster,
                                                                        tmp_path: Path) -> None:
    import ray
    script = _script(tmp_path, "print('ran')\n")
    before = set(ray.util.placement_group_table())
    launcher = _cli(ray_cluster, ray_cluster.address, "--ray-cpus-per-task", "3", "--ray-placement-timeout", "120",
                    str(script))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # its placement group waits for CPUs that never come
            pending = [key for key, group in ray.util.placement_group_table().items()
                       if key not in before and group["state"] == "PENDING"]
            if pending:
                break
            time.sleep(0.05)
        assert pending, "the launcher's placement group never appeared"
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 130, output
        assert time.monotonic() - signalled < 15
        assert "[launch] received SIGINT; stopping 0 task(s)" in output
        assert ray.util.placement_group_table()[pending[0]]["state"] == "REMOVED"
    finally:
        launcher.kill()
        launcher.communicate()


@pytest.mark.multiprocess
def test_an_address_where_no_cluster_answers_fails_at_once(ray_cluster: RayCluster, tmp_path: Path) -> None:
    script = _script(tmp_path, "print('ran')\n")
    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    launcher = _cli(ray_cluster, nobody, str(script))
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 2, output
    assert f"stratagem launch: error: no Ray cluster answers at {nobody}" in output
    assert time.monotonic() - started < 30
    # without Ray's one-machine mode, a loopback address would become the machine's own
    env = {key: value for key, value in ray_cluster.env.items() if key != ONE_MACHINE}
    launcher = _cli(ray_cluster, ray_cluster.address, str(script), env=env)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 2, output
    assert "a loopback address, but Ray on Linux replaces it with this machine's own address" in output


@pytest.mark.multiprocess
def test_without_ray_the_launcher_says_how_to_install_it(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['ray'] = None\n"
            "import stratagem.launch\n"
            "from stratagem.launch.ray_launch import launch_ray\n"
            "try:\n    launch_ray('x.py', address='127.0.0.1:6379')\n"
            "except ImportError as error:\n    print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "MissingDependencyError launch_ray (stratagem launch --ray) needs Ray: pip install " \
           "'stratagem[ray]'" in result.stdout, result.stdout + result.stderr
