"""Coordinated restarts and preemption under ``stratagem launch``, with real training processes.

Every job runs ``restart_script.py``: two MultiWorkerMirroredStrategy workers train a tiny
model for :data:`STEPS` steps; the chief saves a plain ``torch.save`` checkpoint and every
worker resumes from it. The scripts kill, stop or signal themselves at a given step of a
given run (``--event``), so each failure comes at a known point without sleeps in the
test. The oracle is an uninterrupted run of the same job: a job that recovers must end
with the same parameters.
"""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stratagem.launch import launch_local

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("restart_script.py")
STEPS = 12


def _launch(out: Path, *script_args: str, **options: object) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, [str(out), "--steps", str(STEPS), *script_args],
                          stdout=stdout, stderr=stderr, num_workers=2, **options)
    return status, stdout.getvalue(), stderr.getvalue()


def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def _assert_same_parameters(out: Path, reference: dict[str, torch.Tensor]) -> None:
    final = _final(out)
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("uninterrupted")
    status, stdout, stderr = _launch(out)
    assert status == 0, stdout + stderr
    assert stderr == ""
    return _final(out)


def test_killed_workers_restart_the_group_and_training_ends_as_if_uninterrupted(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    # worker 1 dies before its 4th step; in the next run the chief dies before its 3rd
    status, out, err = _launch(tmp_path, "--event", "0:1:3:kill", "--event", "1:0:2:kill",
                               max_restarts=2)
    assert status == 0, out + err
    assert "[launch] worker 1 was killed by SIGKILL; restarting all 2 tasks (restart 1/2)" in err
    assert "[launch] worker 0 was killed by SIGKILL; restarting all 2 tasks (restart 2/2)" in err
    assert err.count("started all 2 tasks again with a new rendezvous") == 2
    for rank in (0, 1):
        assert f"restart 1 rank {rank} resumes at step 3" in out   # the chief saved step 2
        assert f"restart 2 rank {rank} resumes at step 5" in out
        assert f"restart 2 rank {rank} done" in out
    _assert_same_parameters(tmp_path, reference)


def test_ten_kills_in_a_row_all_recover(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    # run r: worker r % 2 dies before its 2nd step, after one step of progress
    kills = [f"{run}:{run % 2}:1:kill" for run in range(10)]
    started = time.monotonic()
    status, out, err = _launch(tmp_path, *[arg for kill in kills for arg in ("--event", kill)],
                               max_restarts=10)
    elapsed = time.monotonic() - started
    assert status == 0, out + err
    for run in range(1, 11):
        assert (f"[launch] worker {(run - 1) % 2} was killed by SIGKILL; restarting all 2 tasks "
                f"(restart {run}/10)") in err
        assert f"restart {run} rank 0 resumes at step {run}" in out
    assert "restart 10 rank 1 done" in out
    _assert_same_parameters(tmp_path, reference)
    print(f"10 kill-and-restart cycles: {elapsed:.1f} s in all")


def test_a_survivor_that_fails_after_its_peer_does_not_spend_a_second_restart(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text('''if True:
        import json, os, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        marker = os.path.join(sys.argv[1], "peer-died")
        if os.environ["STRATAGEM_RESTART"] == "0":
            if index == 1:
                open(marker, "w").close()
                sys.exit(3)
            while not os.path.exists(marker):
                time.sleep(0.001)
            print("lost my peer")
            sys.exit(1)
        print("done")
    ''')
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(script, [str(tmp_path)], num_workers=2, max_restarts=1,
                          stdout=stdout, stderr=stderr)
    err = stderr.getvalue()
    assert status == 0, err
    assert err.count("restarting all 2 tasks") == 1 and "(restart 1/1)" in err
    assert stdout.getvalue().count("done") == 2


@pytest.mark.parametrize("hung", [1, 0], ids=["worker", "chief"])
def test_a_hung_worker_is_noticed_within_the_timeout_and_the_group_restarts(
        tmp_path: Path, reference: dict[str, torch.Tensor], hung: int) -> None:
    # a hung chief also hangs the rendezvous store that the survivor's diagnosis reads
    timeout, survivor = 6.0, 1 - hung
    status, out, err = _launch(tmp_path, "--timeout", str(timeout), "--event", f"0:{hung}:3:stop",
                               max_restarts=1)
    assert status == 0, out + err
    stopped_at = float(re.search(rf"rank {hung} sends itself SIGSTOP at ([\d.]+)", out)[1])
    failed_at = float(re.search(rf"rank {survivor} raised UnavailableError at ([\d.]+)", out)[1])
    # gloo's timeout, then up to 3.5 heartbeats to name the lost worker, then slack for load
    assert timeout - 0.5 < failed_at - stopped_at < timeout + 3.5 + 4, failed_at - stopped_at
    assert (f"UnavailableError: gradient all_reduce failed on worker {survivor}: worker {hung} "
            "stopped answering") in out
    assert (f"[launch] worker {survivor} exited with code 1; restarting all 2 tasks "
            "(restart 1/1)") in err
    assert f"[launch] worker {hung} is stopped (SIGSTOP or a debugger) and cannot act on " \
           "SIGTERM; killing it" in err
    assert "restart 1 rank 1 done" in out
    _assert_same_parameters(tmp_path, reference)


def test_sigterm_to_one_worker_stops_every_worker_at_one_step_and_the_group_resumes(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    # no --max-restarts: a preemption restarts the group without spending one; the chief
    # saves only when the workers agree to stop
    status, out, err = _launch(tmp_path, "--watch", "--save-every", "0", "--event", "0:1:3:term")
    assert status == 0, out + err
    assert "[worker 1] [preemption] received SIGTERM" in out
    assert "[worker 0] rank 0 stops for preemption after step 3" in out
    assert "[worker 1] rank 1 stops for preemption after step 3" in out
    assert "[launch] the tasks stopped for preemption" in err and "restarting all 2 tasks" in err
    assert "restart 1 rank 0 resumes at step 4" in out and "restart 1 rank 1 resumes at step 4" in out
    _assert_same_parameters(tmp_path, reference)


def test_sigterm_to_the_launcher_lets_the_workers_save_and_a_new_launch_resumes(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "stratagem.launch", "--workers", "2", "--grace-period", "60",
         str(SCRIPT), str(tmp_path), "--steps", str(STEPS), "--watch", "--save-every", "0",
         "--step-seconds", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in launcher.stdout:  # training is under way once a worker reaches step 2
            lines.append(line)
            if "restart 0 rank 1 step 2" in line:
                launcher.send_signal(signal.SIGTERM)
                break
        rest, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
        launcher.wait()
    out = "".join(lines) + rest
    assert launcher.returncode == 143, out + err
    stops = re.findall(r"rank (\d) stops for preemption after step (\d+)", out)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], out
    assert stops[0][1] == stops[1][1], stops                  # the same step on both workers
    step = int(stops[0][1])
    assert "[launch] received SIGTERM; stopping 2 task(s)" in err
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == step + 1

    status, out, err = _launch(tmp_path)
    assert status == 0, out + err
    assert f"restart 0 rank 0 resumes at step {step + 1}" in out
    _assert_same_parameters(tmp_path, reference)


def test_the_preemptible_example_runs_and_resumes_in_a_smaller_group(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "preemptible.py"
    # two workers train and save; one worker then resumes from their checkpoint: nothing left
    for workers, start in ((2, 0), (1, 60)):
        stdout, stderr = io.StringIO(), io.StringIO()
        status = launch_local(example, ["--dir", str(tmp_path), "--steps", "60", "--save-every", "20"],
                              num_workers=workers, stdout=stdout, stderr=stderr)
        assert status == 0, stdout.getvalue() + stderr.getvalue()
        assert f"[worker 0] restart 0: starting at step {start} of 60" in stdout.getvalue()
        assert "[worker 0] done: 60 steps" in stdout.getvalue()
