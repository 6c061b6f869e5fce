"""PipelineStrategy in one process: stage plans, padding of uneven batches, argument checks, a 1-process pipeline.

The multi-process equivalence tests are in tests/placement/layout/test_multi_worker_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.pipeline_plan import plan_stages
from stratagem.placement.layout.pipeline_trace import traced_split_points
from stratagem.placement.layout.pipeline_schedule import _row_order

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
    ({"model": nn.Bilinear(2, 2, 2)}, "the Bilinear is not an nn.Sequential and has no nn.ModuleList"),
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
    ({"split_points": "2"}, "list of module names"),
    ({"mesh": {"data": 2}}, "'data' 2 processes, which does not divide the 1 processes"),
    ({"mesh": {"data": 1, "pipe": 2}}, "has 2 processes, but the cluster has 1"),
    ({"mesh": {"pipeline": 2}}, "'data' and/or 'pipe'"),
    ({"mesh": {"model": 2}}, "model axis of 2 processes, but no tensor-parallel plan"),
    ({"mesh": {"model": 2}, "plan": {"0": "colwise"}}, "'model' 2 processes, which does not divide the 1"),
    ({"mesh": {"pipe": 1, "model": 1}, "sharding": "stage3"}, "sharding must be None"),
    ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ({"split_points": "auto", "sharding": "optimizer"}, "pin the split instead"),
    ({"split_points": "auto", "mesh": {"model": 1}, "plan": {"0": "colwise"}}, "pin the split instead"),
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
    with pytest.raises(InvalidArgumentError, match="need the model created in this"):
        strategy.forward_backward(plain, x, y, loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(strategy.predict(model, x), plain(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match="needs loss_fn"):
        strategy.forward_backward(model, x, y)


def test_running_statistics_move_once_per_micro_batch_as_in_plain_training(solo_group) -> None:
    """torch runs a new stage once on uninitialised tensors to learn its shapes: that run must not
    reach BatchNorm's running statistics (each new batch shape builds new stages)."""
    torch.manual_seed(0)

    def net():
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()
    strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="interleaved")
    with strategy.scope():
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = net()
    plain.load_state_dict(model.state_dict())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for rows in (6, 6, 8):   # a new shape at the first and third steps
        x, y = (torch.randn(rows, n, generator=g, dtype=torch.float64) for n in (4, 2))

        def step(x, y):
            optimizer.zero_grad()
            loss = strategy.forward_backward(model, x, y, loss_fn=nn.functional.mse_loss)
            optimizer.step()
            return loss
        strategy.run(step, args=(x, y))
        plain_optimizer.zero_grad()
        for part_x, part_y in zip(x.chunk(2), y.chunk(2)):   # the micro-batches, each with its batch statistics
            (nn.functional.mse_loss(plain(part_x), part_y) * (len(part_x) / rows)).backward()
        plain_optimizer.step()
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_split_points_of_a_traced_model_are_checked_or_derived_from_its_longest_module_list() -> None:
    from .pp_script import Tokens
    assert traced_split_points(Tokens(), None, 2) == ["blocks.2"]
    assert traced_split_points(Tokens(), None, 3) == ["blocks.2", "blocks.3"]
    assert traced_split_points(nn.Bilinear(2, 2, 2), None, 1) == []   # one stage: nothing to cut
    assert traced_split_points(Tokens(), ["head", "blocks.1"], 3) == ["head", "blocks.1"]
    assert plan(model=Tokens(), schedule="interleaved").points == ("blocks.1", "blocks.2", "blocks.3")
    with pytest.raises(InvalidArgumentError, match="'blocks.7' names no module of the Tokens"):
        traced_split_points(Tokens(), ["blocks.7"], 2)
    with pytest.raises(InvalidArgumentError, match="needs 2 stages"):
        plan(model=Tokens(), split_points=["blocks.1", "blocks.2"], schedule="gpipe")


def test_a_traced_model_trains_as_plain_pytorch_and_keeps_its_names(solo_group, tmp_path) -> None:
    """One process, two stages: a model with its own forward, cut at blocks.2 by the tracer; a plain
    checkpoint restores into it before the first step, and its checkpoint restores into a plain model."""
    from .pp_script import Tokens
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        plain = Tokens()
        plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
        path = sg.Checkpoint(model=plain, optimizer=plain_optimizer).save(tmp_path / "plain")
        strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="interleaved",
                                                    split_points=["blocks.2"], loss_fn=nn.functional.mse_loss)
        with strategy.scope():
            model = Tokens()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        sg.Checkpoint(model=model, optimizer=optimizer).restore(path)
        g = torch.Generator().manual_seed(1)
        for rows in (6, 5, 6):   # a new shape traces again; the first one's graphs come back
            x, y = torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)
            optimizer.zero_grad()
            loss = strategy.forward_backward(model, x, y)
            optimizer.step()
            plain_optimizer.zero_grad()
            want = nn.functional.mse_loss(plain(x), y)
            want.backward()
            plain_optimizer.step()
            torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        assert list(model.state_dict()) == list(plain.state_dict())
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)
        assert optimizer.state_dict()["param_groups"] == plain_optimizer.state_dict()["param_groups"]
        torch.testing.assert_close(strategy.predict(model, x), plain(x), rtol=1e-12, atol=1e-12)
        model.eval()   # another mode: traced again
        torch.testing.assert_close(strategy.predict(model, x), plain(x), rtol=1e-12, atol=1e-12)
        back = Tokens()
        back_optimizer = torch.optim.Adam(back.parameters(), lr=0.01)
        sg.Checkpoint(model=back, optimizer=back_optimizer).restore(
            sg.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "pipelined"))
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(back.state_dict()[name], value, rtol=1e-12, atol=1e-12)
        for index, state in plain_optimizer.state_dict()["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(back_optimizer.state_dict()["state"][index][key], value)
        with pytest.raises(InvalidArgumentError, match=r"gave 1 stages, not 2"):
            other = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="interleaved",
                                                     split_points=["blocks"])   # a ModuleList is never called
            with other.scope():
                container = Tokens()
            other.forward_backward(container, x, y, loss_fn=nn.functional.mse_loss)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_traced_model_fits_under_sg_model_as_under_the_default_strategy(solo_group) -> None:
    from .pp_script import Tokens
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(23, 6, generator=g, dtype=torch.float64), torch.randn(23, 3, generator=g, dtype=torch.float64)

    def run(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            model = sg.Model(Tokens().double())
            model.compile(optimizer=torch.optim.Adam(model.module.parameters(), lr=0.01), loss="mse")
        history = model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], model.module.state_dict(), model.predict(x, batch_size=23)

    want = run(sg.get_strategy())
    got = run(sg.experimental.PipelineStrategy(num_microbatches=3, schedule="interleaved"))   # 2 stages here
    assert got[0] == pytest.approx(want[0], rel=1e-12)
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)
