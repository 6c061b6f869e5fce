"""sg.Model with several inputs (a dict x as keyword arguments, a tuple x as positional ones) and
with outputs that are not one tensor (``output=``): equivalence, predict, and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest
import torch
from typing_extensions import Unpack

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.keras.pipeline_steps import PipelineSteps
from stratagem.keras.structured import OutputChoice

from .common import CLASSES, FEATURES, data

pytestmark = pytest.mark.timeout(120)


class TwoInputs(torch.nn.Module):
    """``forward(features, scale)``: both inputs have a row per example; returns a record."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))

    def forward(self, features: torch.Tensor, scale: torch.Tensor) -> dict:
        logits = self.body(features) * scale
        return {"scores": logits, "total": logits.sum()}


def inputs() -> tuple[dict, np.ndarray, np.ndarray]:
    x, y, w = data()
    scale = np.linspace(0.5, 1.5, len(x), dtype=np.float32)[:, None]
    return {"features": x, "scale": scale}, y, w


def train(strategy: sg.Strategy, x: object, y: object, batch_size: int | None = 10,
          **fit_args: object) -> tuple[sg.Model, dict]:
    with strategy.scope():
        model = sg.Model(TwoInputs(), output="scores")
        model.compile("adam", sg.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    torch.manual_seed(123)   # the shuffling order
    history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, **fit_args)
    return model, history.history


def state(model: sg.Model) -> dict:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_dict_and_tuple_inputs_train_like_the_default_strategy(form: str) -> None:
    # 103 rows in batches of 10 over 3 replicas: the last batch (3 rows) gives each replica one
    named, y, w = inputs()
    x = named if form == "dict" else (named["features"], named["scale"])
    ref, ref_history = train(sg.get_strategy(), x, y, sample_weight=w, validation_split=0.2)
    model, history = train(sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), x, y, sample_weight=w,
                           validation_split=0.2)
    for name, value in state(ref).items():
        torch.testing.assert_close(state(model)[name], value, rtol=2e-5, atol=2e-6)
    assert history["val_accuracy"] == pytest.approx(ref_history["val_accuracy"])
    assert history["loss"] == pytest.approx(ref_history["loss"], rel=1e-5)
    assert model.evaluate(x, y, batch_size=7, verbose=0) == pytest.approx(ref.evaluate(x, y, batch_size=7, verbose=0),
                                                                         rel=1e-5)
    predicted = model.predict(x, batch_size=7)   # the named output, every row in input order
    with torch.no_grad():
        expected = ref.module(torch.from_numpy(named["features"]), torch.from_numpy(named["scale"]))["scores"]
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)


def test_iterables_of_dict_batches_and_validation_data() -> None:
    named, y, _ = inputs()
    x = {k: torch.from_numpy(v) for k, v in named.items()}
    batches = [({k: v[s:s + 10] for k, v in x.items()}, torch.from_numpy(y[s:s + 10])) for s in range(0, len(y), 10)]
    from_arrays, _ = train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), x, y, shuffle=False,
                           validation_data=(named, y))
    from_list, history = train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), batches, None, batch_size=None,
                               validation_data=batches)
    for name, value in state(from_arrays).items():
        torch.testing.assert_close(state(from_list)[name], value)
    assert len(history["val_loss"]) == 2


def test_default_output_rules() -> None:
    logits = torch.zeros(4, 3)
    auto = OutputChoice()
    assert auto.for_loss(logits) is logits
    assert auto.for_loss({"loss": torch.tensor(1.0), "logits": logits}) is logits
    assert auto.for_loss((logits, torch.ones(4))) is logits
    assert OutputChoice(1).for_loss((torch.ones(4), logits)) is logits
    assert OutputChoice("h").for_loss({"h": logits}) is logits
    record = {"logits": logits, "first": logits[:, :1]}
    assert auto.for_predict(record) is record   # predict keeps the whole output without output=


@pytest.mark.parametrize("output, returned, message", [
    (None, {"scores": torch.zeros(4, 3)}, r"without 'logits'.*sg\.Model\(module, output=KEY\) \(its keys: 'scores'\)"),
    ("logit", {"logits": torch.zeros(4, 3)}, r"has no 'logit' \(its keys: 'logits'\); fix sg\.Model\(module, output"),
    (None, None, r"returned a NoneType; sg\.Model needs a tensor"),
    (None, ("a", torch.zeros(4)), r"first output is a str; .*one row per example.*output=KEY"),
    ("total", {"total": torch.tensor(2.0)}, r"output 'total' is a 0-d tensor"),
    (2, (torch.zeros(4), torch.zeros(4)), r"returned 2 outputs; fix the index"),
    ("logits", (torch.zeros(4),), r"output='logits'\) reads a key, but the module returned a tuple; use an index"),
    (0, {"logits": torch.zeros(4)}, r"output=0\) reads an index, but the module returned a dict; use a key"),
])
def test_an_output_the_loss_cannot_read_is_a_clear_error(output: object, returned: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        OutputChoice(output).for_loss(returned)


def test_errors_name_the_fix() -> None:
    named, y, _ = inputs()
    with pytest.raises(InvalidArgumentError, match=r"output=\.\.\.\) takes a key \(str\), an index \(int\) or None"):
        sg.Model(TwoInputs(), output=1.5)
    model = sg.Model(TwoInputs())   # output=None: the dict has no 'logits'
    model.compile("sgd", sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(InvalidArgumentError, match=r"without 'logits'.*output=KEY\) \(its keys: 'scores', 'total'\)"):
        model.fit(named, y, verbose=0)
    with pytest.raises(InvalidArgumentError, match=r"one of them is a 0-d tensor.*output=KEY"):
        model.predict(named)
    uneven = {"features": named["features"], "scale": named["scale"][:50]}
    with pytest.raises(InvalidArgumentError, match=r"same number of rows.*x\['features'\] 103, x\['scale'\] 50"):
        model.fit(uneven, y, verbose=0)
    with pytest.raises(InvalidArgumentError, match=r"x\['scale'\] is a list; every input of a dict or tuple x"):
        model.fit({"features": named["features"], "scale": [1.0] * 103}, y, verbose=0)
    with pytest.raises(InvalidArgumentError, match=r"x and y .* same number of rows, got x 103, y 50"):
        model.fit(named, y[:50], verbose=0)
    wrong_key = {"features": named["features"], "scales": named["scale"]}
    with pytest.raises(InvalidArgumentError, match=r"TwoInputs\.forward\(features.*, scale.*\) cannot take the keys "
                                                   r"\['features', 'scales'\] of the dict x.*name the inputs as"):
        model.predict(wrong_key)
    with pytest.raises(InvalidArgumentError, match=r"cannot take 3 positional inputs \(a tuple x\)"):
        model.predict((named["features"], named["scale"], named["scale"]))


def test_a_type_error_inside_forward_is_not_renamed() -> None:
    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat(x, 1.5)   # a TypeError of the module's own

    with pytest.raises(TypeError) as raised:
        sg.Model(Broken()).predict(np.zeros((4, 2), dtype=np.float32))
    assert not isinstance(raised.value, InvalidArgumentError)


def test_pipeline_steps_refuse_a_named_output() -> None:
    steps = PipelineSteps(strategy=None)
    with pytest.raises(InvalidArgumentError, match=r"output='scores'\) is not supported under NoneType"):
        steps.predict(torch.nn.Linear(2, 2), output=OutputChoice("scores"))
    steps.predict(torch.nn.Linear(2, 2), output=OutputChoice())


def test_save_and_load_keep_the_output(tmp_path: Path) -> None:
    named, y, _ = inputs()
    model, _ = train(sg.get_strategy(), named, y)
    model.save(tmp_path / "model.pt")
    loaded = sg.models.load_model(tmp_path / "model.pt", custom_objects={"TwoInputs": TwoInputs})
    assert loaded.output == "scores"
    torch.testing.assert_close(loaded.predict(named), model.predict(named))


class Options(TypedDict, total=False):
    temperature: float


class Declared(torch.nn.Module):
    def forward(self, features: torch.Tensor, **kwargs: Unpack[Options]) -> torch.Tensor:
        return features * kwargs.get("temperature", 1.0)


class Open(torch.nn.Module):
    def forward(self, features: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return features


def test_declared_keyword_arguments_are_checked_open_ones_are_not() -> None:
    features = np.ones((4, 2), dtype=np.float32)
    assert sg.Model(Declared()).predict({"features": features, "temperature": features}).shape == (4, 2)
    with pytest.raises(InvalidArgumentError, match=r"Declared\.forward\(features, \*\*kwargs\) cannot take the keys "
                                                   r"\['features', 'temprature'\] of the dict x: it takes no "
                                                   r"'temprature'"):
        sg.Model(Declared()).predict({"features": features, "temprature": features})
    assert sg.Model(Open()).predict({"features": features, "anything": features}).shape == (4, 2)


def test_a_parameter_server_worker_cuts_dict_batches_from_the_arrays_it_is_sent() -> None:
    from stratagem.ps.fit_loop import _dataset_fn   # grpc: loaded for this test only

    class Context:
        input_pipeline_id = 0

    named, y, _ = inputs()
    batch = next(iter(_dataset_fn(named, y, None, 8, False)(Context())))
    x, labels = batch
    assert sorted(x) == ["features", "scale"] and x["features"].shape == (8, FEATURES) and x["scale"].shape == (8, 1)
    torch.testing.assert_close(labels, torch.from_numpy(y[:8]))
