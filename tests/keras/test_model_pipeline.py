"""sg.Model under PipelineStrategy in one process (every stage here): equal to the default strategy.

The multi-process runs (1 x 2 and 2 x 2 meshes, BackupAndRestore, ModelCheckpoint, progress from the
chief only) are in tests/placement/layout/test_multi_worker_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def solo_group():
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)).double()


def run(strategy, metrics, sample_weight, loss) -> tuple:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(23, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (23,), generator=g)
    with strategy.scope():
        model = sg.Model(make_model())
        model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9), loss=loss,
                      metrics=metrics)
    history = model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0, sample_weight=sample_weight,
                        validation_data=(x[:9], y[:9]))
    return (history.history, model.module.state_dict(), model.evaluate(x, y, batch_size=5, verbose=0, return_dict=True),
            model.predict(x, batch_size=6))


@pytest.mark.parametrize("metrics", [["accuracy"], None])
def test_fit_evaluate_predict_equal_the_default_strategy(metrics, solo_group) -> None:
    weights = torch.rand(23, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    strategy = sg.experimental.PipelineStrategy(num_microbatches=3, schedule="zero_bubble")   # 2 stages
    for sample_weight in (None, weights):
        loss = sg.losses.SparseCategoricalCrossentropy(from_logits=True)
        want = run(sg.get_strategy(), metrics, sample_weight, loss)
        got = run(strategy, metrics, sample_weight, loss)
        assert got[0].keys() == want[0].keys()
        for key, values in want[0].items():
            assert got[0][key] == pytest.approx(values, rel=1e-12), key
        for name, value in want[1].items():
            torch.testing.assert_close(got[1][name], value, rtol=1e-12, atol=1e-12)
        assert got[2] == pytest.approx(want[2], rel=1e-12)
        torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)


def test_a_loss_that_gives_the_batch_mean_and_the_outputs_of_forward_backward(solo_group) -> None:
    strategy = sg.experimental.PipelineStrategy(num_microbatches=3, schedule="interleaved")

    def mean_loss(y_true, y_pred):   # Keras's order; one number: the mean of the rows given
        return nn.functional.cross_entropy(y_pred, y_true)
    want = run(sg.get_strategy(), None, None, mean_loss)
    got = run(strategy, None, None, mean_loss)
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=1e-12, atol=1e-12)
    with strategy.scope():
        model = make_model()
    x = torch.randn(7, 4, dtype=torch.float64)   # 7 rows in 3 micro-batches: padded
    loss, outputs = strategy.forward_backward(model, x, torch.zeros(7, 3, dtype=torch.float64),
                                              loss_fn=nn.functional.mse_loss, return_outputs=True)
    plain = make_model()
    torch.testing.assert_close(outputs, plain(x).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, (plain(x) ** 2).mean().detach(), rtol=1e-12, atol=1e-12)


class Halves(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :1], x[:, 1:]


def test_outputs_of_a_model_that_returns_a_tuple(solo_group) -> None:
    strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="gpipe")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), Halves()).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    _, (first, rest) = strategy.forward_backward(model, x, loss_fn=lambda out: out[0].mean() + out[1].mean(),
                                                 return_outputs=True)
    want = model[0](x)
    torch.testing.assert_close(first, want[:, :1].detach())
    torch.testing.assert_close(rest, want[:, 1:].detach())


def test_misuse_is_refused_clearly(solo_group) -> None:
    strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="gpipe")
    with strategy.scope():
        model = sg.Model(make_model())
        model.compile(optimizer="sgd", loss=lambda y_true, y_pred: ((y_pred - y_true) ** 2).mean())
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="training needs targets"):
        model.fit([(x,)], verbose=0)   # batches without targets
    with pytest.raises(InvalidArgumentError, match="sample_weight cannot weight"):
        model.fit(x, y, batch_size=4, verbose=0, sample_weight=torch.ones(8))
    with pytest.raises(InvalidArgumentError, match="batch size"):
        model.fit([(x, y[:7])], verbose=0)
