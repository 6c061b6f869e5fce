"""What TensorFlow's tutorials write works by renaming: losses' ``reduction=``, callable
metrics, ``steps_per_execution`` / ``jit_compile``, ``LambdaCallback``, ``sg.latest_checkpoint``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.errors import InvalidArgumentError

from .common import build, data, make_module, state

LABELS, LOGITS = torch.tensor([0, 2, 1, 1]), torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3],
                                                          [1.0, -1.0, 0.0], [0.0, 3.0, 0.0]])
WEIGHTS = torch.tensor([1.0, 0.5, 2.0, 0.0])


@pytest.mark.parametrize("reduction, expected", [
    (sg.losses.Reduction.NONE, lambda v, w: v * w),
    (None, lambda v, w: v * w),
    (sg.losses.Reduction.SUM, lambda v, w: (v * w).sum()),
    (sg.losses.Reduction.SUM_OVER_BATCH_SIZE, lambda v, w: (v * w).sum() / 4),
    (sg.losses.Reduction.AUTO, lambda v, w: (v * w).sum() / 4),
    ("mean_with_sample_weight", lambda v, w: (v * w).sum() / w.sum()),
])
def test_loss_reductions_are_keras_s(reduction, expected) -> None:
    values = F.cross_entropy(LOGITS, LABELS, reduction="none")
    loss = sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    torch.testing.assert_close(loss(LABELS, LOGITS, sample_weight=WEIGHTS), expected(values, WEIGHTS))
    # Keras's default is the batch mean
    torch.testing.assert_close(sg.losses.SparseCategoricalCrossentropy(from_logits=True)(LABELS, LOGITS),
                               values.mean())


def test_loss_arguments_are_checked_naming_the_public_class() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown loss reduction 'average'.*'none'.*SUM_OVER"):
        sg.losses.CategoricalCrossentropy(reduction="average")
    with pytest.raises(TypeError, match=r"sg.losses.SparseCategoricalCrossentropy\(\) got unexpected .*label_smooth"):
        sg.losses.SparseCategoricalCrossentropy(from_logits=True, label_smooth=0.1)
    with pytest.raises(TypeError, match=r"sg.losses.MeanSquaredError\(\) .* it takes reduction, name"):
        sg.losses.MeanSquaredError(from_logits=True)


def test_compile_uses_per_example_losses_whatever_the_reduction() -> None:
    x, y, _ = data()
    trained = []
    for reduction in ("none", "sum", "sum_over_batch_size"):
        model = sg.Model(make_module())
        model.compile("sgd", sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
        trained.append(state(model))
    for other in trained[1:]:
        for name in trained[0]:
            torch.testing.assert_close(other[name], trained[0][name], rtol=0, atol=0)


def test_compile_s_loss_names_weight_examples_and_shape_targets_as_keras() -> None:
    # TensorFlow's parameter-server tutorial: Dense(10), loss="mse", targets of shape (N,). Keras's compile
    # pairs each example's target with all its outputs; "mse" is per example, so sample_weight applies
    x, y, w = torch.rand(12, 10), torch.rand(12), torch.rand(12)
    module = torch.nn.Linear(10, 10)
    expected = ((module(x) - y[:, None]) ** 2).mean(dim=1)
    for loss in ("mse", sg.losses.MeanSquaredError()):
        torch.testing.assert_close(sg.losses.get(loss)(y, module(x)), expected)
    torch.testing.assert_close(sg.losses.get("mse")(y[:10], module(x[:10])), expected[:10])   # N == k too
    model = sg.Model(module)
    model.compile("sgd", "mse")
    model.fit(x, y, sample_weight=w, batch_size=5, epochs=1, verbose=0)   # weights, uneven batches: no error


def test_a_metric_called_updates_and_returns_the_value_so_far_on_every_replica() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        accuracy = sg.metrics.SparseCategoricalAccuracy()
    batches = [(LABELS, LOGITS), (LABELS[:2], LOGITS[:2])]
    seen = []

    def step(batch):
        value = accuracy(*batch)
        seen.append(value.item())
        return value

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(batch,))
    # every replica gets the global value so far: 3 of 4 right, then 5 of 6
    assert seen == pytest.approx([0.75, 0.75, 5 / 6, 5 / 6])
    mean = sg.metrics.Mean()
    assert mean(torch.tensor([1.0, 3.0])).item() == 2.0 and mean(torch.tensor([5.0])).item() == 3.0


def test_steps_per_execution_trains_the_same_model_and_calls_batch_hooks_per_execution() -> None:
    x, y, w = data()
    trained, hooks = [], []
    for every in (1, 4):
        seen = []
        hook = sg.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(("begin", b)),
                                           on_train_batch_end=lambda b, logs: seen.append(("end", b)))
        model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
        model.compile(model.optimizer, sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=every)
        torch.manual_seed(3)
        model.fit(x, y, sample_weight=w, batch_size=10, epochs=2, verbose=0, callbacks=[hook])
        trained.append(state(model))
        hooks.append(seen)
    for name in trained[0]:
        torch.testing.assert_close(trained[1][name], trained[0][name], rtol=0, atol=0)
    # 103 rows in batches of 10: 11 steps an epoch; groups of 4 end at steps 3, 7 and 10
    epoch = [("begin", 0), ("end", 3), ("begin", 4), ("end", 7), ("begin", 8), ("end", 10)]
    assert hooks[1] == epoch * 2
    assert len(hooks[0]) == 2 * 2 * 11


def test_compile_options_are_checked() -> None:
    model = sg.Model(make_module())
    with pytest.raises(InvalidArgumentError, match="steps_per_execution"):
        model.compile("sgd", "mse", steps_per_execution=0)
    with pytest.raises(InvalidArgumentError, match="jit_compile must be True, False, None or 'auto'"):
        model.compile("sgd", "mse", jit_compile="yes")
    with pytest.raises(InvalidArgumentError, match="no hook 'on_epoch_finish'"):
        sg.callbacks.LambdaCallback(on_epoch_finish=print)


@pytest.mark.timeout(300)
def test_jit_compile_runs_the_forward_through_torch_compile_with_the_same_result() -> None:
    x, y, _ = data()
    trained = []
    for jit in (False, True):
        model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]), optimizer="sgd")
        model.compile(model.optimizer, sg.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
        trained.append(state(model))
    for name in trained[0]:
        torch.testing.assert_close(trained[1][name], trained[0][name], rtol=1e-5, atol=1e-6)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path: Path) -> None:
    assert sg.latest_checkpoint(tmp_path) is None and sg.latest_checkpoint(tmp_path / "missing") is None
    model = torch.nn.Linear(2, 2)
    ckpt = sg.Checkpoint(model=model, step=0)
    manager = sg.CheckpointManager(ckpt, tmp_path)
    for step in (1, 2):
        ckpt.step = step
        manager.save()
    assert sg.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    (tmp_path / "ckpt-3.tmp-1234").mkdir()               # a write a crash left behind
    (tmp_path / "ckpt-4").mkdir()                          # not a checkpoint (no manifest)
    assert sg.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    ckpt.step = 7
    ckpt.save(os.path.join(tmp_path, "ckpt"))               # the custom-loop tutorial's prefix
    ckpt.step = 0
    ckpt.restore(sg.latest_checkpoint(tmp_path))
    assert ckpt.step == 7
