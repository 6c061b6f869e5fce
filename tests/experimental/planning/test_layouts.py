"""The layouts a number of processes allows, the line that pins one, and what the cost model predicts of them."""

from __future__ import annotations

import pytest

from stratagem.experimental.planning.cost import Network, calibrated, calibration, predict, probes
from stratagem.experimental.planning.layouts import (Layout, balanced_points, cut_units, enumerate_layouts,
                                                     factorizations)
from stratagem.experimental.planning.profile import Profile

NETWORK = Network(alpha=1e-4, beta=1e9)


def _profile(blocks: int = 4, params: float = 1000.0) -> Profile:
    return Profile(names=[str(i) for i in range(blocks)], sequential=True, rows=8,
                   forward=[(1e-4, 1e-4)] * blocks, forward_backward=[(3e-4, 3e-4)] * blocks,
                   activation_bytes=[800.0] * blocks, input_bytes=[80.0] * blocks, output_bytes=[80.0] * blocks,
                   plan_traffic=[[]] * blocks, block_params={1: [params] * blocks, 2: [params] * blocks},
                   total_params=params * blocks, element_size=4, state_per_parameter=8.0,
                   step_seconds_per_parameter=1e-8)


def test_factorizations_cover_every_mesh() -> None:
    assert factorizations(4) == [(4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1)]
    assert factorizations(1) == [(1, 1, 1)]


def test_no_cut_between_a_colwise_layer_and_its_rowwise_partner() -> None:
    names = ["0", "1", "2", "3", "4"]
    assert cut_units(names, {"0": "colwise", "2": "rowwise"}) == [[0, 1, 2], [3], [4]]
    assert balanced_points(names, [1.0] * 5, {"0": "colwise", "2": "rowwise"}, 2) == ("3",)
    assert balanced_points(names, [1.0] * 5, {"0": "colwise", "2": "rowwise"}, 4) is None
    assert balanced_points(names, [4.0, 1.0, 1.0, 1.0, 1.0], None, 2) == ("1",)


def test_enumeration_and_what_it_refuses() -> None:
    layouts, refused = enumerate_layouts(2, names=["0", "1"], sequential=True, costs=[1.0, 1.0], plan=None,
                                         global_batch=6)
    described = {layout.describe() for layout in layouts}
    assert {"2x1x1", "2x1x1 zero-1", "2x1x1 zero-2", "2x1x1 zero-3", "2x1x1 recompute", "1x2x1 1f1b m=2",
            "1x2x1 gpipe m=4 recompute"} <= described
    assert all(layout.split_points == ("1",) for layout in layouts if layout.pipe == 2)
    assert [why for _, why in refused] == ["a model axis needs a tensor-parallel plan (tensor_plan=...)"]
    _, refused = enumerate_layouts(2, names=[""], sequential=False, costs=[1.0], plan={"a": "colwise"},
                                   global_batch=3)
    reasons = {layout.describe(): why for layout, why in refused}
    assert reasons["2x1x1"] == "global_batch=3 does not split over 2 data replicas"
    assert reasons["1x2x1"] == reasons["1x1x2"] == "pipeline and tensor parallelism need an nn.Sequential model"


def test_the_line_that_pins_a_layout() -> None:
    layout = Layout(1, 2, 2, recompute=True, num_microbatches=4, schedule="1f1b", split_points=("3",))
    assert layout.code() == ("sg.experimental.PipelineStrategy({'data': 1, 'pipe': 2, 'model': 2}, "
                             "num_microbatches=4, schedule='1f1b', split_points=['3'], recompute=True, "
                             "plan=tensor_plan, loss_fn=loss_fn)")
    assert Layout(2, 1, 1, sharding="parameters").describe() == "2x1x1 zero-3"


def test_predictions_order_memory_as_the_layouts_trade_it() -> None:
    profile, batch = _profile(), 16
    plain = predict(profile, Layout(2, 1, 1), NETWORK, global_batch=batch)
    zero = {s: predict(profile, Layout(2, 1, 1, sharding=s), NETWORK, global_batch=batch)
            for s in ("optimizer", "gradients", "parameters")}
    assert plain.model_states == 16 * 4000
    assert zero["optimizer"].model_states == zero["gradients"].model_states == 12 * 4000
    assert zero["parameters"].model_states == 8 * 4000
    piped = predict(profile, Layout(1, 2, 1, num_microbatches=2, schedule="1f1b", split_points=("2",)), NETWORK,
                    global_batch=batch)
    assert piped.model_states == 16 * 2000
    gpipe = predict(profile, Layout(1, 2, 1, num_microbatches=4, schedule="gpipe", split_points=("2",)), NETWORK,
                    global_batch=batch)
    # the same layout under 1F1B holds fewer micro-batches on the first stage
    onef = predict(profile, Layout(1, 2, 1, num_microbatches=4, schedule="1f1b", split_points=("2",)), NETWORK,
                   global_batch=batch)
    assert onef.activations < gpipe.activations
    again = predict(profile, Layout(1, 2, 1, recompute=True, num_microbatches=4, schedule="gpipe",
                                    split_points=("2",)), NETWORK, global_batch=batch)
    assert again.activations < gpipe.activations and again.seconds > gpipe.seconds


def test_predicted_time_grows_with_what_the_network_carries() -> None:
    profile = _profile(params=1e6)
    slow, fast = Network(alpha=1e-4, beta=1e8), Network(alpha=1e-4, beta=1e10)
    layout = Layout(2, 1, 1)
    assert predict(profile, layout, slow, global_batch=8).seconds > predict(profile, layout, fast, global_batch=8).seconds
    zero3 = predict(profile, Layout(2, 1, 1, sharding="parameters"), slow, global_batch=8)
    assert zero3.seconds > predict(profile, layout, slow, global_batch=8).seconds
    with pytest.raises(ValueError):
        enumerate_layouts(2, names=["0", "1"], sequential=True, costs=[-1.0, 1.0], plan=None, global_batch=2)


def test_probes_calibrate_their_mesh() -> None:
    plain, zero2 = Layout(2, 1, 1), Layout(2, 1, 1, sharding="gradients")
    piped = Layout(1, 2, 1, num_microbatches=4, schedule="gpipe", split_points=("2",))
    piped_first = Layout(1, 2, 1, num_microbatches=2, schedule="gpipe", split_points=("2",))
    ranked = [zero2, piped, piped_first, plain]
    assert probes(ranked) == [plain, piped_first]   # the plainest of each mesh, whatever the model's ranking
    raw = {zero2: 1.0, plain: 2.0, piped: 4.0, piped_first: 3.0}
    factors = calibration(raw, {plain: {"seconds": 6.0}, piped_first: "RuntimeError: ..."})
    assert factors == {(2, 1, 1): 3.0}   # a probe that failed calibrates nothing
    assert calibrated(raw, factors, zero2) == 3.0 and calibrated(raw, factors, piped) == 12.0
