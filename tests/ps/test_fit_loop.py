"""sg.Model under ParameterServerStrategy: a coordinator, 2 workers and 1 ps as real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(__file__).parent / "ps_fit_script.py"


@pytest.mark.multiprocess
def test_fit_schedules_steps_through_the_coordinator(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "1",
                           str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = torch.load(tmp_path / "report.pt", weights_only=False)
    assert "needs steps_per_epoch" in report["error"]
    history = report["history"]
    assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert report["after"]["loss"] < report["before"]["loss"] and report["after"]["accuracy"] > 0.8
    assert report["predict_matches"]
    assert report["same_coordinator"]
    # steps_per_execution=4 over 10 steps: 3 functions (4 + 4 + 2 steps), callbacks at their last steps
    assert report["scheduled"] == 3 and report["execution_steps"] == [3, 7, 9], report
    assert report["more_loss"][0] < report["history"]["loss"][0]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Epoch " in line]
    assert len(lines) == 3 and "Epoch 3/3 25/25 steps (100%) loss: " in lines[-1], lines


def test_a_worker_s_input_is_read_over_and_over_or_refused_clearly() -> None:
    # what a worker reads: a dataset_fn's DataLoader (TensorFlow's dataset_fn ends in .repeat()) starts over
    # when it ends; a one-shot iterator cannot, and says so instead of a bare StopIteration
    import itertools

    from stratagem.data.input import InputContext
    from stratagem.errors import InvalidArgumentError
    from stratagem.ps.fit_loop import _dataset_fn

    loader = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    read = _dataset_fn(lambda context: loader, None, None, None, True)(InputContext())
    assert [batch.tolist() for batch in itertools.islice(read, 5)] == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    once = _dataset_fn(lambda context: iter(loader), None, None, None, True)(InputContext())
    with pytest.raises(InvalidArgumentError, match="ran out after one pass and cannot be read again"):
        list(itertools.islice(once, 5))
