"""Stratagem under a real Slurm: Debian's slurm-wlm and munge, started by the test.

One cluster (munged, slurmctld, slurmd; see slurm_harness.py) serves every test of the module;
it lives in a network namespace with only loopback addresses and is torn down -- every process
in the namespace killed by pid -- whatever happens. The tests:

- Slurm's daemons listen only on the namespace's loopback, nothing of theirs on the machine's;
- ``srun --ntasks=2`` of a script calling ``sg.MultiWorkerMirroredStrategy()`` with no
  arguments trains as plain one-process PyTorch does (float64);
- a task SIGKILLed mid-training makes the other raise UnavailableError naming it, and the step
  fails, in bounded time;
- a step with fewer tasks than the cluster needs stops every task with the counts and the fix
  before anything trains;
- parameter-server training under srun: ``sg.ParameterServerStrategy()`` on rank 0, ``stratagem
  server`` on the others (the wrapper of docs/slurm.md), the result plain PyTorch's and the
  step ending cleanly;
- an ``sbatch`` batch script that runs Python without srun is a lone task, with a warning;
- docs/slurm.md's batch scripts, taken from the page as written and submitted with ``sbatch
  --wait``: the one-node CPU script (both workers train and print the same losses) and the
  parameter-server one (its three files; the coordinator trains, the servers stop, the job ends).

Needs root and the packages (`apt-get install slurm-wlm munge`); skips, saying which, without.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from . import slurm_train_script
from .slurm_harness import SlurmCluster, missing_requirements

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRAIN = HERE / "slurm_train_script.py"
PS_COORDINATOR = HERE / "slurm_ps_script.py"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    why = missing_requirements()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        problem = cluster.make_namespace()
        if problem:
            pytest.skip(problem)
        seconds = cluster.start()
        print(f"Slurm ready in {seconds:.1f} s")
        yield cluster
    finally:
        cluster.stop()


def _output(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _assert_plain(params: dict) -> None:
    expected = slurm_train_script.plain()
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(params[name], dtype=torch.float64),
                                   torch.tensor(value, dtype=torch.float64), msg=name)


def _assert_loopback_only(lines: list[str], ports: list[int]) -> None:
    """Every socket the Python tasks listen on is on a loopback address; ``ports`` among them.

    (Slurm's own processes -- slurmctld, slurmd, srun -- listen on every interface: Slurm has no
    setting to bind one; in this namespace every interface is loopback.)"""
    ours = [line.split()[3] for line in lines if '(("python' in line]
    assert all(a.startswith(("127.", "[::1]", "[::ffff:127.")) for a in ours), lines
    for port in ports:
        assert any(a.endswith(f":{port}") for a in ours), lines


def test_slurm_listens_only_on_loopback(slurm: SlurmCluster) -> None:
    addresses = subprocess.run(["ip", "-n", slurm.namespace, "-o", "addr"], capture_output=True,
                               text=True, timeout=30).stdout.splitlines()
    assert addresses and all(line.split()[1] == "lo" for line in addresses), addresses
    inside = slurm.listening()
    assert '"slurmctld"' in inside and ":6817" in inside, inside
    assert '"slurmd"' in inside and ":6818" in inside, inside
    assert '"munged"' not in inside   # a Unix socket only
    outside = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=30).stdout
    assert not any(f'"{name}"' in outside for name in ("slurmctld", "slurmd", "munged")), outside


def test_srun_two_tasks_train_like_plain_pytorch(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = slurm.srun(["--ntasks=2", "--kill-on-bad-exit=1", sys.executable, str(TRAIN), str(tmp_path)],
                        timeout=240, PYTHONPATH=str(ROOT))
    assert result.returncode == 0, _output(result)
    assert "[task 1] SlurmClusterResolver: worker 1, rank 1 of 2" in result.stdout, _output(result)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["resolver"] for r in ranks] == ["SlurmClusterResolver"] * 2
    assert [r["num_workers"] for r in ranks] == [2, 2]
    assert ranks[0]["params"] == ranks[1]["params"]
    _assert_loopback_only(ranks[0]["listening"], [8888])   # the chief's store, on localhost
    _assert_plain(ranks[0]["params"])


def test_a_killed_task_makes_the_other_raise_in_bounded_time(slurm: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    result = slurm.srun(["--ntasks=2", sys.executable, str(TRAIN), str(tmp_path)], timeout=240,
                        PYTHONPATH=str(ROOT), SLURM_TEST_KILL_RANK="1")
    elapsed = time.monotonic() - started
    assert result.returncode != 0, _output(result)
    assert "task 1: Killed" in result.stderr, _output(result)
    assert "UnavailableError" in result.stderr and "worker 1" in result.stderr, _output(result)
    assert not list(tmp_path.iterdir())   # no task reports a training it did not finish
    assert elapsed < 150, elapsed


def test_fewer_tasks_than_the_jobs_need_fail_before_training(slurm: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    result = slurm.srun(["--ntasks=1", sys.executable, str(TRAIN), str(tmp_path)], timeout=120,
                        PYTHONPATH=str(ROOT), STRATAGEM_SLURM_JOBS="worker=2")
    elapsed = time.monotonic() - started
    assert result.returncode != 0, _output(result)
    assert "ClusterConfigError: the Slurm step has 1 task, but the cluster needs 2 (2 worker, from " \
           "STRATAGEM_SLURM_JOBS): start it with `srun --ntasks=2`" in result.stderr, _output(result)
    assert "SlurmClusterResolver:" not in result.stdout   # it stopped in the strategy's constructor
    assert not list(tmp_path.iterdir())
    assert elapsed < 90, elapsed   # the import of torch, then the refusal


PS_TASK = """#!/bin/bash
# Rank 0 is the chief (the coordinator); the other tasks serve. When the coordinator is done, its
# SIGTERM to the step stops the servers, and the step ends with the coordinator's status.
export STRATAGEM_CLUSTER_TOKEN="$(cat {token})"   # each task reads it: in no argv, no Slurm message
if [ "$SLURM_PROCID" -eq 0 ]; then
    trap 'true' TERM
    {python} {script} {out}; status=$?
    scancel --signal=TERM "$SLURM_JOB_ID.$SLURM_STEP_ID"
    exit $status
fi
exec {python} -m stratagem server
"""


def test_parameter_server_training_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_urlsafe(32) + "\n")
    task = tmp_path / "ps_task.sh"
    task.write_text(PS_TASK.format(python=sys.executable, script=PS_COORDINATOR, out=tmp_path, token=token))
    task.chmod(0o755)
    result = slurm.srun(["--ntasks=3", "--kill-on-bad-exit=1", str(task)], timeout=240,
                        PYTHONPATH=str(ROOT), STRATAGEM_SLURM_JOBS="chief=1,ps=1,worker=1")
    assert result.returncode == 0, _output(result)
    for line in ("[task 0] SlurmClusterResolver: chief 0", "ps 0 listening on localhost:8889",
                 "worker 0 listening on localhost:8890", "coordinator done",
                 "ps 0 stopped (SIGTERM)", "worker 0 stopped (SIGTERM)"):
        assert line in result.stdout, _output(result)
    report = json.loads((tmp_path / "coordinator.json").read_text())
    assert report["resolver"] == "SlurmClusterResolver"
    _assert_loopback_only(report["listening"], [8889, 8890])   # ps 0, worker 0
    _assert_plain(report["params"])


def test_a_batch_script_without_srun_is_one_task(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "batch.out"
    probe = ("import warnings, stratagem.cluster as c; warnings.simplefilter('always'); "
             "r = c.resolve(); print(type(r).__name__, r.num_workers, flush=True)")
    result = subprocess.run(
        slurm.inside("sbatch", "--wait", "--ntasks=2", f"--output={out}",
                     f"--wrap={sys.executable} -c \"{probe}\""),
        capture_output=True, text=True, env=slurm.env(PYTHONPATH=str(ROOT)), timeout=120, cwd=tmp_path)
    text = out.read_text() if out.exists() else ""
    assert result.returncode == 0, _output(result) + text
    assert "SimpleClusterResolver 1" in text, text
    assert "RuntimeWarning: this process runs in Slurm job" in text and "of 2 tasks" in text, text


def _guide_block(language: str, first_line: str) -> str:
    """The ``language`` block of docs/slurm.md whose text begins with ``first_line``."""
    guide = (ROOT / "docs" / "slurm.md").read_text()
    blocks = [b for b in re.findall(rf"^```{language}\n(.*?)^```", guide, re.S | re.M) if b.startswith(first_line)]
    assert len(blocks) == 1, f"docs/slurm.md: {len(blocks)} {language} blocks begin with {first_line!r}"
    return blocks[0]


def _submit_as_written(slurm: SlurmCluster, folder: Path, script: str, **env: str) -> str:
    """``sbatch --wait SCRIPT`` in ``folder`` with this interpreter as ``python``; the job's output."""
    out = folder / "job.out"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"   # `python`, `stratagem`
    started = time.monotonic()
    result = subprocess.run(slurm.inside("sbatch", "--wait", f"--output={out}", script), capture_output=True,
                            text=True, env=slurm.env(PYTHONPATH=str(ROOT), PATH=path, **env), timeout=240,
                            cwd=folder)
    text = out.read_text() if out.exists() else ""
    assert result.returncode == 0, _output(result) + text
    print(f"docs/slurm.md's {script}: {time.monotonic() - started:.1f} s from sbatch to its end")
    return text


def test_the_guides_one_node_cpu_script_runs_as_written(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "train_cpu.sbatch").write_text(_guide_block("bash", "#!/bin/bash\n# train_cpu.sbatch"))
    (tmp_path / "train_cpu.py").write_text(_guide_block("python", "# train_cpu.py"))
    text = _submit_as_written(slurm, tmp_path, "train_cpu.sbatch")
    losses = {worker: re.findall(rf"^worker {worker}: epoch (\d): loss ([0-9.]+)$", text, re.M) for worker in (0, 1)}
    assert [epoch for epoch, _ in losses[0]] == ["1", "2", "3"], text
    assert losses[0] == losses[1], text   # one model: the same reduced loss on both workers


def test_the_guides_parameter_server_scripts_run_as_written(slurm: SlurmCluster, tmp_path: Path) -> None:
    home = tmp_path / "home"   # the guide's token file, made by the guide's command
    token = subprocess.run(["bash", "-c", _guide_block("bash", "mkdir -p ~/.stratagem")], env={**os.environ,
                           "HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
                           capture_output=True, text=True, timeout=60)
    assert token.returncode == 0 and (home / ".stratagem" / "token").stat().st_mode & 0o077 == 0, token
    (tmp_path / "train_ps.sbatch").write_text(_guide_block("bash", "#!/bin/bash\n# train_ps.sbatch"))
    (tmp_path / "ps_task.sh").write_text(_guide_block("bash", "#!/bin/bash\n# ps_task.sh"))
    (tmp_path / "ps_task.sh").chmod(0o755)   # the guide's `chmod +x ps_task.sh`
    (tmp_path / "train_ps.py").write_text(_guide_block("python", "# train_ps.py"))
    text = _submit_as_written(slurm, tmp_path, "train_ps.sbatch", HOME=str(home))
    loss = re.search(r"^coordinator: last loss ([0-9.]+)$", text, re.M)
    assert loss and float(loss.group(1)) < 1.0, text
    for line in ("ps 0 stopped (SIGTERM)", "worker 0 stopped (SIGTERM)", "worker 1 stopped (SIGTERM)"):
        assert line in text, text
