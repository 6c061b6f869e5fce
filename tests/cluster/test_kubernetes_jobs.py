"""Real processes given exactly the environment of a Kubernetes pod train as plain PyTorch does.

- PyTorchJob: two processes with the operator's variables (MASTER_ADDR=127.0.0.1, no TF_CONFIG),
  and one pod of two processes started by torchrun from the operator's PET_* variables;
- an Indexed Job and a JobSet: each process runs in a network namespace of the test's own, as
  its pod's host name, with the env of examples/kubernetes/'s manifests; the pods' DNS names
  resolve through that namespace's hosts file (``ip netns exec`` mounts /etc/netns/NAME/hosts
  over /etc/hosts for its command only; the machine's /etc/hosts is not touched).

Every process runs in its own process group, dies with the test (SIGKILL from the kernel and a
reaper), and is killed when a test fails or times out.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from stratagem.launch.lifeline import Reaper, die_with_parent
from stratagem.testing import free_ports

from ..strategies import train_script
from ..strategies.test_multi_worker_equivalence import reference_history
from .kube_pods import ROOT, container_env, containers, indexed_job_pods, jobset_pods, load, one, pytorchjob_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TRAIN = Path(train_script.__file__)
BATCHES = "12,12,7,12"
# Run the rest of the command line with argv[1] as the host name (in a UTS namespace of its own).
AS_HOST = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execv(sys.argv[2], sys.argv[2:])"
# The names the pods of indexed-job.yaml and of the JobSet of jobset-ps.yaml (one task of each
# kind) reach each other by, each on a loopback address of its own.
HOSTS = {"digits-0.digits-workers": "127.0.0.1", "digits-1.digits-workers": "127.0.0.2",
         "digits-ps-chief-0-0.digits-ps": "127.0.0.3", "digits-ps-worker-0-0.digits-ps": "127.0.0.4",
         "digits-ps-ps-0-0.digits-ps": "127.0.0.5"}


def _environment(pod: dict[str, str]) -> dict[str, str]:
    """This machine's environment without any cluster description, and the pod's."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("PET_", "TORCHELASTIC_", "STRATAGEM_", "JOB", "GLOO_"))
            and k not in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "HOSTNAME", "REPLICATED_JOB_NAME", "REPLICATED_JOB_REPLICAS")}
    return {**keep, "PYTHONPATH": str(ROOT), **pod}


class Pods:
    """Processes started like containers, each in a process group of its own; all killed on exit."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.reaper = Reaper(grace_period=0.0)

    def start(self, name: str, argv: list[str], pod: dict[str, str], *, netns: str | None = None,
              host: str | None = None) -> None:
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, "unshare", "--uts", sys.executable, "-c", AS_HOST, host, *argv]
        log = tempfile.TemporaryFile(mode="w+")   # a file, never a pipe that could fill up
        self.logs[name] = log
        proc = subprocess.Popen(argv, env=_environment(pod), stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
        self.reaper.watch(proc.pid)
        self.procs[name] = proc

    def output(self, name: str) -> str:
        log = self.logs[name]
        return os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.output(name)}" for name in self.procs)

    def wait(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while any(self.procs[n].poll() is None for n in names):
            assert time.monotonic() < deadline, f"{names} did not end within {timeout} s:\n{self.outputs()}"
            time.sleep(0.05)
        return {n: self.procs[n].returncode for n in names}

    def wait_for(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output(name):
            assert self.procs[name].poll() is None, f"{name} ended before printing {text!r}:\n{self.outputs()}"
            assert time.monotonic() < deadline, f"{name} did not print {text!r} in {timeout} s:\n{self.outputs()}"
            time.sleep(0.05)

    def __enter__(self) -> Pods:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            self.reaper.forget(proc.pid)
        self.reaper.close()
        for log in self.logs.values():
            log.close()


def _train(out: Path, *extra: str) -> list[str]:
    return [str(TRAIN), str(out), "--optimizer", "adam", "--batches", BATCHES, "--timeout", "60", *extra]


def _check_equals_plain_pytorch(out: Path, num_workers: int) -> None:
    """What tests/strategies/test_multi_worker_equivalence.py checks: every worker's every step is plain PyTorch's
    on the whole batch, from the chief's initial values."""
    outputs = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(num_workers)]
    expected = reference_history("adam", [int(b) for b in BATCHES.split(",")], outputs[0]["initial"])
    for rank, result in enumerate(outputs):
        assert result["num_replicas"] == num_workers and result["initial"] == outputs[0]["initial"]
        assert len(result["history"]) == len(expected)
        for step, (got, want) in enumerate(zip(result["history"], expected)):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5, abs=2e-6), f"worker {rank}, step {step}"
            for name, value in want["params"].items():
                torch.testing.assert_close(torch.tensor(got["params"][name]), value, rtol=2e-5, atol=2e-6,
                                           msg=lambda m: f"worker {rank}, step {step}, {name}: {m}")


# ------------------------------------------------------------------ PyTorchJob


def test_a_pytorchjob_of_two_pods_trains_as_plain_pytorch(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    with Pods() as pods:
        for rank, role in enumerate(["master 0", "worker 0"]):   # nprocPerNode "1", as pytorchjob.yaml
            env = pytorchjob_env(rank, world_size=2, nnodes=2, nproc="1", master="127.0.0.1", port=port)
            pods.start(role, [sys.executable, *_train(tmp_path)], env)
        codes = pods.wait(["master 0", "worker 0"], timeout=240)
        assert codes == {"master 0": 0, "worker 0": 0}, pods.outputs()
    _check_equals_plain_pytorch(tmp_path, 2)


def test_a_pytorchjob_pod_of_two_processes_trains_through_torchrun(tmp_path: Path) -> None:
    # nprocPerNode "2", one Master pod: the operator's WORLD_SIZE=2 counts processes, RANK=0 the
    # pod; torchrun (the container's command in pytorchjob-torchrun.yaml) reads the PET_* ones
    env = pytorchjob_env(0, world_size=2, nnodes=1, nproc="2", master="127.0.0.1", port=free_ports(1)[0])
    with Pods() as pods:
        pods.start("master 0", [sys.executable, "-m", "torch.distributed.run", *_train(tmp_path)], env)
        assert pods.wait(["master 0"], timeout=240) == {"master 0": 0}, pods.outputs()
    _check_equals_plain_pytorch(tmp_path, 2)


def test_processes_per_pod_without_torchrun_are_refused_before_any_rendezvous(tmp_path: Path) -> None:
    env = pytorchjob_env(0, world_size=4, nnodes=2, nproc="2", master="127.0.0.1", port=free_ports(1)[0])
    started = time.monotonic()
    with Pods() as pods:   # the master pod alone: with these ranks it would wait for 3 peers
        pods.start("master 0", [sys.executable, *_train(tmp_path)], env)
        assert pods.wait(["master 0"], timeout=120) == {"master 0": 1}
        output = pods.output("master 0")
    assert time.monotonic() - started < 120
    assert "ClusterConfigError: PyTorchJob variables: PET_NPROC_PER_NODE=2 asks for 2 processes" in output, output
    assert 'command: ["torchrun", "train.py"]' in output and not list(tmp_path.iterdir())


# ------------------------------------------------------------------ Indexed Job and JobSet, in a namespace


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    """A network namespace with loopback only, whose hosts file names the pods."""
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            pytest.skip(f"no `{tool}` command (Debian package {package}) to make a pod's network and host name")
    name = f"stratagem-kube-{os.getpid()}"
    config = Path("/etc/netns") / name
    step = _ip("netns", "add", name)
    if step.returncode != 0:
        pytest.skip(f"cannot create a network namespace (ip netns add): {step.stderr.strip()}")
    try:
        step = _ip("-n", name, "link", "set", "lo", "up")
        if step.returncode != 0:
            pytest.skip(f"cannot bring up the namespace's loopback: {step.stderr.strip()}")
        try:
            config.mkdir(parents=True)
            (config / "hosts").write_text("127.0.0.1 localhost\n" +
                                          "".join(f"{address} {host}\n" for host, address in HOSTS.items()))
            (config / "resolv.conf").write_text("nameserver 127.0.0.1\noptions attempts:1 timeout:1\n")
        except OSError as error:
            pytest.skip(f"cannot give the namespace its own hosts file ({config}): {error}")
        probe = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c",
                                "import socket; print(socket.gethostbyname('digits-1.digits-workers'))"],
                               capture_output=True, text=True, timeout=60)
        if probe.stdout.strip() != "127.0.0.2":
            pytest.skip(f"the namespace's hosts file is not read: {(probe.stdout + probe.stderr).strip()}")
        yield name
    finally:
        _ip("netns", "del", name)
        shutil.rmtree(config, ignore_errors=True)


def _indexed_job_pods() -> list[tuple[str, dict[str, str]]]:
    """(host name, env) of every pod of indexed-job.yaml: Kubernetes's variables and the manifest's."""
    job = one(load("indexed-job.yaml"), "Job")
    (_, _, container), = containers(job)
    return [(host, {**env, **container_env(container, meta)}) for host, meta, env in indexed_job_pods(job)]


def test_an_indexed_job_of_two_pods_trains_as_plain_pytorch(netns: str, tmp_path: Path) -> None:
    with Pods() as pods:
        for host, env in _indexed_job_pods():
            pods.start(host, [sys.executable, *_train(tmp_path)], env, netns=netns, host=host)
        codes = pods.wait(["digits-0", "digits-1"], timeout=240)
        assert codes == {"digits-0": 0, "digits-1": 0}, pods.outputs()
    _check_equals_plain_pytorch(tmp_path, 2)


def test_an_indexed_job_that_loses_a_pod_fails_the_other_naming_it(netns: str, tmp_path: Path) -> None:
    started = time.monotonic()
    with Pods() as pods:
        for host, env in _indexed_job_pods():
            pods.start(host, [sys.executable, *_train(tmp_path, "--die-on-rank", "1", "--timeout", "30")], env,
                       netns=netns, host=host)
        codes = pods.wait(["digits-0", "digits-1"], timeout=150)
        survivor = pods.output("digits-0")
    assert codes["digits-1"] == 17 and codes["digits-0"] != 0, survivor
    assert "UnavailableError" in survivor and "worker 1" in survivor, survivor
    assert time.monotonic() - started < 150


def test_a_jobset_parameter_server_cluster_trains_with_no_arguments(netns: str, tmp_path: Path) -> None:
    # jobset-ps.yaml with one pod of each replicated job (this machine has 2 cores): the chief runs
    # examples/train_ps.py, whose sg.ParameterServerStrategy() reads the JobSet's variables, and the
    # worker and the ps run `stratagem server`, which find their task the same way
    jobset = copy.deepcopy(one(load("jobset-ps.yaml"), "JobSet"))
    for rjob in jobset["spec"]["replicatedJobs"]:
        rjob["template"]["spec"]["completions"] = rjob["template"]["spec"]["parallelism"] = 1
    templates = {role: container for role, _, container in containers(jobset)}
    names = {"chief": "digits-ps-chief-0-0", "worker": "digits-ps-worker-0-0", "ps": "digits-ps-ps-0-0"}
    with Pods() as pods:
        for role, host, meta, env in jobset_pods(jobset):
            pod = {**env, **container_env(templates[role], meta), "STRATAGEM_JOBS": "chief=1,worker=1,ps=1"}
            command = templates[role]["command"]
            if command == ["stratagem", "server"]:
                argv = [sys.executable, "-m", "stratagem", "server"]
            else:   # python /workspace/examples/train_ps.py --dir /ckpt/digits-ps
                argv = [sys.executable, str(ROOT / command[1][len("/workspace/"):]), "--dir", str(tmp_path / "ckpt"),
                        "--steps", "40", "--save-every", "20"]
            assert host == names[role]
            pods.start(role, argv, pod, netns=netns, host=host)
        for role in ("worker", "ps"):   # each serves on its JobSet name, bound to its own address
            pods.wait_for(role, f"[stratagem server] {role} 0 listening on {names[role]}.digits-ps:2222", 120)
        assert pods.wait(["chief"], timeout=240) == {"chief": 0}, pods.outputs()
        assert "training accuracy" in pods.output("chief"), pods.outputs()
        for role in ("worker", "ps"):
            pods.procs[role].send_signal(signal.SIGTERM)
        assert pods.wait(["worker", "ps"], timeout=60) == {"worker": 0, "ps": 0}, pods.outputs()
