"""Where an ``sg.Model`` may be built and used: the refused cases, with their messages, and the
accepted ones (stratagem/keras/model_scope.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.testing import assert_succeeded, run_local_cluster

from . import model_scope_script

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(__file__).parent / "model_scope_script.py"
MIRRORED = "MirroredStrategy\\(devices=\\['cpu:0', 'cpu:1'\\]\\)"
FIX = "with strategy.scope\\(\\): model = sg.Model\\(module\\)"


def mirrored() -> sg.MirroredStrategy:
    return sg.MirroredStrategy(["cpu:0", "cpu:1"])


def arrays() -> tuple[torch.Tensor, torch.Tensor]:
    return model_scope_script.data()


# ------------------------------------------------------------------ refused at construction

@pytest.mark.parametrize("make", [mirrored, lambda: sg.OneDeviceStrategy("cpu:0")], ids=["mirrored", "one_device"])
def test_a_module_of_a_scope_wrapped_outside_it_is_refused_naming_the_scope(make) -> None:
    strategy = make()
    with strategy.scope():
        module = torch.nn.Linear(4, 1)
    with pytest.raises(ContextError, match=re.escape(f"(Linear) was created in the scope of {strategy!r}")) as refused:
        sg.Model(module)
    message = str(refused.value)
    assert "built outside that scope (so for the default strategy)" in message
    assert "with strategy.scope(): model = sg.Model(module)" in message and "strategy=strategy" in message


def test_a_module_of_one_scope_wrapped_in_another_is_refused_naming_both() -> None:
    first, second = mirrored(), mirrored()
    with first.scope():
        module = torch.nn.Linear(4, 1)
    with second.scope(), pytest.raises(ContextError, match=f"created in the scope of {MIRRORED}, but the Model "
                                                           f"is built in the scope of {MIRRORED} \\(a different "
                                                           f"MirroredStrategy object, with the same settings\\).*{FIX}"):
        sg.Model(module)


def test_a_module_of_a_scope_given_another_strategy_is_refused() -> None:
    strategy = mirrored()
    with strategy.scope():
        module = torch.nn.Linear(4, 1)
    with pytest.raises(ContextError, match=f"created in the scope of {MIRRORED}, but the Model is built with "
                                           f"strategy=OneDeviceStrategy\\(device='cpu:0'\\)"):
        sg.Model(module, strategy=sg.OneDeviceStrategy("cpu:0"))


def test_a_module_of_no_scope_wrapped_in_a_multi_replica_scope_is_refused() -> None:
    module = torch.nn.Linear(4, 1)
    with mirrored().scope(), pytest.raises(InvalidArgumentError,
                                           match=f"not created in the scope of {MIRRORED}.*{FIX}"):
        sg.Model(module)


# ------------------------------------------------------------- refused where it is used

def test_compile_in_another_strategy_s_scope_is_refused_and_keeps_nothing() -> None:
    strategy, other = mirrored(), sg.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = sg.Model(torch.nn.Linear(4, 1))
    with other.scope(), pytest.raises(ContextError, match=f"model.compile\\(\\) was called in the scope of "
                                                          f"OneDeviceStrategy\\(device='cpu:0'\\), but this sg.Model "
                                                          f"was built for {MIRRORED}.*{FIX}"):
        model.compile("sgd", "mse")
    assert model.optimizer is None
    model.compile("sgd", "mse")   # outside every scope: compiled in the model's own
    assert type(model.optimizer).__name__ == "MirroredSGD"


@pytest.mark.parametrize("method", ["compile", "fit", "evaluate", "predict"])
def test_a_model_of_the_default_strategy_used_in_a_scope_is_refused(method: str) -> None:
    x, y = arrays()
    model = sg.Model(torch.nn.Linear(4, 1))
    if method != "compile":
        model.compile("sgd", "mse")
    calls = {"compile": lambda: model.compile("sgd", "mse"), "fit": lambda: model.fit(x, y, verbose=0),
             "evaluate": lambda: model.evaluate(x, y, verbose=0), "predict": lambda: model.predict(x)}
    with mirrored().scope(), pytest.raises(ContextError, match=f"model.{method}\\(\\) was called in the scope of "
                                                               f"{MIRRORED}, but this sg.Model was built outside every "
                                                               f"scope, so for the default strategy.*{FIX}"):
        calls[method]()


# --------------------------------------------------------------------------- accepted

def test_built_in_the_scope_used_in_it_and_outside_it() -> None:
    x, y = arrays()
    strategy = mirrored()
    with strategy.scope():
        model = sg.Model(torch.nn.Linear(4, 1))
    model.compile("sgd", "mse")   # outside every scope: the model enters its own
    with strategy.scope():
        model.fit(x, y, batch_size=16, verbose=0)
        model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, verbose=0)
    assert model.predict(x).shape == (32, 1)


def test_the_default_strategy_throughout_and_an_explicit_strategy() -> None:
    x, y = arrays()
    plain = sg.Model(torch.nn.Linear(4, 1))   # no scope anywhere: the default strategy
    plain.compile("sgd", "mse")
    plain.fit(x, y, verbose=0)
    assert plain.strategy is sg.get_strategy()
    strategy = mirrored()
    with strategy.scope():
        module = torch.nn.Linear(4, 1)
    model = sg.Model(module, strategy=strategy)   # the strategy that made the module, named
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, verbose=0)
    with sg.OneDeviceStrategy("cpu:0").scope():   # one replica: a plain module is placed as it is
        one = sg.Model(torch.nn.Linear(4, 1))
        one.compile("sgd", "mse")
    one.fit(x, y, verbose=0)


@pytest.mark.multiprocess
def test_two_workers_refuse_the_model_built_outside_and_train_the_one_built_inside() -> None:
    # before the check, the Model built outside trained on both workers without an error, to
    # other weights than one process computes
    results = run_local_cluster(SCRIPT, 2, timeout=200)
    assert_succeeded(results)
    expected = model_scope_script.fit(sg.get_strategy())
    for r in results:
        lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in r.output.splitlines()
                 if line.startswith(("REFUSED ", "WEIGHTS "))}
        message = json.loads(lines["REFUSED"])
        assert "was created in the scope of MultiWorkerMirroredStrategy" in message, message
        assert "built outside that scope" in message and "with strategy.scope(): model = sg.Model(module)" in message
        assert json.loads(lines["WEIGHTS"]) == pytest.approx(expected, rel=1e-5, abs=1e-6), r.task
