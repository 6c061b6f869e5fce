"""The Keras callbacks in one process: driven through their hooks by a small loop, with a
plain object standing for the model (the attributes ``fit`` gives callbacks)."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stratagem as sg
from stratagem.callbacks.monitor import Monitor

pytestmark = pytest.mark.timeout(120)


def fake_model(strategy=None, lr: float = 0.1) -> SimpleNamespace:
    strategy = strategy or sg.get_strategy()
    with strategy.scope():
        torch.manual_seed(0)
        module = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    return SimpleNamespace(module=module, optimizer=optimizer, strategy=strategy, stop_training=False)


def drive(callbacks, model, epoch_logs, steps=2, params=None) -> int:
    """A Keras-style loop over the given per-epoch logs; returns the epochs run."""
    for callback in callbacks:
        callback.set_model(model)
        callback.set_params({"epochs": len(epoch_logs), "steps": steps, "verbose": 0, **(params or {})})
    for callback in callbacks:
        callback.on_train_begin()
    run = 0
    for epoch, logs in enumerate(epoch_logs):
        for callback in callbacks:
            callback.on_epoch_begin(epoch)
        for batch in range(steps):
            with torch.no_grad():
                for p in model.module.parameters():
                    p.add_(0.5)   # each step changes the weights, so saved states differ
            for callback in callbacks:
                callback.on_train_batch_end(batch, {"loss": logs.get("loss", 0.0)})
        logs = dict(logs)
        for callback in callbacks:
            callback.on_epoch_end(epoch, logs)
        run += 1
        if model.stop_training:
            break
    for callback in callbacks:
        callback.on_train_end()
    return run


def test_the_package_keeps_its_old_names() -> None:
    from stratagem.callbacks import BackupAndRestore, Callback
    from stratagem.callbacks.base import Callback as Base
    assert Callback is Base and issubclass(BackupAndRestore, Callback)
    assert all(issubclass(getattr(sg.callbacks, name), Callback) for name in sg.callbacks.__all__)
    hooks = [name for name in vars(Callback) if name.startswith("on_")]
    assert len(hooks) == 14   # Keras's train, test and predict hooks


def test_which_callbacks_read_the_step_logs(tmp_path: Path) -> None:
    """Across workers step logs cost a collective: fit makes them only for callbacks that read them."""
    class Reads(sg.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    reads = [sg.callbacks.ModelCheckpoint(tmp_path, save_freq=5), sg.callbacks.TensorBoard(tmp_path, update_freq=2),
             Reads()]
    only_count = [sg.callbacks.ModelCheckpoint(tmp_path), sg.callbacks.TensorBoard(tmp_path),
                  sg.callbacks.BackupAndRestore(tmp_path, save_freq=3), sg.callbacks.EarlyStopping(),
                  sg.callbacks.CSVLogger(tmp_path / "log.csv"), sg.callbacks.Callback()]
    assert [c.reads_train_batch_logs() for c in reads] == [True] * 3
    assert [c.reads_train_batch_logs() for c in only_count] == [False] * 6


# ---------------------------------------------------------------- ModelCheckpoint

def test_model_checkpoint_names_files_from_logs_and_saves_what_restores(tmp_path: Path) -> None:
    model = fake_model()
    saver = sg.callbacks.ModelCheckpoint(tmp_path / "ep{epoch:02d}-{val_loss:.2f}")
    drive([saver], model, [{"val_loss": 0.5}, {"val_loss": torch.tensor(0.25)}])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["ep01-0.50", "ep02-0.25"]
    assert saver.last_saved == str(tmp_path / "ep02-0.25")
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    fresh = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    sg.Checkpoint(model=fresh, optimizer=optimizer).restore(saver.last_saved)
    torch.testing.assert_close(fresh.state_dict(), saved)


@pytest.mark.parametrize("monitor,values,kept", [
    ("val_loss", [0.5, 0.7, 0.3, 0.3], ["best-1", "best-3"]),
    ("val_accuracy", [0.5, 0.7, 0.3, 0.9], ["best-1", "best-2", "best-4"]),   # mode auto: max
])
def test_model_checkpoint_best_only(tmp_path: Path, monitor: str, values: list, kept: list) -> None:
    saver = sg.callbacks.ModelCheckpoint(str(tmp_path / "best-{epoch}"), monitor=monitor, save_best_only=True)
    drive([saver], fake_model(), [{monitor: v} for v in values])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == kept


def test_model_checkpoint_best_only_into_one_path_keeps_the_best(tmp_path: Path) -> None:
    model = fake_model()
    best_weights = {}

    class Remember(sg.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            best_weights[epoch] = model.module.weight.detach().clone()

    saver = sg.callbacks.ModelCheckpoint(tmp_path / "best", save_best_only=True, save_weights_only=True,
                                         initial_value_threshold=0.6)
    drive([saver, Remember()], model, [{"val_loss": v} for v in [0.7, 0.4, 0.5]])
    assert saver.best == 0.4
    module = torch.nn.Linear(3, 1)
    sg.Checkpoint(model=module).restore(tmp_path / "best")
    torch.testing.assert_close(module.weight, best_weights[1])


def test_model_checkpoint_every_n_steps_and_errors(tmp_path: Path) -> None:
    saver = sg.callbacks.ModelCheckpoint(tmp_path / "e{epoch}-b{batch}", save_freq=3)
    drive([saver], fake_model(), [{}, {}], steps=3)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["e1-b3", "e2-b3"]
    with pytest.raises(sg.errors.InvalidArgumentError, match="save_freq"):
        sg.callbacks.ModelCheckpoint(tmp_path, save_freq=0)
    with pytest.raises(sg.errors.InvalidArgumentError, match="mode"):
        sg.callbacks.ModelCheckpoint(tmp_path, mode="best")
    with pytest.raises(sg.errors.InvalidArgumentError, match=r"val_acc.*may name"):
        drive([sg.callbacks.ModelCheckpoint(tmp_path / "{val_acc}")], fake_model(), [{"val_loss": 1.0}])
    with pytest.warns(RuntimeWarning, match="no 'val_loss' to monitor"):
        drive([sg.callbacks.ModelCheckpoint(tmp_path / "x", save_best_only=True)], fake_model(), [{"loss": 1.0}])
    assert not (tmp_path / "x").exists()


def test_model_checkpoint_under_mirrored_restores_anywhere(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = fake_model(strategy)
    saver = sg.callbacks.ModelCheckpoint(tmp_path / "m")
    drive([saver], model, [{"loss": 1.0}])
    module = torch.nn.Linear(3, 1)
    sg.Checkpoint(model=module).restore(tmp_path / "m")
    torch.testing.assert_close(module.state_dict(), model.module.state_dict())


# ---------------------------------------------------------------- EarlyStopping

@pytest.mark.parametrize("options,values,epochs_run,stopped", [
    ({"patience": 0}, [1.0, 0.9, 0.95, 0.5], 3, 2),
    ({"patience": 2}, [1.0, 0.9, 0.95, 0.96, 0.5], 4, 3),
    ({"patience": 1, "min_delta": 0.2}, [1.0, 0.9, 0.5], 2, 1),          # 0.9 is not enough better
    ({"patience": 1, "start_from_epoch": 2}, [1.0, 2.0, 3.0, 4.0, 5.0], 4, 3),
    ({"patience": 2, "baseline": 0.5}, [0.9, 0.95, 0.97, 0.4], 2, 1),    # 0.9 did not beat the baseline
    ({"patience": 0, "monitor": "val_accuracy"}, [0.5, 0.6, 0.55], 3, 2),  # auto: higher is better
    ({"patience": 5}, [1.0, 0.9], 2, 0),                                 # never stops
])
def test_early_stopping(options: dict, values: list, epochs_run: int, stopped: int) -> None:
    monitor = options.get("monitor", "val_loss")
    stopper = sg.callbacks.EarlyStopping(**options)
    model = fake_model()
    assert drive([stopper], model, [{monitor: v} for v in values]) == epochs_run
    assert stopper.stopped_epoch == stopped and model.stop_training == bool(stopped)


def test_early_stopping_restores_the_best_weights() -> None:
    model = fake_model()
    weights = []

    class Remember(sg.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append(model.module.weight.detach().clone())

    stopper = sg.callbacks.EarlyStopping(patience=1, restore_best_weights=True)
    drive([Remember(), stopper], model, [{"val_loss": v} for v in [1.0, 0.5, 0.7, 0.8]])
    assert (stopper.stopped_epoch, stopper.best_epoch) == (2, 1)
    torch.testing.assert_close(model.module.weight, weights[1])
    with pytest.raises(sg.errors.InvalidArgumentError, match="patience"):
        sg.callbacks.EarlyStopping(patience=-1)


def test_monitor_modes() -> None:
    assert Monitor("val_loss", "auto", owner="t").mode == "min"
    assert Monitor("val_sparse_categorical_accuracy", "auto", owner="t").mode == "max"
    assert Monitor("auc", "auto", owner="t").mode == "max"
    assert Monitor("val_mae", "auto", owner="t").mode == "min"
    assert Monitor("x", "max", owner="t").worst == -math.inf


# ---------------------------------------------------------------- LearningRateScheduler

def test_learning_rate_scheduler_trains_mirrored_replicas_like_plain_torch() -> None:
    """The rate set on the user's optimizer reaches every replica: equal to plain PyTorch."""
    def schedule(epoch, lr):
        return 0.2 if epoch == 0 else lr * 0.5

    x, y = torch.randn(8, 3, generator=torch.Generator().manual_seed(1)), torch.randn(8, 1)
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = fake_model(strategy)
    scheduler = sg.callbacks.LearningRateScheduler(schedule)
    scheduler.set_model(model)
    data = strategy.experimental_distribute_dataset([(x, y)] * 2)

    def step(batch):
        inputs, targets = batch
        model.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model.module(inputs), targets, reduction="sum") / 8
        loss.backward()
        model.optimizer.step()

    for epoch in range(3):
        scheduler.on_epoch_begin(epoch)
        for group in ref_optimizer.param_groups:
            group["lr"] = schedule(epoch, group["lr"])
        for batch in data:
            strategy.run(step, args=(batch,))
        for _ in range(2):
            ref_optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_optimizer.step()
        logs = {}
        scheduler.on_epoch_end(epoch, logs)
        assert logs["lr"] == schedule(0, 0) * 0.5 ** epoch
    torch.testing.assert_close(model.module.state_dict(), reference.state_dict())


def test_learning_rate_scheduler_forms_and_errors() -> None:
    model = fake_model()
    model.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0})
    one_argument = sg.callbacks.LearningRateScheduler(lambda epoch: 0.01 * (epoch + 1))
    one_argument.set_model(model)
    one_argument.on_epoch_begin(2)
    assert [g["lr"] for g in model.optimizer.param_groups] == [pytest.approx(0.03)] * 2
    scaled = sg.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 2)
    scaled.set_model(model)
    scaled.on_epoch_begin(0)
    assert [g["lr"] for g in model.optimizer.param_groups] == [pytest.approx(0.06)] * 2
    bad = sg.callbacks.LearningRateScheduler(lambda epoch, lr: float("nan"))
    bad.set_model(model)
    with pytest.raises(sg.errors.InvalidArgumentError, match="finite number"):
        bad.on_epoch_begin(0)
    with pytest.raises(sg.errors.InvalidArgumentError, match="function"):
        sg.callbacks.LearningRateScheduler(0.1)


# ---------------------------------------------------------------- CSVLogger

def test_csv_logger(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "log.tsv"
    drive([sg.callbacks.CSVLogger(path, separator="\t")], fake_model(),
          [{"loss": 1.5, "val_loss": torch.tensor(2.0)}, {"loss": 0.5}])
    drive([sg.callbacks.CSVLogger(path, separator="\t", append=True)], fake_model(), [{"loss": 0.25, "val_loss": 1.0}])
    rows = list(csv.reader(path.open(), delimiter="\t"))
    assert rows == [["epoch", "loss", "val_loss"], ["0", "1.5", "2.0"], ["1", "0.5", "NA"], ["0", "0.25", "1.0"]]
    drive([sg.callbacks.CSVLogger(path)], fake_model(), [{"loss": 3.0}])
    assert path.read_text().splitlines() == ["epoch,loss", "0,3.0"]


# ---------------------------------------------------------------- TensorBoard

def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_writes_what_tensorboard_reads(tmp_path: Path) -> None:
    model = fake_model()
    callbacks = [sg.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1)),
                 sg.callbacks.TensorBoard(tmp_path, update_freq=2)]
    drive(callbacks, model, [{"loss": 1.0, "accuracy": 0.5, "val_loss": 2.0}, {"loss": 0.5, "accuracy": 0.75,
                                                                               "val_loss": 1.0}],
          steps=3, params={"batch_size": 32})
    train, validation = read_scalars(tmp_path / "train"), read_scalars(tmp_path / "validation")
    assert train["epoch_loss"] == [(0, 1.0), (1, 0.5)]
    assert train["epoch_accuracy"] == [(0, 0.5), (1, 0.75)]
    assert [v for _, v in train["epoch_learning_rate"]] == pytest.approx([0.1, 0.05])
    assert [step for step, _ in train["batch_loss"]] == [2, 4, 6]
    assert all(v > 0 for _, v in train["epoch_samples_per_second"] + train["epoch_steps_per_second"])
    ratio = train["epoch_samples_per_second"][0][1] / train["epoch_steps_per_second"][0][1]
    assert ratio == pytest.approx(32, rel=1e-3)
    assert validation == {"epoch_loss": [(0, 2.0), (1, 1.0)]}


def test_tensorboard_missing_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # as if not installed
    board = sg.callbacks.TensorBoard(tmp_path)
    board.set_model(fake_model())
    with pytest.raises(sg.errors.MissingDependencyError, match="pip install tensorboard"):
        board.on_train_begin()
    with pytest.raises(ImportError):
        board.on_train_begin()
