"""sg.experimental.Timeline in one process: the trace loads, nests, and its steps add up."""

from __future__ import annotations

import json

import pytest
import torch

import stratagem as sg
from stratagem._profiling import label
from stratagem.errors import InvalidArgumentError
from stratagem.observe import chrome, record

from .traces import assert_nested, assert_steps_add_up, spans

pytestmark = pytest.mark.timeout(120)


def _model(inputs: int = 32, hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def test_the_recorder_is_off_until_asked_and_its_sites_share_one_no_op() -> None:
    record.count_steps(False)   # (a collective over workers or a TensorBoard callback earlier in this process asks)
    assert not record.ON and not record.TIMELINE
    assert record.span("forward") is record.span("backward")
    assert type(label("stratagem.run")).__name__ != "Span"


def test_a_custom_loop_under_two_replicas(tmp_path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        net = _model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = strategy.experimental_distribute_dataset([torch.randn(64, 32) for _ in range(6)])

    def step(x):
        loss = sg.nn.compute_average_loss(net(x).pow(2).sum(1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    path = tmp_path / "trace.json"
    with sg.experimental.Timeline(path) as timeline:
        for x in data:
            strategy.run(step, args=(x,))
    assert not record.TIMELINE and timeline.path == str(path)
    trace = chrome.load(str(path))
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 6
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"main", "stratagem-replica-1"} <= names
    kinds = {e["name"] for e in spans(trace)}
    assert {"step", "input", "stratagem.run", "stratagem.replica_fn", "stratagem.optimizer.step",
            "stratagem.gradients.sync"} <= kinds


def test_fit_with_the_callback_shows_forward_backward_and_the_update(tmp_path) -> None:
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():   # (steps of milliseconds: fit's own few microseconds between spans are noise)
        model = sg.Model(_model(512, 2048))
        model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(160, 512), torch.randn(160, 4)
    path = tmp_path / "fit.json"
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[sg.experimental.Timeline(path)])
    trace = json.loads(path.read_text())
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 10
    for name in ("forward", "backward", "metrics", "stratagem.optimizer.step"):
        assert sum(e["name"] == name for e in spans(trace)) == 10, name
    assert sum(e["name"] == "next batch" for e in spans(trace)) == 12   # (and the end of each epoch)
    step = next(e for e in spans(trace) if e["name"] == "step")
    inside = [e["name"] for e in sorted(spans(trace), key=lambda e: e["ts"])
              if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    assert inside.index("forward") < inside.index("backward") < inside.index("stratagem.optimizer.step")


def test_a_timeline_refuses_a_directory_and_a_non_path(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="directory; give a file name"):
        sg.experimental.Timeline(tmp_path)
    with pytest.raises(InvalidArgumentError, match="path of the trace file"):
        sg.experimental.Timeline(3)


def test_a_checkpoint_save_is_on_the_timeline(tmp_path) -> None:
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():
        net = _model()
    checkpoint = sg.Checkpoint(model=net)
    with sg.experimental.Timeline(tmp_path / "trace.json"):
        checkpoint.save(str(tmp_path / "ckpt"))
    saves = [e for e in spans(chrome.load(str(tmp_path / "trace.json"))) if e["name"] == "checkpoint save"]
    assert len(saves) == 1 and saves[0]["cat"] == "checkpoint"
