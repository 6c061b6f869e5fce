"""sg.Model's Keras saving API in one process: save / load_model across strategies and into plain
PyTorch, resuming, safe_mode, overwrite, save_weights / load_weights, summary, the variables,
get_weights / set_weights, and the optimizer's learning_rate."""

from __future__ import annotations

import copy
import os
import pickle
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import stratagem as sg
from stratagem.errors import CheckpointError, ContextError, InvalidArgumentError
from stratagem.testing import run_local_cluster

from .common import CLASSES, FEATURES, data

pytestmark = pytest.mark.timeout(120)


class Classifier(torch.nn.Module):
    """A module class of its own (found again by name), with a BatchNorm (buffers) and an attribute."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.BatchNorm1d(hidden),
                                        torch.nn.Tanh())
        self.head = torch.nn.Linear(hidden, CLASSES)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def make_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return Classifier().double()


def build(strategy, optimizer="adam") -> sg.Model:
    with strategy.scope():
        model = sg.Model(make_module())
        if callable(optimizer):   # made in the scope over the module's parameters
            optimizer = optimizer(model.module.parameters())
        model.compile(optimizer=optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", sg.metrics.SparseCategoricalAccuracy(name="sca", dtype=torch.float64)], mixed_precision="float32")
    return model


def arrays():
    x, y, _ = data(rows=100)   # batches of 10: 5 rows per replica (BatchNorm needs 2)
    return x.astype(np.float64), y


def train(model: sg.Model, seed: int, epochs: int = 2) -> None:
    x, y = arrays()
    torch.manual_seed(seed)   # the shuffling order
    model.fit(x, y, batch_size=10, epochs=epochs, verbose=0)


def values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- save / load_model


def test_saved_under_mirrored_loads_under_one_device_and_in_plain_pytorch(tmp_path: Path) -> None:
    model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
    train(model, seed=1)
    path = tmp_path / "model.pt"
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]   # no temporary left behind
    x = torch.from_numpy(arrays()[0])

    content = torch.load(path, weights_only=True)   # plain PyTorch: weights only, no stratagem class
    plain = make_module()
    plain.load_state_dict(content["state_dict"])
    plain.eval()
    assert_equal(values(plain), values(model.module))

    with sg.OneDeviceStrategy("cpu").scope():
        loaded = sg.models.load_model(path)
    assert isinstance(loaded.module, Classifier) and loaded.module.scale == 2.0
    assert isinstance(loaded.strategy, sg.OneDeviceStrategy)
    assert_equal(values(loaded.module), values(model.module))
    with torch.no_grad():
        expected = plain(x)
    loaded.module.train()   # predict runs in eval mode (Keras: training=False) whatever the mode
    assert torch.equal(loaded.predict(x, batch_size=100), expected)   # float64, bit for bit
    # the compile state came back: optimizer class, hyperparameters, state; loss; metrics; policy
    assert type(loaded.optimizer).__name__ == "MirroredAdam" and loaded.optimizer.learning_rate == 0.001
    assert_equal(loaded.optimizer.state_dict()["state"][0], model.optimizer.state_dict()["state"][0])
    assert repr(loaded.loss) == "SparseCategoricalCrossentropy(from_logits=True, reduction='sum_over_batch_size')"
    assert [(type(m).__name__, m.name) for m in loaded.compiled_metrics] == [
        (type(m).__name__, m.name) for m in model.compiled_metrics]
    assert loaded.compiled_metrics[1].dtype == torch.float64
    assert loaded.dtype_policy.name == "float32"
    model.module.eval()
    logs = loaded.evaluate(*arrays(), batch_size=20, verbose=0, return_dict=True)
    assert logs == pytest.approx(model.evaluate(*arrays(), batch_size=20, verbose=0, return_dict=True), rel=1e-12)


@pytest.mark.parametrize("make", [lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"])], ids=["mirrored", "central"])
def test_the_stored_module_is_the_clean_logical_one(tmp_path: Path, make) -> None:
    strategy = make()
    model = build(strategy)
    train(model, seed=1, epochs=1)
    model.save(tmp_path / "model.pt")
    architecture = torch.load(tmp_path / "model.pt", weights_only=True)["architecture"]
    assert b"stratagem" not in architecture and b"Mirrored" not in architecture   # no class or hook of ours
    loaded = sg.models.load_model(tmp_path / "model.pt", compile=False)   # the default strategy: plain module
    assert loaded.optimizer is None
    for module in loaded.module.modules():   # plain dicts, no hooks of a strategy
        assert type(module._parameters) is dict and type(module._buffers) is dict
        hooks = [k for k, v in module.__dict__.items() if k.endswith("hooks") and isinstance(v, dict) and v]
        assert hooks == [], hooks
    assert_equal(values(loaded.module), values(model.module))
    assert strategy.placement.all_copies(model.module.head.weight) is not None   # the live model: untouched
    train(model, seed=2, epochs=1)


def test_resuming_after_load_model_equals_uninterrupted_training(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    uninterrupted = build(strategy)
    train(uninterrupted, seed=1)
    train(uninterrupted, seed=2)

    first = build(strategy)
    train(first, seed=1)
    first.save(tmp_path / "model.pt")
    with strategy.scope():
        resumed = sg.models.load_model(tmp_path / "model.pt")
    assert type(resumed.optimizer).__name__ == "MirroredAdam"
    train(resumed, seed=2)
    assert_equal(values(resumed.module), values(uninterrupted.module))   # Adam's moments and steps restored
    assert_equal(resumed.optimizer.state_dict()["state"][3], uninterrupted.optimizer.state_dict()["state"][3])


class Tied(torch.nn.Module):
    """An encoder and a decoder sharing one weight, and a shared submodule."""

    def __init__(self):
        super().__init__()
        self.encode = torch.nn.Linear(6, 4, bias=False)
        self.decode = torch.nn.Linear(4, 6, bias=False)
        self.decode.weight = self.encode.weight   # tied (used transposed below)
        self.act = torch.nn.Tanh()
        self.act_again = self.act

    def forward(self, x):
        return self.act_again(self.act(self.encode(x)) @ self.encode.weight)


def test_shared_weights_stay_shared(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.Model(Tied().double())
        model.compile("adam", loss="mse")
    x = torch.randn(8, 6, dtype=torch.float64)
    model.fit(x, x, batch_size=4, epochs=1, verbose=0)
    assert len(model.get_weights()) == 1   # one tensor, under two names
    model.save(tmp_path / "model.pt")
    with strategy.scope():
        loaded = sg.models.load_model(tmp_path / "model.pt")
    module = loaded.module
    assert module.decode.weight is module.encode.weight and module.act_again is module.act
    assert len(loaded.optimizer.param_groups[0]["params"]) == 1
    assert_equal(values(module), values(model.module))
    loaded.fit(x, x, batch_size=4, epochs=1, verbose=0)
    assert module.decode.weight is module.encode.weight


def test_central_storage_and_include_optimizer_false(tmp_path: Path) -> None:
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
    model = build(strategy, optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    train(model, seed=1, epochs=1)
    model.save(tmp_path / "full.pt")
    model.save(tmp_path / "light.pt", include_optimizer=False)
    with sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).scope():
        loaded = sg.models.load_model(tmp_path / "full.pt")
        light = sg.models.load_model(tmp_path / "light.pt")
    assert_equal(values(loaded.module), values(model.module))
    assert loaded.optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0
    assert light.optimizer.state_dict()["state"] == {}   # no state, same hyperparameters
    assert light.optimizer.param_groups[0]["momentum"] == 0.9 and light.optimizer.learning_rate == 0.05
    train(loaded, seed=2, epochs=1)


def test_mixed_precision_policy_and_loss_scale_come_back(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.Model(torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
        model.compile("adam", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      mixed_precision="mixed_float16")
    x, y, _ = data(rows=100)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    model.loss_scaler.update(1024.0)   # a scale of its own, to see it restored
    model.save(tmp_path / "model.pt")
    with strategy.scope():
        loaded = sg.models.load_model(tmp_path / "model.pt")
    assert loaded.dtype_policy.name == "mixed_float16" and loaded.loss_scaler.get_scale() == 1024.0
    loaded.fit(x, y, batch_size=10, epochs=1, verbose=0)


def test_overwrite_false_refuses_an_existing_file(tmp_path: Path) -> None:
    model = build(sg.get_strategy())
    path = tmp_path / "model.pt"
    model.save(path)
    before = path.read_bytes()
    train(model, seed=1, epochs=1)
    with pytest.raises(InvalidArgumentError, match="exists and overwrite=False; pass overwrite=True"):
        model.save(path, overwrite=False)
    with pytest.raises(InvalidArgumentError, match="exists and overwrite=False"):
        model.save_weights(path, overwrite=False)
    assert path.read_bytes() == before
    model.save(path)   # overwrite=True (the default) replaces it atomically
    assert path.read_bytes() != before and sorted(os.listdir(tmp_path)) == ["model.pt"]
    with pytest.raises(InvalidArgumentError, match="got save_format, which stratagem does not take.*remove save_format="):
        model.save(path, save_format="tf")
    with pytest.raises(InvalidArgumentError, match="remove skip_mismatch="):
        model.load_weights(path, skip_mismatch=True)
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        model.save(tmp_path)
    model.save(tmp_path / "new" / "dir" / "model.pt")   # missing directories are created
    assert (tmp_path / "new" / "dir" / "model.pt").is_file()


@pytest.mark.multiprocess
def test_a_writer_killed_mid_save_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    [result] = run_local_cluster(Path(__file__).parent / "save_loop_script.py", 1, args=[str(path)],
                                 kill_after={"worker 0": "saved 2"}, timeout=100)
    assert result.returncode == -9, result.output   # SIGKILLed, most often in the middle of a save
    loaded = sg.models.load_model(path)
    versions = {float(v) for p in loaded.module.parameters() for v in p.detach().unique()}
    assert len(versions) == 1 and min(versions) >= 2, versions   # one whole version, never a mix
    loaded.save(path)   # the next save removes what the killed one left
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]


def test_saving_refuses_what_cannot_be_stored_by_name(tmp_path: Path) -> None:
    module = make_module()
    module.head.activation = lambda t: t   # noqa: E731
    with pytest.raises(InvalidArgumentError, match="attribute 'activation' of head .*save_weights|"
                                                   "attribute 'activation' of head"):
        sg.Model(module).save(tmp_path / "model.pt")

    class Local(torch.nn.Linear):
        pass

    with pytest.raises(InvalidArgumentError, match="Local .*cannot be found again by its name.*save_weights"):
        sg.Model(Local(2, 2)).save(tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    sg.Model(Local(2, 2)).save_weights(tmp_path / "weights.pt")   # the weights alone: always


def test_a_metric_stored_by_name_only_needs_custom_objects(tmp_path: Path) -> None:
    def close(y_true, y_pred):
        return (y_pred.argmax(-1) == y_true).double()

    with sg.get_strategy().scope():
        model = sg.Model(make_module())
        model.compile("sgd", loss=torch.nn.CrossEntropyLoss(), metrics=[close])
    with pytest.warns(UserWarning, match="metric 'close'"):
        model.save(tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"custom_objects=\{'close': \.\.\.\}.*compile=False"):
        sg.models.load_model(tmp_path / "model.pt")
    loaded = sg.models.load_model(tmp_path / "model.pt", custom_objects={"close": close})
    assert loaded.compiled_metrics[0].name == "close" and isinstance(loaded.loss, torch.nn.CrossEntropyLoss)
    assert sg.models.load_model(tmp_path / "model.pt", compile=False).optimizer is None


# ---------------------------------------------------------------------- safe_mode


def planted_call(module: str, name: str, argument: str) -> bytes:
    """A pickle that calls ``module.name(argument)`` when loaded (what a malicious file holds)."""
    text = lambda value: b"\x8c" + bytes([len(value)]) + value.encode()   # noqa: E731 (SHORT_BINUNICODE)
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."   # STACK_GLOBAL, REDUCE


PLANTED = {"os.system": ("posix", "system"), "eval": ("builtins", "eval"),
           "torch.load through F": ("torch.nn.functional", "torch.load"), "marshal": ("marshal", "loads")}


@pytest.mark.parametrize("where", ["architecture", "loss", "optimizer class", "metric"])
@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_safe_mode_refuses_a_planted_global(tmp_path: Path, where: str, planted: str) -> None:
    marker = tmp_path / "ran"
    model = build(sg.get_strategy())
    model.save(tmp_path / "model.pt")
    content = torch.load(tmp_path / "model.pt", weights_only=True)
    module, name = PLANTED[planted]
    data = planted_call(module, name, f"touch {marker}" if name == "system" else str(tmp_path / "model.pt"))
    if name == "system":   # the pickle really runs it when nothing stops it
        pickle.loads(data)
        assert marker.exists()
        marker.unlink()
    if where == "architecture":
        content["architecture"] = data
    elif where == "loss":
        content["compile"]["loss"] = {"pickle": data}
    elif where == "metric":
        content["compile"]["metrics"][0] = {"pickle": data}
    else:
        content["compile"]["optimizer"]["class"] = data
    torch.save(content, tmp_path / "planted.pt")
    torch.load(tmp_path / "planted.pt", weights_only=True)   # the outer file stays weights-only
    with pytest.raises(InvalidArgumentError, match=rf"refused to load .*planted\.pt: it names {module}\.{name}, "
                                                   rf".*safe_mode=False"):
        sg.models.load_model(tmp_path / "planted.pt")
    assert not marker.exists()


def test_safe_mode_imports_no_module_the_file_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_models.py").write_text(textwrap.dedent("""
        import torch

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(3, 2)

            def forward(self, x):
                return self.linear(x)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_models

    model = sg.Model(user_models.Tiny())
    model.save(tmp_path / "model.pt")
    Tiny = user_models.Tiny
    monkeypatch.delitem(sys.modules, "user_models")
    with pytest.raises(InvalidArgumentError, match="module user_models is not imported.*Import user_models first"):
        sg.models.load_model(tmp_path / "model.pt")
    assert "user_models" not in sys.modules
    assert isinstance(sg.models.load_model(tmp_path / "model.pt", custom_objects={"Tiny": Tiny}).module, Tiny)
    trusted = sg.models.load_model(tmp_path / "model.pt", safe_mode=False)   # imports it
    assert type(trusted.module).__name__ == "Tiny" and "user_models" in sys.modules


def test_load_model_refuses_files_it_did_not_write(tmp_path: Path) -> None:
    torch.save(make_module().state_dict(), tmp_path / "weights.pt")
    with pytest.raises(CheckpointError, match="not written by model.save.*load_weights"):
        sg.models.load_model(tmp_path / "weights.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="torch.load\\(weights_only=True\\) failed"):
        sg.models.load_model(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError, match="no file at"):
        sg.models.load_model(tmp_path / "missing.pt")


# ------------------------------------------------------------ weights and variables


def test_save_weights_load_weights_across_strategies(tmp_path: Path) -> None:
    source = build(sg.get_strategy())
    train(source, seed=3, epochs=1)
    source.save_weights(tmp_path / "model.weights.pt")
    assert_equal(torch.load(tmp_path / "model.weights.pt", weights_only=True), values(source.module))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    target = build(strategy)
    target.load_weights(tmp_path / "model.weights.pt")
    x = torch.from_numpy(arrays()[0])
    source.module.eval()
    with torch.no_grad():
        expected = source.module(x)
    target.module.eval()
    torch.testing.assert_close(target.predict(x, batch_size=100), expected, rtol=1e-12, atol=1e-12)   # both replicas
    source.save(tmp_path / "model.pt")
    other = build(sg.get_strategy())
    other.load_weights(tmp_path / "model.pt")   # a file of save holds the weights too
    assert_equal(values(other.module), values(source.module))

    wrong = sg.Model(torch.nn.Sequential(torch.nn.Linear(FEATURES, 4)))
    before = values(wrong.module)
    with pytest.raises(CheckpointError, match="do not fit this model.*missing .*unexpected"):
        wrong.load_weights(tmp_path / "model.weights.pt")
    assert_equal(values(wrong.module), before)


def test_variables_and_get_set_weights_round_trip(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = build(strategy)
    module = model.module
    assert [t is p for t, p in zip(model.trainable_variables, module.parameters())] == [True] * 6
    assert len(model.non_trainable_variables) == 3   # BatchNorm: running mean, var, batches tracked
    assert len(model.weights) == len(model.variables) == 9 == len(module.state_dict())
    weights = model.get_weights()
    assert all(isinstance(w, np.ndarray) for w in weights) and weights[0].shape == (16, FEATURES)
    changed = [w * 0.5 if w.dtype == np.float64 else w for w in weights]
    model.set_weights(changed)
    for got, want in zip(model.get_weights(), changed):
        assert np.array_equal(got, want)
    x = torch.from_numpy(arrays()[0])
    plain = make_module()
    plain.load_state_dict({k: torch.from_numpy(w) for k, w in zip(plain.state_dict(), changed)})
    plain.eval()
    model.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.predict(x, batch_size=100), plain(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match=r"weight 1 \(body.0.bias\) has shape \(16,\).*shape \(15,\)"):
        model.set_weights(weights[:1] + [np.zeros(15)] + weights[2:])
    with pytest.raises(InvalidArgumentError, match="got 2 arrays, and the model has 9 weights"):
        model.set_weights(weights[:2])
    for got, want in zip(model.get_weights(), changed):   # nothing changed by the refusals
        assert np.array_equal(got, want)


def test_summary_prints_a_keras_table() -> None:
    model = build(sg.get_strategy())
    lines: list[str] = []
    assert model.summary(print_fn=lines.append) is None
    assert lines[0] == 'Model: "Classifier"' and lines[2].split() == ["Layer", "(type)", "Output", "Shape", "Param", "#"]
    rows = {line.split()[0]: line.split() for line in lines[4:6]}
    assert rows["body"] == ["body", "(Sequential)", "?", str(16 * FEATURES + 16 + 4 * 16 + 1)]
    assert rows["head"] == ["head", "(Linear)", "?", str(16 * CLASSES + CLASSES)]
    trainable = 16 * FEATURES + 16 + 2 * 16 + 16 * CLASSES + CLASSES
    assert f"Trainable params: {trainable:,} ({trainable * 8 / 1024:.2f} KB)" in lines
    assert "Non-trainable params: 33 (264.00 B)" in lines   # running mean and var (float64), batches (int64)
    model.build((None, FEATURES))
    lines.clear()
    model.summary(print_fn=lines.append, expand_nested=True, show_trainable=True)
    rows = {line.split()[0]: line for line in lines if line.startswith(" ")}
    assert "(None, 16)" in rows["body"] and "(None, 3)" in rows["head"] and rows["head"].endswith("Y")
    assert "  body.0 (Linear)" in lines[5] and "(None, 16)" in lines[5]   # nested rows, indented
    assert model.module.training and model.module.body[1].running_mean.device.type == "cpu"   # untouched


# ------------------------------------------------------------------ learning_rate


class PrintLR(sg.callbacks.Callback):
    """TensorFlow's tutorial callback, unchanged but for the names."""

    def __init__(self):
        super().__init__()
        self.printed: list[str] = []

    def on_epoch_end(self, epoch, logs=None):
        self.printed.append('Learning rate for epoch {} is {}'.format(epoch + 1,
                                                                      self.model.optimizer.learning_rate.numpy()))


def test_learning_rate_under_the_default_strategy() -> None:
    model = build(sg.get_strategy(), optimizer="sgd")
    optimizer = model.optimizer
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, torch.optim.SGD)
    assert optimizer.learning_rate == 0.01 and optimizer.lr == 0.01
    optimizer.learning_rate = 0.5
    assert [g["lr"] for g in optimizer.param_groups] == [0.5]
    optimizer.learning_rate.assign(0.25)
    assert optimizer.param_groups[0]["lr"] == 0.25
    with pytest.raises(InvalidArgumentError, match="finite number >= 0"):
        optimizer.learning_rate = -1.0
    assert type(copy.deepcopy(optimizer)) is torch.optim.SGD   # copies and pickles are plain again
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1})
    with pytest.raises(InvalidArgumentError, match=r"different learning rates \[0.25, 0.1\].*param_groups"):
        optimizer.learning_rate
    optimizer.learning_rate = 0.3   # setting: every group
    assert [g["lr"] for g in optimizer.param_groups] == [0.3, 0.3]
    schedule = sg.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2)
    printer = PrintLR()
    optimizer.param_groups.pop()
    model.fit(*arrays(), batch_size=10, epochs=2, verbose=0, callbacks=[schedule, printer])
    assert printer.printed == ["Learning rate for epoch 1 is 0.15", "Learning rate for epoch 2 is 0.075"]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)).double()


def test_learning_rate_set_under_mirrored_reaches_every_replica() -> None:
    x, y = arrays()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        module = mlp()
        model = sg.Model(module)
        model.compile(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5),
                      loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert type(model.optimizer).__name__ == "MirroredSGD" and model.optimizer.learning_rate == 0.1
    model.optimizer.learning_rate = 0.03
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    reference = sg.Model(mlp())
    reference.compile(torch.optim.SGD(reference.module.parameters(), lr=0.03, momentum=0.5),
                      loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    expected = values(reference.module)
    for name, value in values(model.module).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-12, atol=1e-12, msg=name)
    reference.module.eval()
    model.module.eval()
    with torch.no_grad():   # every replica computes with the same weights
        torch.testing.assert_close(model.predict(x, batch_size=100), reference.module(torch.from_numpy(x)),
                                   rtol=1e-12, atol=1e-12)


def test_io_is_refused_inside_run(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = build(strategy)
    for call in (lambda: model.save(tmp_path / "m.pt"), lambda: model.save_weights(tmp_path / "w.pt"),
                 lambda: sg.models.load_model(tmp_path / "m.pt"), lambda: model.set_weights([])):
        with pytest.raises(ContextError, match="inside strategy.run"):
            strategy.run(call)


def test_the_execution_options_of_compile_come_back(tmp_path: Path) -> None:
    model = sg.Model(make_module())
    model.compile("sgd", sg.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=3,
                  jit_compile=True)
    model.save(tmp_path / "model.pt")
    loaded = sg.models.load_model(tmp_path / "model.pt")
    assert loaded.steps_per_execution == 3 and loaded._precision.jit_compile
    assert repr(loaded.loss) == repr(model.loss)


def test_load_weights_reads_a_checkpoint_directory_of_model_checkpoint(tmp_path: Path) -> None:
    x, y = arrays()
    model = build(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
    saver = sg.callbacks.ModelCheckpoint(str(tmp_path / "ckpt_{epoch}"), save_weights_only=True)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[saver])
    trained = {k: v.clone() for k, v in model.module.state_dict().items()}
    other = build(sg.OneDeviceStrategy("cpu"))
    other.load_weights(sg.latest_checkpoint(tmp_path))
    for name, value in trained.items():
        assert torch.equal(other.module.state_dict()[name], value), name
