"""benchmarks/model_parallel.py --part pipeline --quick runs (so that the script does not rot).

One small run in real processes: the bubble/memory sweep of GPipe and 1F1B at m=2 (raw torch
schedules), and the step time of PipelineStrategy with 1F1B. No timing is checked: only that
every table is printed, that 1F1B holds the activations it should, and that the strategy
trained as the raw schedule did (the same loss after the same steps).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "model_parallel.py"


def test_pipeline_benchmark_quick_mode_prints_every_table() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--part", "pipeline", "--quick", "--schedules", "gpipe",
                          "1f1b", "--microbatch-sweep", "2", "--microbatches", "2", "--configs", "bubble", "ours:1f1b"],
                         capture_output=True, text=True, timeout=180)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    bubble = re.search(r"^1f1b +2 +0\.333 +[0-9.]+ +[0-9.]+ +[0-9.]+ +([0-9.]+)$", out, re.M)
    assert bubble, out
    # rank 0 holds both micro-batches under 1F1B too, rank 1 one of the two that GPipe holds
    assert re.search(r"^1f1b +2 +[0-9.]+ +[0-9.]+ +1\.000 +0\.500 +1\.000 +0\.500$", out, re.M), out
    assert re.search(r"^rank 1 \|[FB.]+\|$", out, re.M), out                              # the timeline
    ours = re.search(r"^ours:1f1b!? .* ([0-9.]+)$", out, re.M)
    assert ours, out
    assert abs(float(ours.group(1)) - float(bubble.group(1))) < 1e-4 * float(bubble.group(1)), out
