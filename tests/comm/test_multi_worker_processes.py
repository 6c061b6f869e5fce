"""A multi-worker job's processes end cleanly (``comm/processes.py``'s ``WorkerGroup.close``), run
as a user's job runs: ``stratagem launch`` starting fresh interpreters (not forked from the test
suite's server, whose preloaded modules would hide what an import does in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from . import clean_exit_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_a_job_that_ends_after_training_leaves_no_gloo_thread(tmp_path: Path) -> None:
    """torch.distributed._shard, imported once a group exists (placing an optimizer imports it),
    kept the group alive past destroy_process_group(): gloo's threads outlived the strategy, and
    one of them aborted a process that had trained correctly, now and then, at exit."""
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2",
                           clean_exit_script.__file__], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count("no gloo threads at exit") == 2, output[-4000:]
    assert "worker 0 done" in output and "worker 1 done" in output, output[-4000:]
