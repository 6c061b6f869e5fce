"""Multi-worker input seen from inside two real worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster

from . import input_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("input")
    for r in run_local_cluster(Path(input_script.__file__), 2, args=[str(out)], timeout=100):
        assert r.returncode == 0, r.output
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_auto_shard_gives_each_worker_its_replicas_slices(reports: list[dict]) -> None:
    assert reports[0]["auto"] == [[[0, 1, 2], [3, 4]], 9]
    assert reports[1]["auto"] == [[[5, 6], [7, 8]], 9]


def test_shard_off_gives_every_worker_the_whole_batch(reports: list[dict]) -> None:
    for report in reports:
        assert report["off"] == [[[0, 1, 2, 3, 4], [5, 6, 7, 8]], 18]


def test_dataloader_loads_only_this_workers_rows_in_one_agreed_order(reports: list[dict]) -> None:
    loaded = [r["loader"]["loaded"] for r in reports]
    # 10 rows in batches of 4, 4, 2 over 4 replicas: worker 1's share of the last batch is empty,
    # and it loads one row there only to drop it (a DataLoader cannot collate nothing)
    assert sorted(loaded[0]) != sorted(loaded[1])
    assert len(loaded[0]) == 6 and len(loaded[1]) == 5
    assert set(loaded[0]) | set(loaded[1]) == set(range(10))
    seen = [r["loader"]["seen"] for r in reports]
    assert [total for _, total in seen[0]] == [4, 4, 2] == [total for _, total in seen[1]]
    rows = [[row for replicas, _ in s for replica in replicas for row in replica] for s in seen]
    assert sorted(rows[0] + rows[1]) == list(range(10))


def test_uneven_generators_stop_together_without_losing_a_batch(reports: list[dict]) -> None:
    steps = [r["uneven"] for r in reports]
    assert len(steps[0]) == len(steps[1]) == 5
    # worker 0 ran out after 3 batches: its replicas get empty slices for the last two
    assert [rows for rows, _ in steps[0][3:]] == [[[], []], [[], []]]
    # the loss of each step is the mean over every row that still exists
    for step in range(5):
        assert steps[0][step][1] == pytest.approx(steps[1][step][1])
    # step 4: only worker 1 still reads a global batch of 4 rows (value 14); it keeps its
    # replicas' quarter-slices (2 rows), divided by the global batch size 4
    assert steps[0][4][1] == pytest.approx(14.0 * 2 / 4)


def test_datasets_from_function_one_pipeline_per_worker(reports: list[dict]) -> None:
    ff = [r["from_function"] for r in reports]
    assert len(ff[0]) == len(ff[1]) == 2  # 3 per-replica batches = 2 steps over 2 local replicas
    assert ff[0][0] == [[[0.0, 0.0], [0.0, 0.0]], 8]
    assert ff[1][0] == [[[1.0, 1.0], [1.0, 1.0]], 8]
    # step 2: worker 0 has one batch left (its 2nd replica gets an empty slice), worker 1 has none left
    assert ff[0][1][1] == 2 and ff[1][1][1] == 2
