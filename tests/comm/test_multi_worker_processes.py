"""A multi-worker job's processes end cleanly (``comm/processes.py``'s ``WorkerGroup.close``), run
as a user's job runs: ``stratagem launch`` starting fresh interpreters (not forked from the test
suite's server, whose preloaded modules would hide what an import does in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent   # (the scripts are run, never imported: they start a job)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_a_job_that_ends_after_training_leaves_no_gloo_thread(tmp_path: Path) -> None:
    """torch.distributed._shard, imported once a group exists (placing an optimizer imports it),
    kept the group alive past destroy_process_group(): gloo's threads outlived the strategy, and
    one of them aborted a process that had trained correctly, now and then, at exit."""
    output = _launch(tmp_path, HERE / "clean_exit_script.py")
    assert output.count("no gloo threads at exit") == 2, output[-4000:]
    assert "worker 0 done" in output and "worker 1 done" in output, output[-4000:]


def test_a_sharded_job_ends_with_gloo_threads_at_rest_though_they_crawl(tmp_path: Path) -> None:
    """A model sharded over the workers holds the group, so gloo's threads live to the end: the
    strategy's close must wait until they have let go of every collective, even threads that crawl
    for 3 s from the last step on (without that wait this check failed in 1 of 8 runs, and in 4 of 8
    with a crawl that lasted to the exit, which a busy machine could stretch past the wait's 10 s;
    the guide's script beside three busy loops aborted at exit in 3-4 of 30)."""
    output = _launch(tmp_path, HERE / "clean_exit_script.py", "parameters")
    assert output.count("3 gloo threads, at rest at exit") == 2, output[-4000:]
    assert "worker 0 done" in output and "worker 1 done" in output, output[-4000:]


def test_gloo_threads_are_brought_to_rest_only_once_they_let_go(tmp_path: Path) -> None:
    """A gloo thread holds a collective until the peer joins it, 0.5 s after being told: bring_to_rest
    waits for it, and after it the dropped tensor is gone (without the wait it is still held, every
    time)."""
    output = _launch(tmp_path, HERE / "gloo_rest_script.py")
    assert "worker 1: joined the all-reduce" in output, output[-4000:]
    line = next((text for text in output.splitlines() if "worker 0: held before" in text), "")
    assert "held before: True; at rest: True after" in line and "held after: False; sum 3.0" in line, output[-4000:]


def _launch(tmp_path: Path, script: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(script), *args],
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output
