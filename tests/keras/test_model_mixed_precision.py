"""``sg.Model.compile(..., mixed_precision=...)``: Keras's mixed-precision policies under strategies."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError

from .common import CLASSES, data, make_module, state
from .test_model import Interrupt

pytestmark = pytest.mark.timeout(180)


def build(strategy, policy, optimizer="sgd") -> sg.Model:
    with strategy.scope():
        model = sg.Model(make_module())
        model.compile(optimizer=optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], mixed_precision=policy)
    return model


class DtypeRecorder:
    """A forward hook noting the dtype of the first layer's output on every replica thread."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seen: list[tuple[int, torch.dtype]] = []
        self._lock = threading.Lock()
        module[0].register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        with self._lock:
            self.seen.append((threading.get_ident(), output.dtype))

    def take(self) -> tuple[set[torch.dtype], int]:
        seen, self.seen = self.seen, []
        return {dtype for _, dtype in seen}, len({thread for thread, _ in seen})


def test_fit_mixed_bfloat16_under_mirrored_equals_the_default_strategy() -> None:
    """The tolerance: bfloat16 keeps 8 significant bits (a rounding error of up to 2**-9 = 2e-3
    relative). Each replica computes its half of the batch, so its products and its partial
    weight gradients round differently from the whole batch's: the summed gradient may differ by
    a few such roundings, ~1e-2 of the gradient at most. The 33 SGD steps (lr 0.01, gradient entries
    below 0.5) then move any parameter by at most 33 * 0.01 * 0.5 * 1e-2 = 1.7e-3 apart, and in
    practice (errors of both signs) by 4e-5: 2e-4 leaves room without hiding a real error (one
    replica's gradient lost in one step moves parameters by ~1e-3). That the forward passes
    really ran in bfloat16 on both replicas is checked directly, by a forward hook."""
    x, y, _ = data()
    results = {}
    for name, strategy in (("default", sg.get_strategy()), ("mirrored", sg.MirroredStrategy(["cpu:0", "cpu:1"]))):
        model = build(strategy, "mixed_bfloat16")
        recorder = DtypeRecorder(model.module)
        history = model.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0)
        dtypes, threads = recorder.take()
        assert dtypes == {torch.bfloat16} and threads == strategy.num_replicas_in_sync, name
        assert all(p.dtype == torch.float32 for p in model.module.parameters())
        results[name] = (state(model), history.history["loss"], model)
    (default, default_loss, _), (mirrored, mirrored_loss, model) = results["default"], results["mirrored"]
    np.testing.assert_allclose(mirrored_loss, default_loss, rtol=1e-3)
    for key in default:
        torch.testing.assert_close(mirrored[key], default[key], rtol=0, atol=2e-4)
    float32 = build(sg.get_strategy(), "float32")
    float32.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0)
    assert any(not torch.equal(float32.module.state_dict()[k], default[k]) for k in default)

    recorder = DtypeRecorder(model.module)   # evaluate and predict run under autocast too
    logs = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert np.isfinite(logs["loss"])
    predictions = model.predict(x, batch_size=10)
    assert predictions.dtype == torch.float32 and predictions.shape == (len(x), CLASSES)
    assert recorder.take() == ({torch.bfloat16}, 2)


class ScaleLog(sg.callbacks.Callback):
    """The loss scale and a parameter after every training step."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(self.model.loss_scaler.get_scale())
        self.weights.append(self.model.module[0].weight.detach().clone())


@pytest.mark.parametrize("make", [lambda: sg.get_strategy(), lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"])],
                         ids=["default", "mirrored", "central_storage"])
def test_fit_mixed_float16_skips_a_step_with_an_inf(make) -> None:
    x, y, _ = data(rows=60)
    x[35, 2] = np.inf   # step 3 (batches of 10), the second replica's half
    strategy = make()
    model = build(strategy, "mixed_float16")
    assert isinstance(model.loss_scaler, torch.amp.GradScaler)
    log = ScaleLog()
    recorder = DtypeRecorder(model.module)
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0, callbacks=[log])
    assert recorder.take()[0] == {torch.float16}
    assert log.scales == [2.0 ** 16] * 3 + [2.0 ** 15] * 3
    assert torch.equal(log.weights[3], log.weights[2])   # skipped on every replica
    assert not torch.equal(log.weights[4], log.weights[3])
    assert all(p.dtype == torch.float32 for p in model.module.parameters())
    for copy_ in strategy.experimental_local_results(model.module[0].weight):
        assert torch.equal(copy_, model.module[0].weight)


def test_backup_and_restore_keeps_the_loss_scale(tmp_path: Path) -> None:
    x, y, _ = data(rows=80)
    x[25, 0] = np.inf   # step 1 of every epoch is skipped: the scale halves each time

    def job(callbacks: list) -> sg.Model:
        model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]), "mixed_float16")
        model.fit(x, y, batch_size=20, epochs=3, shuffle=False, callbacks=callbacks, verbose=0)
        return model

    reference = job([])
    backup = lambda: sg.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)   # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        job([backup(), Interrupt(at_step=7)])
    resumed = job([backup()])
    assert resumed.loss_scaler.get_scale() == reference.loss_scaler.get_scale() == 2.0 ** 13
    for key, value in state(reference).items():
        torch.testing.assert_close(state(resumed)[key], value, rtol=0, atol=0)


def test_global_policy_and_names() -> None:
    assert sg.mixed_precision.global_policy() == sg.mixed_precision.Policy("float32")
    try:
        sg.mixed_precision.set_global_policy("mixed_bfloat16")
        model = build(sg.get_strategy(), None)
        assert model.dtype_policy.compute_dtype is torch.bfloat16 and model.loss_scaler is None
        assert build(sg.get_strategy(), "float32").dtype_policy.name == "float32"   # the argument wins
    finally:
        sg.mixed_precision.set_global_policy(None)
    assert build(sg.get_strategy(), None).dtype_policy.name == "float32"
    with pytest.raises(InvalidArgumentError, match=r"module.to\(torch.bfloat16\)"):
        build(sg.get_strategy(), "bfloat16")
    with pytest.raises(InvalidArgumentError, match="'mixed_bfloat16', 'mixed_float16'"):
        sg.mixed_precision.set_global_policy("mixed_float8")


def test_mixed_float16_refused_where_a_grad_scaler_cannot_decide() -> None:
    strategy = sg.MultiWorkerMirroredStrategy(sharding="gradients")
    with pytest.raises(InvalidArgumentError, match="mixed_bfloat16"):
        build(strategy, "mixed_float16", optimizer="adam")
    model = build(strategy, "mixed_bfloat16", optimizer="adam")   # no loss scaling: fine
    x, y, _ = data(rows=20)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
