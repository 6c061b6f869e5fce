"""sg.Checkpoint under TensorParallelStrategy: one logical copy, restored across layouts; fit, metrics, reduce.

Every run starts from or restores a checkpoint and trains to the end of the same data; the oracle is
plain single-process PyTorch over all the steps (float64). Four launches (1 x 2, 1 x 4, 2 processes of
MultiWorkerMirroredStrategy, 2 x 2), each checking several things:

- 1 x 2 starts from a plain checkpoint of step 0, saves after step 2 (global rank 0 writes);
- 1 x 4 and MultiWorkerMirroredStrategy restore that checkpoint and finish; so does the default
  strategy in this process;
- 2 x 2 starts from a plain checkpoint of step 2 (optimizer state included), saves after step 3, which
  this process restores and finishes; it also runs sg.Model.fit with a BackupAndRestore resumed after
  one epoch, a metric and strategy.reduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.testing import assert_succeeded, run_local_cluster

from ..placement.layout import tp_script
from . import tp_ckpt_script as script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
SCRIPT = Path(script.__file__)
KINDS = script.KINDS
#: the communication timeout of the job in which process 0 saves alone: its error must come within it
#: (the job's two processes, forked together, meet at their first collective well within it)
ABSENT_TIMEOUT = 10


def plain(kind: str, initial: dict):
    """Model, optimizer, distributed dataset and checkpoint under the default strategy."""
    model = tp_script.MegatronMLP()
    model.load_state_dict(initial)
    optimizer = tp_script.make_optimizer(kind, model.parameters())
    data = sg.get_strategy().experimental_distribute_dataset(DataLoader(script.samples(), batch_size=script.BATCH))
    return model, optimizer, data, sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)


def train(model, optimizer, data, ckpt, stop: int | None = None) -> list[float]:
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = tp_script.per_example_loss(model(x), y).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        ckpt.step += 1
        if ckpt.step == stop:
            break
    return losses


def launch(out: Path, workers: int, tag: str, *args: str) -> list[dict]:
    results = run_local_cluster(SCRIPT, workers, args=[str(out), "--tag", tag, *args], timeout=240)
    assert_succeeded(results)
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(workers)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tp_checkpoint")
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        initial = tp_script.MegatronMLP().state_dict()
        torch.save(initial, root / "initial.pt")
        reference = {}
        for kind in KINDS:
            model, optimizer, data, ckpt = plain(kind, initial)
            ckpt.save(root / "start0" / kind)
            batches = iter(data)   # one pass, saved in the middle
            losses = train(model, optimizer, batches, ckpt, stop=2)
            at_two = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(root / "start2" / kind)
            losses += train(model, optimizer, batches, ckpt)
            reference[kind] = {"losses": losses, "at_two": at_two, "final": model.state_dict()}
        other = tp_script.MegatronMLP(8, 12)
        sg.Checkpoint(model=other, optimizer=tp_script.make_optimizer("sgd", other.parameters())).save(root / "wrong")
        reference["fit"] = plain_fit(initial)
    finally:
        torch.set_default_dtype(torch.float32)
    out = root / "out"
    out.mkdir()
    one_by_two = launch(out, 2, "tp12", "--layout", "tp:1,2", "--start", str(root / "start0" / "{kind}"),
                        "--save", str(root / "tp12" / "{kind}"), "--save-at", "2", "--wrong", str(root / "wrong"))
    assert_succeeded(run_local_cluster(SCRIPT, 2, args=[str(out), "--tag", "tp12", "--layout", "tp:1,2", "--absent",
                                                         str(ABSENT_TIMEOUT)], timeout=240))
    one_by_four = launch(out, 4, "tp14", "--layout", "tp:1,4", "--restore", str(root / "tp12" / "{kind}"))
    mirrored = launch(out, 2, "mwms", "--layout", "mwms", "--restore", str(root / "tp12" / "{kind}"))
    two_by_two = launch(out, 4, "tp22", "--layout", "tp:2,2", "--start", str(root / "start2" / "{kind}"),
                        "--save", str(root / "tp22" / "{kind}"), "--save-at", "3", "--fit", str(root))
    return {"root": root, "reference": reference, "tp12": one_by_two, "tp14": one_by_four, "mwms": mirrored,
            "tp22": two_by_two}


def plain_fit(initial: dict) -> dict:
    model = sg.Model(tp_script.MegatronMLP())
    model.module.load_state_dict(initial)
    model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9), loss="mse",
                  metrics=["mae"])
    x, y = script.samples().tensors
    history = model.fit(x, y, batch_size=script.BATCH, epochs=2, shuffle=False, verbose=0)
    return {"history": history.history, "final": model.module.state_dict()}


def assert_params(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        torch.testing.assert_close(torch.tensor(got[name], dtype=torch.float64), value, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{what}, {name}: {m}")


def test_tensor_parallel_saves_one_logical_copy_written_by_global_rank_zero(runs) -> None:
    reference = runs["reference"]
    for tag, first in (("tp12", 0), ("tp22", 2)):
        for rank, out in enumerate(runs[tag]):
            for kind in KINDS:
                assert out[f"{kind}_is_writer"] == (rank == 0), (tag, rank)
                assert out[f"{kind}_losses"] == pytest.approx(reference[kind]["losses"][first:], rel=1e-12)
                # saving in the middle changed nothing: the run equals the uninterrupted one
                assert_params(out[f"{kind}_final"], reference[kind]["final"], f"{tag} process {rank} {kind}")
        for kind in KINDS:
            saved = Path(runs[tag][0][f"{kind}_saved"])
            assert all(out[f"{kind}_saved"] == str(saved) for out in runs[tag])
            state = torch.load(saved / "model.pt", weights_only=True)   # full tensors, plain
            assert {k: type(v) for k, v in state.items()} == {k: torch.Tensor for k in reference[kind]["final"]}
            assert state["fc1.weight"].shape == (16, 8) and state["fc2.weight"].shape == (8, 16)
            optimizer = torch.load(saved / "optimizer.pt", weights_only=True)
            moment = "momentum_buffer" if kind == "sgd" else "exp_avg"
            assert optimizer["state"][0][moment].shape == (16, 8)
            if tag == "tp12":
                for name, value in reference[kind]["at_two"].items():
                    torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-12)


def test_restored_under_other_layouts_training_goes_on_as_if_never_stopped(runs) -> None:
    reference = runs["reference"]
    for tag in ("tp14", "mwms"):
        for rank, out in enumerate(runs[tag]):
            for kind in KINDS:
                assert out[f"{kind}_restored"] == runs["tp12"][0][f"{kind}_saved"]
                assert_params(out[f"{kind}_restored_params"], reference[kind]["at_two"], f"{tag} {rank} {kind}")
                assert out[f"{kind}_steps"] == script.STEPS
                assert out[f"{kind}_losses"] == pytest.approx(reference[kind]["losses"][2:], rel=1e-12)
                assert_params(out[f"{kind}_final"], reference[kind]["final"], f"{tag} process {rank} {kind}")


@pytest.mark.parametrize("source, stop", [("tp12", 2), ("tp22", 3)])
def test_restored_by_one_plain_process(runs, source: str, stop: int) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        for kind in KINDS:
            torch.manual_seed(9)
            model, optimizer, data, ckpt = plain(kind, tp_script.MegatronMLP().state_dict())
            assert sg.CheckpointManager(ckpt, runs["root"] / source / kind).restore_or_initialize()
            assert ckpt.step == stop
            losses = train(model, optimizer, data, ckpt)
            assert losses == pytest.approx(runs["reference"][kind]["losses"][stop:], rel=1e-12)
            for name, value in runs["reference"][kind]["final"].items():
                torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_checkpoint_of_another_model_is_refused_on_every_process(runs) -> None:
    for out in runs["tp12"]:
        assert "fc1.weight" in out["wrong"] and "[12, 8]" in out["wrong"] and "[16, 8]" in out["wrong"], out["wrong"]
        assert out["wrong_unchanged"]


def test_fit_metrics_and_reduce_under_tensor_parallelism(runs) -> None:
    want = runs["reference"]["fit"]
    for rank, out in enumerate(runs["tp22"]):
        # epoch 1, then a new job resumed from its backup for epoch 2: as one uninterrupted fit
        first, resumed = out["fit_history"]
        assert first["loss"] == pytest.approx(want["history"]["loss"][:1], rel=1e-10)
        assert resumed["loss"] == pytest.approx(want["history"]["loss"][1:], rel=1e-10)
        assert resumed["mae"] == pytest.approx(want["history"]["mae"][1:], rel=1e-10)
        assert_params(out["fit_final"], want["final"], f"fit, process {rank}")
        assert out["fit_predict_shape"] == [script.STEPS * script.BATCH, 8]
        assert set(out["fit_evaluate"]) == {"loss", "mae"}
        # over the data axis: data ranks 0 and 1 give 1 and 2 (model ranks hold the same values)
        assert out["reduced"] == 3.0 and out["metric"] == 1.5


@pytest.mark.parametrize("tag, model", [("tp12", 2), ("tp22", 2), ("tp14", 4)])
def test_a_shuffled_loader_gives_a_model_group_the_same_rows(runs, tag: str, model: int) -> None:
    outs = runs[tag]
    groups = [outs[first:first + model] for first in range(0, len(outs), model)]
    for group in groups:
        assert all(out["shuffled"] == group[0]["shuffled"] for out in group), tag
    for step in range(4):   # the data groups' slices make one permutation of each batch
        rows = sorted(row for group in groups for row in group[0]["shuffled"][step])
        assert len(rows) == 4 and len(set(rows)) == 4
    assert sorted(row for group in groups for step in group[0]["shuffled"] for row in step) == list(range(16))


def test_a_process_that_does_not_save_gets_an_error_not_a_hang(runs) -> None:
    absent = json.loads((runs["root"] / "out" / "tp12-absent.json").read_text())
    error = absent["error"]
    assert error is not None and "Checkpoint.save" in error and "stopped answering" in error, error
    assert f"(timeout {ABSENT_TIMEOUT} s;" in error, error
    assert absent["seconds"] < ABSENT_TIMEOUT + 60, absent   # (not the default timeout: minutes)
