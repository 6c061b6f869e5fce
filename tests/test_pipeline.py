"""PipelineStrategy in one process: stage plans, padding of uneven batches, argument checks, a 1-process pipeline.

The multi-process equivalence tests are in tests/multi_worker/test_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.placement.pipeline import plan_stages
from stratagem.placement.pipeline_schedule import _row_order

pytestmark = pytest.mark.timeout(120)


def mlp(children: int = 8) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(children)])


def plan(model=None, **options):
    config = {"split_points": None, "num_stages": None, "pipe_size": 2, "schedule": "1f1b", "num_microbatches": 4}
    return plan_stages(mlp() if model is None else model, **{**config, **options})


def test_even_split_and_placements() -> None:
    assert plan().bounds == ((0, 4), (4, 8))
    assert plan(model=mlp(7), num_stages=2).bounds == ((0, 4), (4, 7))
    loop = plan(schedule="interleaved")
    assert loop.bounds == ((0, 2), (2, 4), (4, 6), (6, 8)) and loop.stages_of(0) == [0, 2]
    v = plan(schedule="zero_bubble", pipe_size=4)
    assert v.num_stages == 8 and v.stages_of(0) == [0, 7] and v.stages_of(3) == [3, 4]
    assert plan(split_points=["3", "5"], pipe_size=1, schedule="interleaved").bounds == ((0, 3), (3, 5), (5, 8))


@pytest.mark.parametrize("options,message", [
    ({"model": nn.Bilinear(2, 2, 2)}, "splits an nn.Sequential created in its scope, but got a Bilinear"),
    ({"split_points": ["9"]}, "'9' names no child"),
    ({"split_points": ["5", "3"], "schedule": "interleaved", "pipe_size": 1}, "distinct children in model order"),
    ({"split_points": ["0"]}, "none of them the first"),
    ({"num_stages": 9}, "only 8 children"),
    ({"num_stages": 3, "schedule": "gpipe"}, "needs 2 stages"),
    ({"num_stages": 3, "schedule": "interleaved"}, "needs a multiple of 2 stages"),
    ({"num_stages": 2, "schedule": "zero_bubble"}, "needs 4 stages"),
    ({"num_microbatches": 1}, "at least as many micro-batches as stages"),
    ({"schedule": "interleaved", "num_microbatches": 5}, "multiple of 2"),
])
def test_plans_that_cannot_run_are_refused(options, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        plan(**options)


def test_uneven_batches_are_padded_with_rows_that_reach_no_loss() -> None:
    assert _row_order(8, 4) is None
    assert _row_order(10, 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, 8, 9, -1]
    assert _row_order(3, 4).tolist() == [0, 1, 2, -1]


@pytest.mark.parametrize("options,message", [
    ({"schedule": "pipedream"}, "schedule must be one of"),
    ({"num_microbatches": 0}, "num_microbatches must be a positive integer"),
    ({"split_points": ["2"], "num_stages": 2}, "not both"),
    ({"split_points": "2"}, "list of child names"),
    ({"mesh": {"data": 2}}, "'data' 2 processes, which does not divide the 1 processes"),
    ({"mesh": {"data": 1, "pipe": 2}}, "has 2 processes, but the cluster has 1"),
    ({"mesh": {"model": 2}}, "'data' and/or 'pipe'"),
    ({"loss_fn": "mse"}, "loss_fn must be callable"),
])
def test_arguments_are_checked_before_any_process_group(options, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        sg.experimental.PipelineStrategy(**options)


@pytest.fixture
def solo_group():
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["zero_bubble", "interleaved"])
def test_one_process_runs_every_stage_and_equals_plain_training(schedule, solo_group) -> None:
    torch.manual_seed(0)
    strategy = sg.experimental.PipelineStrategy(num_microbatches=3, schedule=schedule)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)).double()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)).double()
    plain.load_state_dict(model.state_dict())
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    assert strategy.stages_of(model) == [0, 1]
    g = torch.Generator().manual_seed(1)
    for rows in (6, 7, 2):   # divisible, not divisible, fewer rows than micro-batches
        x, y = torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(rows, 2, generator=g,
                                                                                   dtype=torch.float64)

        def step(x, y):
            optimizer.zero_grad()
            loss = strategy.forward_backward(model, x, y, loss_fn=nn.functional.mse_loss)
            optimizer.step()
            return loss
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        plain_optimizer.zero_grad()
        want = nn.functional.mse_loss(plain(x), y)
        want.backward()
        plain_optimizer.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match="need the nn.Sequential created in this"):
        strategy.forward_backward(plain, x, y, loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(strategy.predict(model, x), plain(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match="needs loss_fn"):
        strategy.forward_backward(model, x, y)
