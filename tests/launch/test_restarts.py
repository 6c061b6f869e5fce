"""Coordinated restarts and preemption under ``stratagem launch``, with real training processes.

Every job runs ``restart_script.py``: two MultiWorkerMirroredStrategy workers train a tiny
model over two epochs of a shuffled DataLoader; ``sg.callbacks.BackupAndRestore`` backs up
an ``sg.Checkpoint`` (model, optimizer, the distributed dataset's position, the step) and
every worker resumes from it. The scripts kill, stop or signal themselves before a given
global step of a given run (``--event``), so each failure comes at a known point without
sleeps in the test. The oracle is an uninterrupted run of the same job: a job that
recovers must end with the same parameters, and its *committed* steps -- each worker's
log of sample ids, cut back at every resume to the step the backup went on from -- must
be the uninterrupted run's: nothing skipped, nothing trained twice.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.launch import launch_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]

SCRIPT = Path(__file__).with_name("restart_script.py")
STEPS_PER_EPOCH, STEPS, SAMPLES = 6, 12, 48   # as in restart_script.py

Committed = list[tuple[int, int, list[int]]]   # (epoch, step, sample ids) of the steps in the final state


def _launch(out: Path, *script_args: str, **options: object) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, [str(out), *script_args],
                          stdout=stdout, stderr=stderr, num_workers=2, **options)
    return status, stdout.getvalue(), stderr.getvalue()


def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def _committed(out: Path, rank: int) -> tuple[Committed, list[int]]:
    """The steps of ``rank`` whose effect is in the final state, and the step each run resumed at.

    A run that resumes at step ``s`` (its backup's) drops the steps logged from ``s`` on: they
    were trained after the last backup and lost with the process. A resume beyond the logged
    steps would be a skip; a step that is not the next one, a repeat or a gap.
    """
    committed: Committed = []
    resumes = []
    for line in (out / f"ids-rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "resume" in entry:
            assert entry["resume"] <= len(committed), f"rank {rank} resumed at step {entry['resume']} " \
                f"but only {len(committed)} steps were trained: steps skipped"
            del committed[entry["resume"]:]
            resumes.append(entry["resume"])
        else:
            assert entry["step"] == len(committed), f"rank {rank} trained step {entry['step']} after " \
                f"{len(committed)} steps: {entry}"
            committed.append((entry["epoch"], entry["step"], entry["ids"]))
    return committed, resumes


def _assert_as_uninterrupted(out: Path, reference: dict) -> list[int]:
    """Final parameters and committed steps equal the uninterrupted run's; returns rank 0's resumes."""
    final = _final(out)
    assert final.keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        torch.testing.assert_close(final[name], value, msg=lambda m: f"{name}: {m}")
    resumes = []
    for rank in (0, 1):
        committed, resumes_here = _committed(out, rank)
        assert committed == reference["committed"][rank], f"rank {rank}'s committed steps differ"
        resumes.append(resumes_here)
    assert resumes[0] == resumes[1], resumes
    return resumes[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    status, stdout, stderr = _launch(out)
    assert status == 0, stdout + stderr
    assert stderr == ""
    committed = [_committed(out, rank)[0] for rank in (0, 1)]
    assert [len(c) for c in committed] == [STEPS, STEPS]
    for epoch in (0, 1):   # the two workers' slices: every sample once an epoch
        ids = [i for rank in (0, 1) for e, _, step_ids in committed[rank] if e == epoch for i in step_ids]
        assert sorted(ids) == list(range(SAMPLES)), (epoch, ids)
    return {"params": _final(out), "committed": committed}


def test_two_kills_at_random_steps_in_mid_epoch_restart_the_group_and_resume_exactly(
        tmp_path: Path, reference: dict) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(10**6)))   # set it to replay a failure
    rng = random.Random(seed)
    mid_epoch = [step for step in range(STEPS) if step % STEPS_PER_EPOCH]
    first, second = sorted(rng.sample(mid_epoch, 2))
    ranks = [rng.randrange(2), rng.randrange(2)]
    # backups every 3 steps: a kill between two loses the steps since the last one
    status, out, err = _launch(tmp_path, "--save-every", "3", "--event", f"0:{ranks[0]}:{first}:kill",
                               "--event", f"1:{ranks[1]}:{second}:kill", max_restarts=2)
    context = f"seed {seed}: kills before steps {first} and {second}, of ranks {ranks}\n{out}{err}"
    assert status == 0, context
    assert (f"[launch] worker {ranks[0]} was killed by SIGKILL; restarting all 2 tasks "
            "(restart 1/2)") in err, context
    assert (f"[launch] worker {ranks[1]} was killed by SIGKILL; restarting all 2 tasks "
            "(restart 2/2)") in err, context
    assert err.count("started all 2 tasks again with a new rendezvous") == 2, context
    resumes = _assert_as_uninterrupted(tmp_path, reference)
    assert resumes == [0, first - first % 3, second - second % 3], context


def test_ten_kills_in_a_row_all_recover(tmp_path: Path, reference: dict) -> None:
    # run r: worker r % 2 dies before step r + 1, after one step of progress (a backup every step)
    kills = [f"{run}:{run % 2}:{run + 1}:kill" for run in range(10)]
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
    assert _assert_as_uninterrupted(tmp_path, reference) == list(range(11))
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


def test_preemption_restarts_are_bounded_by_max_preemptions(tmp_path: Path) -> None:
    # a job preempted at every start: free of --max-restarts, but not restarted for ever
    script = tmp_path / "script.py"
    script.write_text('import os, sys\nprint("start", os.environ["STRATAGEM_RESTART"])\nsys.exit(75)\n')
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(script, num_workers=2, max_restarts=1, max_preemptions=2,
                          stdout=stdout, stderr=stderr)
    err = stderr.getvalue()
    assert status == 75, err
    # three starts (the first and two preemption restarts); in the last, the first task to exit
    # ends the job, so the other may be stopped before it prints
    assert set(re.findall(r"\] start (\d)", stdout.getvalue())) == {"0", "1", "2"}, stdout.getvalue()
    assert "restarting all 2 tasks (preemption 1/2; a preemption does not count against " \
           "--max-restarts)" in err
    assert "(preemption 2/2;" in err and "(restart" not in err
    assert re.search(r"worker \d stopped for preemption again \(exit code 75\) after 2 preemption "
                     r"restart\(s\), the most --max-preemptions \(2\) allows; not restarting", err), err


@pytest.mark.parametrize("hung", [1, 0], ids=["worker", "chief"])
def test_a_hung_worker_is_noticed_within_the_timeout_and_the_group_restarts(
        tmp_path: Path, reference: dict, hung: int) -> None:
    # a hung chief also hangs the rendezvous store that the survivor's diagnosis reads
    timeout, survivor = 6.0, 1 - hung
    status, out, err = _launch(tmp_path, "--timeout", str(timeout), "--event", f"0:{hung}:3:stop",
                               max_restarts=1)
    assert status == 0, out + err
    stopped = re.search(rf"rank {hung} sends itself SIGSTOP at ([\d.]+)", out)
    failed = re.search(rf"rank {survivor} raised UnavailableError at ([\d.]+)", out)
    assert stopped and failed, out + err
    stopped_at, failed_at = float(stopped[1]), float(failed[1])
    # gloo's timeout, then up to 3.5 heartbeats to name the lost worker, then slack for load
    assert timeout - 0.5 < failed_at - stopped_at < timeout + 3.5 + 4, failed_at - stopped_at
    assert (f"UnavailableError: gradient all_reduce failed on worker {survivor}: worker {hung} "
            "stopped answering") in out
    assert (f"[launch] worker {survivor} exited with code 1; restarting all 2 tasks "
            "(restart 1/1)") in err
    assert f"[launch] worker {hung} is stopped (SIGSTOP or a debugger) and cannot act on " \
           "SIGTERM; killing it" in err
    assert "restart 1 rank 1 done" in out
    assert _assert_as_uninterrupted(tmp_path, reference) == [0, 3]


def test_sigterm_to_one_worker_stops_every_worker_at_one_step_and_the_group_resumes(
        tmp_path: Path, reference: dict) -> None:
    # no --max-restarts: a preemption restarts the group without spending one; the workers
    # back up only when they agree to stop
    status, out, err = _launch(tmp_path, "--watch", "--save-every", "0", "--event", "0:1:3:term")
    assert status == 0, out + err
    assert "[worker 1] [preemption] received SIGTERM" in out
    assert "[worker 0] rank 0 stops for preemption after step 3" in out
    assert "[worker 1] rank 1 stops for preemption after step 3" in out
    assert "[launch] the tasks stopped for preemption" in err
    assert "restarting all 2 tasks (preemption 1/100;" in err
    assert "restart 1 rank 0 resumes at step 4" in out and "restart 1 rank 1 resumes at step 4" in out
    assert _assert_as_uninterrupted(tmp_path, reference) == [0, 4]


def test_sigterm_to_the_launcher_lets_the_workers_save_and_a_new_launch_resumes(
        tmp_path: Path, reference: dict) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "stratagem.launch", "--workers", "2", "--grace-period", "60",
         str(SCRIPT), str(tmp_path), "--watch", "--save-every", "0", "--step-seconds", "0.2"],
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
    saved = sg.Checkpoint(step=0)   # the backup's step, read with the public API
    sg.CheckpointManager(saved, tmp_path / "backups", checkpoint_name="backup").restore_or_initialize()
    assert saved.step == step + 1

    status, out, err = _launch(tmp_path)
    assert status == 0, out + err
    assert f"restart 0 rank 0 resumes at step {step + 1}" in out
    assert _assert_as_uninterrupted(tmp_path, reference) == [0, step + 1]


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
