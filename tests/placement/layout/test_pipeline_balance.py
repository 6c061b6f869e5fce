"""split_points="auto": the partitioner (pure: known costs give the known optimal split), and PipelineStrategy
cutting models by their measured blocks on 2 real processes, which all take the same split, train exactly as
plain PyTorch (float64), print the split once, and train alike with that split pinned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import stratagem as sg
from .history import assert_history_matches
from stratagem.testing import run_local_cluster
from stratagem.placement.layout.pipeline_balance import partition

from . import pp_options_script as script
from .pp_options_runs import launch, plain_history


def stage_costs(costs: list[float], edges: list[int]) -> list[float]:
    return [sum(costs[a:b]) for a, b in zip(edges[:-1], edges[1:])]


@pytest.mark.parametrize("costs, stages, edges", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([4, 1, 1, 1, 1], 2, [0, 1, 5]),              # the 4x block alone
    ([1, 1, 1, 1, 4], 2, [0, 4, 5]),
    ([4, 1, 1, 4, 4, 1, 1, 1], 4, [0, 2, 4, 5, 8]),   # bottleneck 5: [4,1] [1,4] [4] [1,1,1]
    ([2, 3, 1, 5, 2], 1, [0, 5]),
    ([3, 1, 2], 3, [0, 1, 2, 3]),                  # as many stages as blocks: one each
    ([0, 0, 0, 0], 2, [0, 2, 4]),                  # free blocks: an even split
])
def test_partition_gives_the_known_optimal_split(costs, stages, edges) -> None:
    assert partition(costs, stages) == edges


def test_partition_breaks_ties_evenly_then_toward_longer_first_stages() -> None:
    # 7 equal blocks in 3 stages: bottleneck 3 in (3,3,1), (3,2,2), (2,3,2), ...; the least sum of squares
    # is (3,2,2) and its permutations; the earlier stages longer: (3,2,2), as an even split gives
    assert partition([1] * 7, 3) == [0, 3, 5, 7]
    assert partition([1] * 5, 2) == [0, 3, 5]
    # the bottleneck first: [5 | 1 1 1 1 1] (max 5) beats the more even-looking [5 1 | 1 1 1 1]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    # among the splits at the bottleneck (6), the other stages even: [6] [3 3] [3 3] not [6] [3] [3 3 3]
    assert partition([6, 3, 3, 3, 3], 3) == [0, 1, 3, 5]


def test_partition_is_optimal_against_every_split() -> None:
    import itertools
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 9, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        costs = [float(c) for c in torch.rand(n, generator=g) * 10]
        best = min(max(stage_costs(costs, [0, *cut, n])) for cut in itertools.combinations(range(1, n), k - 1))
        assert max(stage_costs(costs, partition(costs, k))) == best


def test_partition_refuses_more_stages_than_blocks_and_bad_costs() -> None:
    with pytest.raises(sg.errors.InvalidArgumentError, match="3 stages need at least 3 blocks to split, got 2"):
        partition([1.0, 2.0], 3)
    with pytest.raises(sg.errors.InvalidArgumentError, match="positive integer"):
        partition([1.0], 0)
    with pytest.raises(sg.errors.InvalidArgumentError, match="finite and non-negative"):
        partition([1.0, float("nan")], 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_auto_split_agrees_on_every_process_trains_as_plain_pytorch_and_pins(tmp_path: Path) -> None:
    outputs, printed = launch(tmp_path, "balance")
    cases = {**script.BALANCE, "pinned": ("uneven", "sgd", {})}
    for case, (model_name, kind, options) in cases.items():
        expected, predicted = plain_history(model_name, kind, outputs[0][case]["initial"])
        splits = [result[case]["split_points"] for result in outputs]
        assert splits[0] and all(split == splits[0] for split in splits), f"{case}: the processes split differently"
        stages = sorted(s for result in outputs for s in result[case]["stages"])
        assert stages == list(range(len(splits[0]) + 1)), (case, stages)
        for rank, result in enumerate(outputs):
            out = result[case]
            assert (out["split_before"] is None) == (options.get("split_points") == "auto")
            assert_history_matches(out["history"], expected, f"{case}, process {rank}")
            if "predict" in out:   # (nn.Sequential models)
                torch.testing.assert_close(torch.tensor(out["predict"], dtype=torch.float64), predicted,
                                           rtol=1e-12, atol=1e-12)
    assert outputs[0]["pinned"]["split_points"] == outputs[0]["auto-gpipe"]["split_points"]
    assert len(outputs[0]["auto-traced-interleaved"]["split_points"]) == 3
    assert all(p.startswith("blocks.") for p in outputs[0]["auto-traced-interleaved"]["split_points"])
    # the split printed once (the first process), in the form split_points= takes
    announced = [line for line in printed[0] if "split_points='auto'" in line]
    assert len(announced) == len(script.BALANCE), printed[0]
    assert f"pass split_points={outputs[0]['auto-gpipe']['split_points']!r} to pin" in announced[0]
    assert "balance_by='memory'" in announced[1] and "MiB per stage" in announced[1]
    assert not [line for line in printed[1] if "split_points='auto'" in line]
    for rank, result in enumerate(outputs):
        errors = result["errors"]
        assert "different PipelineStrategy configurations" in errors["mismatch_auto"], errors["mismatch_auto"]
        assert "give split_points='auto' with it" in errors["balance_by_alone"]
        assert "balance_by must be one of ['time', 'memory'], got 'speed'" in errors["balance_by_value"]
        assert "needs 10 stages (num_stages=10)" in errors["auto_too_many_stages"]
        assert "only 8 children" in errors["auto_too_many_stages"]
        # the first process could not trace the model to measure it: every process raises, none waits
        assert "could not trace the Branches" in errors["auto_untraceable"] if rank == 0 else \
            "the first process could not measure the Branches's blocks" in errors["auto_untraceable"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_measuring_process_killed_stops_the_other_with_a_clear_error(tmp_path: Path) -> None:
    """SIGKILL of global rank 0 while it measures the blocks: the other process, waiting for the split,
    fails with an UnavailableError naming it and what it waited for, within the communication timeout."""
    results = run_local_cluster(Path(script.__file__), 2, args=[str(tmp_path), "--part", "killed"], timeout=150)
    first, second = results
    assert "losing while measuring" in first.output
    assert second.returncode == 3, second.output
    out = json.loads((tmp_path / "rank1.json").read_text())
    assert out["type"] == "UnavailableError", out
    assert "split_points='auto'" in out["error"] and "worker 0" in out["error"], out["error"]
    assert out["seconds"] < script.TIMEOUT + 60, out
