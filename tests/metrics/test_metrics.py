"""sg.metrics in one process: every metric equals the metric computed on all predictions at
once, under the default, one-device and mirrored strategies (3 replicas, uneven last batch)."""

from __future__ import annotations

import pytest
import torch
import torchmetrics

import stratagem as sg
from stratagem.errors import ContextError, InvalidArgumentError
from . import oracle

pytestmark = pytest.mark.timeout(120)


def run_steps(strategy, metrics, data, batch_size):
    dataset = strategy.experimental_distribute_dataset(oracle.batches(data, batch_size))
    for batch in dataset:
        strategy.run(oracle.update, args=(metrics, batch))


def test_default_strategy_outside_any_scope():
    data = oracle.make_data(23)
    metrics = oracle.make_metrics()
    for batch in oracle.batches(data, 8):
        oracle.update(metrics, batch)
    oracle.check(metrics, data)


def test_one_device_strategy():
    strategy = sg.OneDeviceStrategy("cpu")
    data = oracle.make_data(23)
    with strategy.scope():
        metrics = oracle.make_metrics()
    run_steps(strategy, metrics, data, 8)
    with strategy.scope():
        oracle.check(metrics, data)


@pytest.mark.parametrize("rows", [23, 22])   # last batch of 2 (one replica gets no row) or of 1 rows... 
def test_mirrored_three_replicas_uneven_last_batch(rows):
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    data = oracle.make_data(rows, seed=rows)
    with strategy.scope():
        metrics = oracle.make_metrics()
    run_steps(strategy, metrics, data, 7)
    oracle.check(metrics, data)   # outside the scope: also the global value
    with strategy.scope():
        oracle.check(metrics, data, together=True)


def test_updates_in_and_outside_run_add_up_and_reset_state_forgets_them():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    data = oracle.make_data(16, seed=3)
    with strategy.scope():
        metrics = oracle.make_metrics()
        run_steps(strategy, metrics, {k: v[:10] for k, v in data.items()}, 5)
        oracle.update(metrics, {k: v[10:] for k, v in data.items()})   # cross-replica context
    oracle.check(metrics, data)
    for metric in metrics.values():
        metric.reset_state()
    assert metrics["mean"].result().item() == 0.0 and metrics["sparse"].result().item() == 0.0
    fresh = oracle.make_data(9, seed=4)
    run_steps(strategy, metrics, fresh, 4)
    oracle.check(metrics, fresh)


def test_result_inside_run_is_refused_with_several_replicas_and_local_with_one():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mean = sg.metrics.Mean()
    with pytest.raises(ContextError, match="outside run"):
        strategy.run(mean.result)
    single = sg.OneDeviceStrategy("cpu")
    with single.scope():
        one = sg.metrics.Mean()
    single.run(lambda: one.update_state(torch.tensor([2.0, 4.0])))
    assert single.run(one.result).item() == 3.0


def test_metric_created_outside_the_scope_is_refused_in_a_multi_replica_run():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    mean = sg.metrics.Mean()
    with pytest.raises(ContextError, match="strategy.scope"):
        strategy.run(lambda: mean.update_state(torch.ones(2)))


def test_a_metric_created_inside_run_is_refused():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ContextError, match="inside strategy.run"):
        strategy.run(lambda: sg.metrics.Mean())


def test_get_resolves_names_like_keras_and_refuses_unknown_ones():
    m = sg.metrics
    assert type(m.get("accuracy", loss="sparse_categorical_crossentropy")) is m.SparseCategoricalAccuracy
    assert type(m.get("acc", loss=torch.nn.CrossEntropyLoss())) is m.SparseCategoricalAccuracy
    assert type(m.get("accuracy", loss="categorical_crossentropy")) is m.CategoricalAccuracy
    binary = m.get("accuracy", loss="binary_crossentropy")
    assert type(binary) is m.BinaryAccuracy and binary.threshold == 0.5 and binary.name == "accuracy"
    assert m.get("accuracy", loss=torch.nn.BCEWithLogitsLoss()).threshold == 0.0
    assert m.get("acc", loss=torch.nn.functional.binary_cross_entropy_with_logits).threshold == 0.0
    assert type(m.get("acc", loss=torch.nn.functional.cross_entropy)) is m.SparseCategoricalAccuracy
    for name, kind in [("sparse_categorical_accuracy", m.SparseCategoricalAccuracy), ("mae", m.MeanAbsoluteError),
                       ("mse", m.MeanSquaredError), ("auc", m.AUC), ("mean", m.Mean),
                       ("binary_accuracy", m.BinaryAccuracy), ("categorical_accuracy", m.CategoricalAccuracy)]:
        metric = m.get(name)
        assert type(metric) is kind and metric.name == name
    given = m.Mean()
    assert m.get(given) is given
    wrapped = m.get(torchmetrics.MeanSquaredError())
    assert isinstance(wrapped, m.TorchMetric) and wrapped.name == "mean_squared_error"
    with pytest.raises(InvalidArgumentError, match="known names: acc, accuracy, auc") as error:
        m.get("accurracy")
    assert isinstance(error.value, ValueError)


def test_accuracy_without_a_loss_follows_the_shapes():
    acc = sg.metrics.get("accuracy")
    acc.update_state(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.9], [0.7]]))      # binary: 1 of 2
    acc.update_state(torch.tensor([2, 0]), torch.tensor([[0.0, 0.1, 0.9], [0.0, 1.0, 0.0]]))  # sparse: 1 of 2
    acc.update_state(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.2, 0.8], [0.3, 0.7]]))  # one-hot
    acc.update_state(torch.tensor([3, 1]), torch.tensor([3, 2]))   # predicted classes: 1 of 2
    assert acc.result().item() == 4 / 8


def test_a_torchmetrics_instance_is_copied_not_shared():
    given = torchmetrics.SumMetric()
    given.update(torch.tensor(5.0))
    metric = sg.metrics.get(given)
    metric.update_state(None, torch.tensor([1.0, 2.0]))
    assert metric.result().item() == 3.0 and given.compute().item() == 5.0


def test_a_metric_does_not_pickle_but_deep_copies():
    import copy
    import pickle
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mean = sg.metrics.Mean()
    strategy.run(lambda: mean.update_state(torch.tensor([1.0, 2.0])))   # on each replica
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(mean)
    clone = copy.deepcopy(mean)
    clone.update_state(torch.tensor(6.0))
    assert mean.result().item() == 1.5 and abs(clone.result().item() - 12 / 5) < 1e-6 and clone.strategy is strategy


def test_every_declared_reduction_of_torchmetrics_states_combines_like_all_rows_at_once():
    # max, min, sum, cat (a list state), and a callable reduction: MaxMetric, MinMetric, SumMetric,
    # CatMetric, and a metric with a tensor state reduced by cat
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    values = torch.randn(11)
    with strategy.scope():
        metrics = {"max": sg.metrics.get(torchmetrics.MaxMetric()), "min": sg.metrics.get(torchmetrics.MinMetric()),
                   "sum": sg.metrics.get(torchmetrics.SumMetric()), "cat": sg.metrics.get(torchmetrics.CatMetric()),
                   "pearson": sg.metrics.get(torchmetrics.PearsonCorrCoef())}
    data = strategy.experimental_distribute_dataset([values[:7], values[7:]])   # 3/2/2, then 2/0... rows
    targets = strategy.experimental_distribute_dataset([values[:7].square(), values[7:].square()])
    for x, t in zip(data, targets):
        def step(x, t):
            for name in ("max", "min", "sum", "cat"):
                metrics[name].update_state(None, x)
            metrics["pearson"].update_state(t, x)
        strategy.run(step, args=(x, t))
    torch.testing.assert_close(metrics["max"].result(), values.max())
    torch.testing.assert_close(metrics["min"].result(), values.min())
    torch.testing.assert_close(metrics["sum"].result(), values.sum())
    torch.testing.assert_close(metrics["cat"].result().sort().values, values.sort().values)
    torch.testing.assert_close(metrics["pearson"].result(), torchmetrics.PearsonCorrCoef()(values, values.square()),
                               rtol=1e-4, atol=1e-5)
