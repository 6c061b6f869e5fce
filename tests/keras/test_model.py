"""sg.Model in one process: equivalence across strategies, inputs, predict order, errors, callbacks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.keras.model import NotCompiledError
from stratagem.keras.progress import ProgressLogger

from .common import build, data, fit, make_module, state

pytestmark = pytest.mark.timeout(120)


def assert_same(a: dict, b: dict) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=2e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference() -> tuple[dict, dict]:
    model, history = fit(sg.get_strategy())
    return state(model), history.history


@pytest.mark.parametrize("make", [lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
                                  lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: sg.OneDeviceStrategy("cpu")], ids=["mirrored3", "mirrored2", "one_device"])
def test_fit_equals_the_default_strategy(make, reference) -> None:
    # shuffled, sample-weighted, Adam, last batches of 3 rows (1/1/1 over 3 replicas) and 1 row
    model, history = fit(make())
    assert_same(state(model), reference[0])
    for name, values in reference[1].items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name


def test_metrics_and_predict_are_global_and_in_input_order() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    x, y, w = data()
    model = build(strategy)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    predicted = model.predict(x, batch_size=10)   # last batch: 3 rows, one per replica
    with torch.no_grad():
        expected = model.module(torch.from_numpy(x))
    assert predicted.shape == (len(x), 3)
    torch.testing.assert_close(predicted, expected)
    logs = model.evaluate(x, y, batch_size=7, sample_weight=w, verbose=0, return_dict=True)
    per_example = torch.nn.functional.cross_entropy(expected, torch.from_numpy(y), reduction="none")
    weights = torch.from_numpy(w)
    accuracy = ((expected.argmax(1) == torch.from_numpy(y)).float() * weights).sum() / weights.sum()
    assert logs["loss"] == pytest.approx(float((per_example * weights).mean()), rel=1e-5)
    assert logs["accuracy"] == pytest.approx(float(accuracy), rel=1e-5)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(list(model.evaluate(x, y, verbose=0, return_dict=True)
                                                                 .values()))


def test_dataloader_and_iterable_inputs_train_like_arrays() -> None:
    x, y, w = data()
    tensors = [torch.from_numpy(a) for a in (x, y, w)]
    arrays = build(sg.get_strategy(), optimizer="sgd")
    arrays.fit(x, y, sample_weight=w, batch_size=20, epochs=2, shuffle=False, verbose=0)
    loader = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]), optimizer="sgd")
    loader.fit(DataLoader(TensorDataset(*tensors), batch_size=20), epochs=2, verbose=0)
    batches = [tuple(t[i:i + 20] for t in tensors) for i in range(0, len(x), 20)]
    iterable = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]), optimizer="sgd")
    iterable.fit(batches, epochs=2, verbose=0)
    assert_same(state(loader), state(arrays))
    assert_same(state(iterable), state(arrays))
    steps = build(sg.get_strategy(), optimizer="sgd")
    history = steps.fit(batches, epochs=2, steps_per_epoch=4, verbose=0)   # 8 steps over 6 batches
    assert len(history.history["loss"]) == 2
    # an epoch that ends where a pass ends: the next epoch starts a new pass (it raised "no batches")
    whole = build(sg.get_strategy(), optimizer="sgd")
    history = whole.fit(batches, epochs=3, steps_per_epoch=len(batches), shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 3
    passes = build(sg.get_strategy(), optimizer="sgd")
    passes.fit(batches, epochs=3, verbose=0)
    assert_same(state(whole), state(passes))


def test_loss_names_objects_and_callables_agree() -> None:
    x, y, _ = data()
    results = []
    for loss in ["sparse_categorical_crossentropy", torch.nn.CrossEntropyLoss(), torch.nn.functional.cross_entropy,
                 lambda y_true, y_pred: torch.nn.functional.cross_entropy(y_pred, y_true)]:
        with sg.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
            model = sg.Model(torch.nn.Sequential(make_module(), torch.nn.Softmax(dim=1))
                             if isinstance(loss, str) else make_module())
            model.compile("sgd", loss)
        torch.manual_seed(1)
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
        results.append(state(model))
    for other in results[1:]:
        assert_same({k[2:]: v for k, v in results[0].items()}, other)   # "0." prefix of the Sequential


def test_logits_given_to_a_probability_loss_is_a_clear_error() -> None:
    x, y, _ = data()
    model = sg.Model(make_module())
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="from_logits=True"):
        model.fit(x, y, verbose=0)


def test_clear_errors() -> None:
    x, y, _ = data()
    model = sg.Model(make_module())
    with pytest.raises(NotCompiledError, match="call model.compile"):
        model.fit(x, y)
    with pytest.raises(NotCompiledError, match="call model.compile"):
        model.evaluate(x, y)
    with pytest.raises(ValueError, match="unknown loss 'msqe'"):
        model.compile("sgd", "msqe")
    with pytest.raises(ValueError, match="unknown optimizer 'adamax'"):
        model.compile("adamax", "mse")
    with pytest.raises(ValueError, match="precision"):
        model.compile("sgd", "mse", metrics=["precision"])
    with pytest.raises(NotCompiledError):   # a failed compile leaves the model uncompiled
        model.fit(x, y)
    model.compile("sgd", sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="same number of rows, got x 103, y 100"):
        model.fit(x, y[:100])
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=8)
    with pytest.raises(ValueError, match="batch_size=8 was given with the DataLoader"):
        model.fit(loader, batch_size=8)
    with pytest.raises(ValueError, match="validation_split works with tensor"):
        model.fit(loader, validation_split=0.2)
    with pytest.raises(ValueError, match="verbose must be"):
        model.fit(x, y, verbose=3)
    with pytest.raises(ValueError, match="epochs must be an int"):
        model.fit(x, y, epochs=0)
    outside = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not created in the scope"):
        sg.Model(outside, strategy=sg.MirroredStrategy(["cpu:0", "cpu:1"]))


def test_the_strategy_declares_how_fit_runs() -> None:
    # sg.Model.fit picks its loop by Strategy.model_fit_loop_kind (the parameter-server strategy's
    # coordinator loop: tests/ps/test_fit_loop.py); a kind it does not know is a clear error
    class Unknown(sg.OneDeviceStrategy):
        model_fit_loop_kind = "asynchronous"

    assert (sg.Strategy.model_fit_loop_kind, sg.ParameterServerStrategy.model_fit_loop_kind) == \
        ("replicated", "scheduled")
    x, y, _ = data()
    with pytest.raises(ValueError, match="Unknown.model_fit_loop_kind is 'asynchronous'; sg.Model knows "
                                         "'replicated' and 'scheduled'"):
        build(Unknown("cpu")).fit(x, y, verbose=0)


class Recorder(sg.callbacks.Callback):
    def __init__(self, stop_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.calls: list = []
        self.stop_at = stop_at

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin", self.params["epochs"], self.params["steps"]))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, sorted(logs)))
        if self.stop_at == (len([c for c in self.calls if c[0] == "epoch_begin"]) - 1, batch):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, sorted(logs)))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


def test_callback_order_logs_and_stop_training() -> None:
    x, y, _ = data(rows=30)
    model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
    recorder = Recorder()
    history = model.fit(x, y, batch_size=10, epochs=2, validation_split=0.2, callbacks=[recorder], verbose=0)
    names = ["accuracy", "loss"]
    assert recorder.calls == [("train_begin", 2, 3), ("epoch_begin", 0), ("batch_end", 0, names),
                              ("batch_end", 1, names), ("batch_end", 2, names), ("test_begin",),
                              ("epoch_end", 0, names + ["val_accuracy", "val_loss"]), ("epoch_begin", 1),
                              ("batch_end", 0, names), ("batch_end", 1, names), ("batch_end", 2, names),
                              ("test_begin",), ("epoch_end", 1, names + ["val_accuracy", "val_loss"]),
                              ("train_end",)]
    assert model.history is history and history.epoch == [0, 1]
    stopper = Recorder(stop_at=(1, 0))
    model.fit(x, y, batch_size=10, epochs=5, callbacks=[stopper], verbose=0)
    assert [c[0] for c in stopper.calls].count("batch_end") == 4 and stopper.calls[-2][:2] == ("epoch_end", 1)


class Interrupt(sg.callbacks.Callback):
    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step, self.steps = at_step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at_step:
            raise KeyboardInterrupt("killed on purpose")


@pytest.mark.parametrize("steps_per_epoch", [None, 7, 5])
def test_backup_and_restore_resumes_an_interrupted_fit_exactly(tmp_path: Path, steps_per_epoch: int | None) -> None:
    # steps_per_epoch: 7 ends each epoch with a pass over the input, 5 reads on across epochs; the resumed
    # epoch takes only the rest of its steps (it took steps_per_epoch more, and ended elsewhere)
    x, y, w = data()

    def job(callbacks: list) -> sg.Model:
        model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
        torch.manual_seed(5)
        model.fit(x, y, sample_weight=w, batch_size=16, epochs=3, steps_per_epoch=steps_per_epoch,
                  callbacks=callbacks, verbose=0)
        return model

    reference = job([])
    backup = lambda: sg.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=4)   # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        job([backup(), Interrupt(at_step=10)])   # 7 (5) steps per epoch: killed in epoch 1, backup after step 8
    torch.manual_seed(999)   # the restart's own random state: the backup restores the saved one
    resumed = job([backup()])
    assert_same(state(resumed), state(reference))
    assert not list((tmp_path / "backup").iterdir())   # deleted at the end of training


def test_progress_forms(capsys: pytest.CaptureFixture[str]) -> None:
    x, y, _ = data(rows=40)
    model = build(sg.get_strategy())
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    assert capsys.readouterr().out == ""
    model.fit(x, y, batch_size=10, epochs=2, verbose=1)    # not a terminal: one line per epoch
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("Epoch 2/2 4/4 steps (100%) loss: "), lines
    assert " - accuracy: " in lines[1] and "samples/s" in lines[1] and "\r" not in lines[1]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    progress = ProgressLogger(1, file=terminal)
    progress.begin(3, "Epoch 1/1")
    for _ in range(3):
        progress.step(10, {"loss": 0.5})
    progress.end({"loss": 0.25, "val_loss": 0.5})
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert "loss: 0.2500 - val_loss: 0.5000" in terminal.getvalue()
    quiet = ProgressLogger(1, chief=False, file=terminal)
    quiet.begin(3, "x")
    assert not quiet.enabled


def test_predict_without_compile_and_numpy_outputs_shape() -> None:
    model = sg.Model(make_module())
    out = model.predict(np.zeros((5, 5), dtype=np.float32), batch_size=2)
    assert out.shape == (5, 3)


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_module()

    def forward(self, x):
        out = self.body(x)
        return {"logits": out, "first": out[:, :1]}


def test_predict_keeps_a_structured_output() -> None:
    x, _, _ = data()
    with sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).scope():
        model = sg.Model(TwoHeads())
    out = model.predict(x, batch_size=10)
    with torch.no_grad():
        expected = model.module(torch.from_numpy(x))
    assert sorted(out) == ["first", "logits"] and out["logits"].shape == (len(x), 3)
    torch.testing.assert_close(out["logits"], expected["logits"])
    torch.testing.assert_close(out["first"], expected["first"])
