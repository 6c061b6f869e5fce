"""examples/train_ps.py under `stratagem launch --max-restarts`, its chief or a ps SIGKILLed mid-training.

The test waits for a checkpoint line the chief prints, kills the task (found among the
launcher's tasks, forked from the test fork server, by its TF_CONFIG), and checks that the job
finishes as one that was never interrupted would: a restarted chief takes the parameter servers
over and restores the last checkpoint; a restarted ps gets its shard back from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing import task_environments

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ps.py"


def task_pid(launcher: int, task_type: str, index: int) -> int:
    """The pid of a task the launcher started, by the TF_CONFIG it gave it."""
    for pid, env in task_environments(launcher).items():
        if json.loads(env.get("TF_CONFIG", "{}")).get("task") == {"type": task_type, "index": index}:
            return pid
    raise LookupError(f"no {task_type} {index} among the launcher's tasks")


class Job:
    """`stratagem launch` of the example in the background, its output in a file."""

    def __init__(self, tmp_path: Path):
        self.log_path = tmp_path / "launch.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "2",
                 "--max-restarts", "3", str(EXAMPLE), "--steps", "300", "--save-every", "50",
                 "--dir", str(tmp_path / "checkpoints")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {text!r} (launcher status {self.process.poll()}):\n{self.output()[-6000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 240.0) -> str:
        try:
            assert self.process.wait(timeout) == 0, self.output()[-6000:]
        finally:
            self.stop()
        return self.output()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def job(tmp_path: Path):
    made = Job(tmp_path)
    yield made
    made.stop()


def accuracy(output: str) -> float:
    return float(re.search(r"\[chief\] +training accuracy ([0-9.]+)", output).group(1))


def test_a_chief_killed_mid_training_is_restarted_takes_over_and_restores(job: Job) -> None:
    job.wait_for("saved a checkpoint at step 100")
    killed = task_pid(job.process.pid, "chief", 0)
    os.kill(killed, signal.SIGKILL)
    output = job.finish()

    assert "chief was killed by SIGKILL; restarting (1/3)" in output, output
    # the restarted chief took over at once (the old one's process was gone) and restored
    assert f"took ps 0 over from the coordinator of pid {killed} " in output, output
    assert f"took ps 1 over from the coordinator of pid {killed} " in output, output
    assert "waiting up to" not in output, output
    step = int(re.search(r"\[chief\] +restored \S+ckpt-\d+ at step (\d+)", output).group(1))
    assert step >= 100, output
    assert f"steps {step + 1}-{step + 50}: mean loss" in output and "saved a checkpoint at step 300" in output
    assert accuracy(output) > 0.9, output


def test_a_ps_killed_mid_training_gets_its_shard_back_from_the_last_checkpoint(job: Job) -> None:
    job.wait_for("saved a checkpoint at step 100")
    os.kill(task_pid(job.process.pid, "ps", 0), signal.SIGKILL)
    output = job.finish()

    assert "ps 0 was killed by SIGKILL; restarting (1/3)" in output, output
    restored = re.search(r"\[chief\] +ps 0 was lost; restoring \S+ckpt-(\d+)", output)
    assert restored is not None and int(restored.group(1)) >= 3, output   # ckpt-3: step 100
    assert "chief was killed" not in output and "chief exited" not in output, output   # no restart
    assert "saved a checkpoint at step 300" in output and accuracy(output) > 0.9, output
