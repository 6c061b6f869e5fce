"""The callbacks and the sidecar evaluator with ``sg.Model.fit`` / ``evaluate``, end to end."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import stratagem as sg

from .test_callbacks import read_scalars

pytestmark = pytest.mark.timeout(120)


def data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(2))
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]])


def test_fit_with_every_callback_under_mirrored(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        model = sg.Model(torch.nn.Linear(3, 1))
        model.compile(torch.optim.SGD(model.module.parameters(), lr=0.1), "mse", metrics=["mae"])
    rates = []

    class Rates(sg.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rates.append(self.model.optimizer.param_groups[0]["lr"])

    x, y = data()
    callbacks = [
        sg.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1)),
        sg.callbacks.EarlyStopping(monitor="val_mae", min_delta=10.0, patience=2),   # never improves after epoch 0
        sg.callbacks.ModelCheckpoint(tmp_path / "ckpt-{epoch}-{val_loss:.3f}", monitor="val_mae", save_best_only=True),
        sg.callbacks.CSVLogger(tmp_path / "log.csv"),
        sg.callbacks.TensorBoard(tmp_path / "tb"),
        Rates(),
    ]
    history = model.fit(x, y, batch_size=8, epochs=10, validation_data=data(16), callbacks=callbacks, verbose=0)
    assert history.epoch == [0, 1, 2] and model.stop_training
    assert rates == pytest.approx([0.05, 0.025, 0.05 / 3])
    assert history.history["lr"] == pytest.approx(rates)
    best, improved = float("inf"), []
    for epoch, (mae, loss) in enumerate(zip(history.history["val_mae"], history.history["val_loss"])):
        if mae < best:
            best = mae
            improved.append(f"ckpt-{epoch + 1}-{loss:.3f}")
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == sorted(improved)
    rows = list(csv.DictReader((tmp_path / "log.csv").open()))
    assert [float(row["val_mae"]) for row in rows] == pytest.approx(history.history["val_mae"])
    train, validation = read_scalars(tmp_path / "tb" / "train"), read_scalars(tmp_path / "tb" / "validation")
    assert [v for _, v in train["epoch_loss"]] == pytest.approx(history.history["loss"])
    assert [v for _, v in validation["epoch_mae"]] == pytest.approx(history.history["val_mae"])
    assert [v for _, v in train["epoch_learning_rate"]] == pytest.approx(rates)
    speeds = [v for _, v in train["epoch_samples_per_second"]]   # fit tells the callbacks its batch size
    assert len(speeds) == 3 and all(v > 0 for v in speeds)
    # the step clock's medians per worker (one here): 4 steps an epoch, each of the 3 epochs
    assert [len(train[f"epoch_{name}/worker_0"]) for name in ("step_seconds", "exchange_seconds", "exchange_bytes",
                                                                 "collective_wait_seconds", "input_wait_seconds")] == [3] * 5
    assert all(0 < v < 10 for _, v in train["epoch_step_seconds/worker_0"])


def test_sidecar_evaluates_a_compiled_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    x, y = data()
    torch.manual_seed(0)
    trained = sg.Model(torch.nn.Linear(3, 1))
    trained.compile("sgd", "mse", metrics=["mae"])
    manager = sg.CheckpointManager(sg.Checkpoint(model=trained.module), tmp_path)
    expected = {}
    for number in (1, 2):
        trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
        manager.save()
        expected[number] = trained.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    manager.mark_training_finished()

    evaluator = sg.Model(torch.nn.Linear(3, 1))
    evaluator.compile("sgd", "mse", metrics=["mae"])
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    results = sg.SidecarEvaluator(evaluator, batches, tmp_path).start()
    assert results.keys() == expected.keys()
    for number in expected:
        assert results[number] == pytest.approx(expected[number])
    assert "SidecarEvaluator: evaluated ckpt-2: loss=" in capsys.readouterr().out


def test_backup_and_restore_given_to_a_second_fit_trains_again(tmp_path: Path) -> None:
    # Keras: the first fit deletes its backup at the end, so the second starts at epoch 0 (it trained none)
    model = sg.Model(torch.nn.Linear(4, 1))
    model.compile("sgd", "mse")
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    callbacks = [sg.callbacks.BackupAndRestore(tmp_path / "backup")]
    assert len(model.fit(x, y, epochs=2, verbose=0, callbacks=callbacks).history["loss"]) == 2
    assert len(model.fit(x, y, epochs=2, verbose=0, callbacks=callbacks).history["loss"]) == 2
    # a backup kept (delete_checkpoint=False) is resumed from, as Keras does: its epochs are done
    kept = [sg.callbacks.BackupAndRestore(tmp_path / "kept", delete_checkpoint=False)]
    model.fit(x, y, epochs=2, verbose=0, callbacks=kept)
    assert len(model.fit(x, y, epochs=3, verbose=0, callbacks=kept).history["loss"]) == 1   # the third only
