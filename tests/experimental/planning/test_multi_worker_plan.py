"""``sg.experimental.plan`` on 2 and 4 local CPU processes: the table, the memory prediction against the
measured bytes, memory-bound choices, and ``plan.strategy()`` training to plain PyTorch's parameters.

Every plan starts its own trial cluster (:mod:`stratagem.experimental.planning.trial`); the training
runs ``train_script.py`` (the one training loop, its strategy line ``plan.strategy()``) on a cluster
of its own. No test reads a time: which measured layout wins depends on the machine's load, and the
claim that the winner is within 10% of the exhaustive best is ``benchmarks/planning.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import cloudpickle
import pytest
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.experimental.planning.layouts import Layout
from stratagem.testing import assert_succeeded, run_local_cluster

from . import models

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
SCRIPT = Path(__file__).with_name("train_script.py")
MLP_PARAMS = sum(q.numel() for q in models.mlp().parameters())


@pytest.fixture(scope="module")
def mlp_plan() -> sg.experimental.Plan:
    return sg.experimental.plan(models.mlp, models.mlp_batch(16), 2, global_batch=16, tensor_plan=models.MLP_PLAN,
                                time_budget_s=60, num_measured=3, steps=2)


@pytest.fixture(scope="module")
def transformer_plan() -> sg.experimental.Plan:
    return sg.experimental.plan(models.transformer, models.token_batch(8), 2, global_batch=8,
                                loss_fn=models.token_loss, tensor_plan=models.TRANSFORMER_PLAN, time_budget_s=60,
                                num_measured=3, steps=2)


def _check_table(plan: sg.experimental.Plan, world: int, pipeline: str) -> None:
    text = str(plan)
    assert "chosen" in text and plan.code in text and plan.code.startswith("strategy = sg.experimental.PipelineStrategy(")
    described = {row.layout.describe() for row in plan.rows}
    assert {f"{world}x1x1", f"{world}x1x1 zero-1", f"{world}x1x1 zero-3", pipeline, f"1x1x{world}"} <= described
    chosen = [row for row in plan.rows if row.note == "chosen"]
    assert len(chosen) == 1 and chosen[0].layout == plan.layout
    measured = [row for row in plan.rows if row.measured_seconds is not None]
    probes = [row for row in measured if row.probe]
    meshes = {(r.layout.data, r.layout.pipe, r.layout.model) for r in plan.rows if r.calibrated_seconds is not None}
    # the probes (one per mesh, while time_budget_s lasts), then at most num_measured=3 others
    assert 1 <= len(probes) <= len(meshes) and len(measured) <= len(meshes) + 3
    for row in probes:   # a probe calibrates its mesh: its calibrated prediction is what it measured
        assert row.calibrated_seconds == pytest.approx(row.measured_seconds)
    assert chosen[0].measured_seconds == min(row.measured_seconds for row in measured)
    for row in measured:   # the model states' bytes, counted on every process, and the step's peak: within 5%
        assert row.measured_model_states == pytest.approx(row.prediction.model_states, rel=0.05), row
        assert row.measured_peak == pytest.approx(row.prediction.memory, rel=0.05), (row, row.peak_parts)
    # every prediction's model states are the memory model's, whatever the layout
    for row in plan.rows:
        if row.prediction is not None:
            assert row.prediction.memory >= row.prediction.model_states > 0


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_predicted_memory_is_within_5_percent_of_the_measured_peak_for_every_layout(kind) -> None:
    # every layout of 2 processes measured (num_measured=None): its peak, the fullest process's, against the
    # prediction -- data parallelism under each ZeRO stage, GPipe and 1F1B with and without recomputation, a model axis
    if kind == "mlp":
        plan = sg.experimental.plan(models.mlp, models.mlp_batch(16), 2, global_batch=16, tensor_plan=models.MLP_PLAN,
                                    time_budget_s=300, num_measured=None, steps=1, verbose=False)
    else:
        plan = sg.experimental.plan(models.transformer, models.token_batch(8), 2, global_batch=8,
                                    loss_fn=models.token_loss, tensor_plan=models.TRANSFORMER_PLAN, time_budget_s=300,
                                    num_measured=None, steps=1, verbose=False)
    predicted = [row for row in plan.rows if row.prediction is not None]
    measured = [row for row in predicted if row.measured_peak is not None]
    assert len(measured) == len(predicted) == 18, str(plan)
    described = {row.layout.describe() for row in measured}
    assert {"2x1x1", "2x1x1 zero-1", "2x1x1 zero-2", "2x1x1 zero-3 recompute", "1x2x1 gpipe m=4",
            "1x2x1 1f1b m=4 recompute", "1x1x2", "1x1x2 recompute"} <= described
    for row in measured:
        assert row.measured_peak == pytest.approx(row.prediction.memory, rel=0.05), (
            row.layout.describe(), row.prediction, row.peak_parts)


def _train(tmp_path: Path, plan: sg.experimental.Plan, kind: str, world: int) -> dict[str, torch.Tensor]:
    # the workers import this folder's `models` as a top-level module, not as `tests....models`: the
    # plan's references to it (the transformer's block class in its tensor plan) travel by value
    cloudpickle.register_pickle_by_value(models)
    (tmp_path / "plan.pkl").write_bytes(cloudpickle.dumps(plan))
    out = tmp_path / "state.pt"
    results = run_local_cluster(SCRIPT, world, args=[str(tmp_path / "plan.pkl"), str(out), kind], timeout=240)
    assert_succeeded(results)
    return torch.load(out)


def _plain(kind: str) -> dict[str, torch.Tensor]:
    build, batches, loss_fn, rows = {"mlp": (models.mlp, models.mlp_batch, torch.nn.functional.mse_loss, 16),
                                     "transformer": (models.transformer, models.token_batch, models.token_loss, 8)}[kind]
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(3):
        x, y = batches(rows, seed=s)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_mlp_plan_on_two_processes_trains_to_plain_pytorch(mlp_plan, tmp_path) -> None:
    _check_table(mlp_plan, 2, "1x2x1 1f1b m=2")
    got = _train(tmp_path, mlp_plan, "mlp", 2)
    want = _plain("mlp")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11)


def test_transformer_plan_on_two_processes_trains_to_plain_pytorch(transformer_plan, tmp_path) -> None:
    _check_table(transformer_plan, 2, "1x2x1 gpipe m=4 recompute")
    got = _train(tmp_path, transformer_plan, "transformer", 2)
    want = _plain("transformer")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11)


def test_every_layout_the_plan_measures_trains_to_plain_pytorch(mlp_plan, tmp_path) -> None:
    # the strategy line of each measured layout (not only the winner's), in the same script
    for row in mlp_plan.rows:
        if row.measured_seconds is not None and row.note != "chosen":
            forced = sg.experimental.Plan(rows=mlp_plan.rows, layout=row.layout, world=2,
                                          loss_fn=torch.nn.functional.mse_loss, tensor_plan=models.MLP_PLAN,
                                          summary=[], device="cpu")
            got = _train(tmp_path, forced, "mlp", 2)
            for name, want in _plain("mlp").items():
                torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-11)


def test_memory_limit_below_data_parallelism_moves_to_zero_or_stages() -> None:
    dp_states = 32 * MLP_PARAMS   # float64 parameters and gradients, Adam's two moments
    limit = 0.9 * dp_states
    plan = sg.experimental.plan(models.mlp, models.mlp_batch(16), 2, global_batch=16, memory_limit=limit,
                                time_budget_s=30, num_measured=1, steps=1)
    plain = next(row for row in plan.rows if row.layout == Layout(2, 1, 1))
    assert plain.note.startswith("rejected: needs") and plain.prediction.memory > limit
    assert plan.layout.sharding is not None or plan.layout.pipe > 1
    assert "data parallelism (2x1x1) needs" in str(plan) and "the plan moved to" in str(plan)
    chosen = next(row for row in plan.rows if row.note == "chosen")
    assert chosen.prediction.memory <= limit
    assert chosen.measured_model_states == pytest.approx(chosen.prediction.model_states, rel=0.05)


def test_no_fitting_layout_says_what_the_smallest_needs() -> None:
    # the smallest at its peak is ZeRO-2: under ZeRO-3 torch's pipeline stage keeps each block's parameters and
    # gradient whole from its backward to the schedule's end
    with pytest.raises(InvalidArgumentError, match=r"no layout of 2 processes fits memory_limit=.*the smallest, "
                                                   r"2x1x1 zero-2.*needs .* MiB"):
        sg.experimental.plan(models.mlp, models.mlp_batch(16), 2, global_batch=16, memory_limit=1000,
                             time_budget_s=10, num_measured=1, steps=1, verbose=False)


def test_mlp_plan_on_four_processes() -> None:
    plan = sg.experimental.plan(models.mlp, models.mlp_batch(16), 4, global_batch=16, tensor_plan=models.MLP_PLAN,
                                time_budget_s=60, num_measured=2, steps=1, verbose=False)
    _check_table(plan, 4, "2x2x1 1f1b m=2")
    # 4 stages would cut between the plan's colwise layer and the rowwise one that closes it
    refused = next(row for row in plan.rows if row.layout.describe() == "1x4x1")
    assert refused.note == "rejected: 4 stages need 4 places to cut; the model has 3"


def test_zero3_under_pipelines_on_four_processes_within_5_percent(tmp_path) -> None:
    # ZeRO-3 under torch's pipeline stage, 2 stages of 2 data ranks: under 1F1B with more micro-batches than in
    # flight each forward after a backward reshards the blocks it runs (their gradients stay); its neighbours:
    # GPipe and 1F1B with every micro-batch in flight (no forward follows a backward), and recomputation (its
    # replay gathers every block again); with a model axis (2 data ranks of 2) plain and recomputed. FSDP's
    # all-gather buffers are at the peak of most (a backward's prefetch, a replay's), counted on both sides
    layouts = ["2x2x1 zero-3 1f1b m=4", "2x2x1 zero-3 1f1b m=2", "2x2x1 zero-3 gpipe m=4",
               "2x2x1 zero-3 1f1b m=4 recompute", "2x1x2 zero-3", "2x1x2 zero-3 recompute"]
    out = tmp_path / "peaks.json"
    results = run_local_cluster(Path(__file__).with_name("peak_script.py"), 4, args=[str(out), "4", *layouts],
                                timeout=300)
    assert_succeeded(results)
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(layouts)
    for name, row in got.items():
        assert row["peak"] == pytest.approx(row["predicted"], rel=0.05), (name, row)
    for name in ("2x2x1 zero-3 gpipe m=4", "2x2x1 zero-3 1f1b m=4 recompute", "2x1x2 zero-3"):
        fullest = max(got[name]["parts"], key=lambda parts: sum(v for v in parts.values() if isinstance(v, int)))
        assert fullest.get("gather buffers", 0) > 0, (name, fullest)
