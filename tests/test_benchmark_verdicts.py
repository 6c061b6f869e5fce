"""The benchmarks' verdict rule (``benchmarks/_harness.py``): a target is decided on the median's
95 % interval from the rounds' order statistics, which narrows as rounds are added."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "_bench_harness", Path(__file__).resolve().parents[1] / "benchmarks" / "_harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


@pytest.mark.parametrize("n, ranks", [(5, None), (6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (40, (14, 27))])
def test_the_interval_is_the_binomial_order_statistics(n: int, ranks: tuple[int, int] | None) -> None:
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert harness.median_interval(values) == (None if ranks is None else tuple(float(r) for r in ranks))


def test_the_interval_covers_the_median_at_least_95_percent_of_the_time() -> None:
    rng, n, covered, trials = random.Random(0), 20, 0, 4000
    for _ in range(trials):   # the median of an exponential(1) is ln 2
        lo, hi = harness.median_interval([rng.expovariate(1.0) for _ in range(n)])
        covered += lo <= math.log(2) <= hi
    assert covered / trials >= 0.95


def test_a_verdict_needs_the_interval_on_one_side_and_more_rounds_narrow_it() -> None:
    noisy = [1.0 + 0.15 * ((i * 7919) % 21 - 10) / 10 for i in range(21)]   # median 1.0, range 0.85-1.15
    assert harness.decision(noisy[:5], 1.05) == "undecided"      # too few rounds for any interval
    assert harness.decision(noisy[:8], 1.05) == "undecided"      # wider than the margin
    assert harness.decision(noisy * 4, 1.05) == "ok"             # 84 rounds: the interval is 1.0 +- 0.02
    assert harness.decision([2 * r for r in noisy * 4], 1.05) == "MISSED"
    assert "median's 95 % interval" in harness.verdict(noisy * 4, 1.05)
