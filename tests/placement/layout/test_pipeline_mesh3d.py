"""PipelineStrategy on a 3-D mesh (data x pipe x model): tensor parallelism inside each stage, ZeRO over
the data axis, equal to plain one-process PyTorch (float64).

Two launches of ``mesh3d_script.py`` under ``stratagem launch``:

- 8 processes, 2 x 2 x 2, with ``--max-restarts 1``: ``sg.Model.fit`` (FSDP over the data axis, a
  metric, BackupAndRestore) whose job loses a process (SIGKILL) in the second epoch and is restarted by
  the launcher; then SGD and Adam under each ZeRO stage on the data axis, with ``clip_grad_norm_``
  every step; a checkpoint saved and restored under another ZeRO stage; the refused configurations;
- 2 processes: the checkpoint restored under 1 x 2 x 1 and under MultiWorkerMirroredStrategy.

The oracle is plain PyTorch in this process over the whole global batches; the checkpoint also restores
into a plain model here.
"""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.launch import launch_local

from . import mesh3d_script as script

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(script.__file__)
EXAMPLE_3D = Path(__file__).resolve().parents[3] / "examples" / "pipeline_3d.py"


def _launch(out: Path, workers: int, *args: str, max_restarts: int = 0) -> str:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, [str(out), *args], num_workers=workers, max_restarts=max_restarts,
                          stdout=stdout, stderr=stderr, join_timeout=240)
    output = stdout.getvalue() + stderr.getvalue()
    assert status == 0, output[-8000:]
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("mesh3d")
    printed = _launch(out, 8, "main", max_restarts=1)
    main = [json.loads((out / f"main-rank{r}.json").read_text()) for r in range(8)]
    saved = main[0]["train"]["parameters:adam"]["saved"]
    _launch(out, 2, "restore", "--saved", saved)
    restore = [json.loads((out / f"restore-rank{r}.json").read_text()) for r in range(2)]
    return {"main": main, "restore": restore, "printed": printed, "saved": saved}


def _float64(fn):
    torch.set_default_dtype(torch.float64)
    try:
        return fn()
    finally:
        torch.set_default_dtype(torch.float32)


def plain_training(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float], list[float]]:
    """The script's steps in one process on the whole batches: losses, norms (clipping every step)."""
    model = script.make_model()
    optimizer = script.make_optimizer(kind, model.parameters())
    losses, norms = [], []
    for i, (x, y) in enumerate(script.make_data()):
        optimizer.zero_grad()
        loss = script.loss_fn(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), script.MAX_NORMS[i],
                                                    2.0 if i % 2 == 0 else math.inf).item())
        optimizer.step()
        losses.append(loss.item())
    return model, optimizer, losses, norms


def train_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    losses = []
    for x, y in script.make_data((8,) * script.MORE, seed=9):
        optimizer.zero_grad()
        loss = script.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_params(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        torch.testing.assert_close(torch.tensor(got[name], dtype=torch.float64), value, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{where}, {name}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", [None, "optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_every_zero_stage_equals_plain_pytorch_with_clipping(runs, sharding, kind) -> None:
    model, _, losses, norms = _float64(lambda: plain_training(kind))
    assert norms[0] > script.MAX_NORMS[0]   # the clipping clips
    want = model.state_dict()
    for rank, result in enumerate(runs["main"]):
        out = result["train"][f"{sharding}:{kind}"]
        where = f"{sharding}:{kind}, rank {rank}"
        assert out["losses"] == pytest.approx(losses, rel=1e-10), where
        assert out["norms"] == pytest.approx(norms, rel=1e-10), where
        assert_params(out["final"], want, where)
    # the rank order: data outermost, then pipe, model innermost
    for rank, result in enumerate(runs["main"]):
        out = result["train"][f"{sharding}:{kind}"]
        assert out["model_rank"] == rank % 2
        stages = [0, 2] if sharding == "parameters" else [0]   # (interleaved: two stages per process)
        assert out["stages"] == [s + (rank // 2) % 2 for s in stages], (rank, out["stages"])
        if sharding in (None, "optimizer"):
            # the gradients summed over the data axis, kept once: every .grad (a split layer's DTensor too)
            # views the packs of sums, which hold this process's gradients and one flag per parameter
            held = out["bytes"]
            assert held["parameters"] < held["gradients"] <= held["parameters"] + 8 * held["tensors"], (rank, held)


@pytest.mark.multiprocess
def test_checkpoint_is_one_logical_copy_restored_under_every_layout(runs) -> None:
    """Written under 2 x 2 x 2 with ZeRO-3: restored into a plain model here, under 2 x 2 x 2 with ZeRO-2,
    under 1 x 2 x 1 and under MultiWorkerMirroredStrategy; each trains on as plain PyTorch does."""
    model, optimizer, _, _ = _float64(lambda: plain_training("adam"))
    torch.set_default_dtype(torch.float64)
    try:
        plain = script.make_model()
        plain_optimizer = script.make_optimizer("adam", plain.parameters())
        sg.Checkpoint(model=plain, optimizer=plain_optimizer).restore(runs["saved"])
        for name, value in model.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-12, atol=1e-12)
        want_state, got_state = optimizer.state_dict()["state"], plain_optimizer.state_dict()["state"]
        assert sorted(got_state) == sorted(want_state)
        for index, entry in want_state.items():
            for key, value in entry.items():
                torch.testing.assert_close(got_state[index][key], value, rtol=1e-12, atol=1e-12)
        losses = train_on(model, optimizer)
        want = model.state_dict()
    finally:
        torch.set_default_dtype(torch.float32)
    layouts = [(f"2x2x2 gradients, rank {r}", out["restored_3d"]) for r, out in enumerate(runs["main"])]
    layouts += [(f"{kind}, rank {r}", out[kind]) for r, out in enumerate(runs["restore"])
                for kind in ("pipeline", "mirrored")]
    for where, out in layouts:
        assert out["losses"] == pytest.approx(losses, rel=1e-10), where
        assert_params(out["final"], want, where)


@pytest.mark.multiprocess
def test_fit_resumes_after_a_process_is_killed(runs) -> None:
    """The launcher restarted the job once (rank 5 SIGKILLed itself at the first epoch's last step); the
    resumed fit equals the default strategy's uninterrupted fit, on every process."""
    printed = runs["printed"]
    assert "[worker 5] restart 0 epoch 0 batch 2" in printed and "restart 0 epoch 1" not in printed
    # the backup after the second step: one step of the first epoch is left (the callback counts it batch 0)
    assert "[worker 5] restart 1 epoch 0 batch 0" in printed and "restart 1 epoch 0 batch 1" not in printed
    assert all(result["restart"] == 1 for result in runs["main"])

    def reference():
        model = script.compiled(sg.Model(script.make_model()))
        x, y = script.fit_data()
        history = model.fit(x, y, batch_size=script.FIT_BATCH, epochs=2, shuffle=False, verbose=0)
        return history.history, model.module.state_dict(), model.evaluate(
            x, y, batch_size=script.FIT_BATCH, verbose=0, return_dict=True)
    history, final, evaluated = _float64(reference)
    for rank, result in enumerate(runs["main"]):
        out = result["fit"]
        for key in ("loss", "accuracy"):
            assert out["history"][key][-1] == pytest.approx(history[key][-1], rel=1e-10), (rank, key)
        assert out["evaluate"] == pytest.approx(evaluated, rel=1e-10), rank
        assert_params(out["final"], final, f"fit, rank {rank}")


@pytest.mark.multiprocess
def test_misuse_is_refused_on_every_process(runs) -> None:
    for rank, result in enumerate(runs["main"]):
        errors = result["errors"]
        assert "has 12 processes, but the cluster has 8" in errors["mesh"]
        assert "no tensor-parallel plan" in errors["no_plan"]
        assert "names '7.mlp.0', but no stage" in errors["absent"]
        assert "'5.norm' is a LayerNorm" in errors["style"]   # (a module of the other stage)
        assert "needs 4 stages" in errors["stages"]
        assert "multiple of 2" in errors["interleaved"]
        assert "needs the model as an nn.Sequential" in errors["traced"]
        assert "different PipelineStrategy configurations" in errors["different"]
        assert errors["again"] is None   # a forward_backward after the clip adds to the clipped sum, as in torch
        assert "LBFGS does not allow" in errors["not_elementwise"]


def test_mesh_sizes_are_inferred_axis_by_axis() -> None:
    from stratagem.errors import InvalidArgumentError
    from stratagem.strategies.mesh import mesh_shape
    axes = ("data", "pipe", "model")
    assert mesh_shape({"data": 2, "pipe": 2, "model": 2}, 8, axes) == (2, 2, 2)
    assert mesh_shape({"pipe": 2, "model": 2}, 8, axes) == (2, 2, 2)       # data: the processes left
    assert mesh_shape({"data": 2, "model": 2}, 8, axes) == (2, 2, 2)       # pipe: the processes left
    assert mesh_shape({"model": 4}, 8, axes) == (1, 2, 4)                  # neither: data 1
    assert mesh_shape({"data": 4, "pipe": 2}, 8, axes) == (4, 2, 1)        # model: 1 unless given
    assert mesh_shape(None, 8, axes) == (1, 8, 1)
    with pytest.raises(InvalidArgumentError, match="gives 12 processes, which does not divide the 8"):
        mesh_shape({"pipe": 3, "model": 4}, 8, axes)
    with pytest.raises(InvalidArgumentError, match=r"\{'data': 2, 'pipe': 2, 'model': 1\} has 4 processes"):
        mesh_shape({"data": 2, "pipe": 2}, 8, axes)


def test_every_data_group_can_pad_to_the_longest_batch() -> None:
    from stratagem.placement.layout.pipeline_schedule import _row_order
    assert _row_order(4, 2, 4) is None
    assert _row_order(3, 2, 4).tolist() == [0, 1, 2, -1]          # 2 micro-batches of 2 rows, as the longest
    assert _row_order(2, 2, 5).tolist() == [0, -1, -1, 1, -1, -1]  # 2 of 3


@pytest.mark.multiprocess
def test_three_axes_example_runs_as_its_docstring_says() -> None:
    # docs/pipeline.md's example, complete: a token embedding split "rowwise" and a per-token loss. torch's
    # RowwiseParallel() would gather the token ids along the sequence, so that the logits of a (4, 16)
    # micro-batch came as (4 * 32, vocab) against 4 * 16 targets on every mesh with a model axis. Run on
    # 1 x 2 x 2 and 2 x 1 x 2 (4 processes each; 2 x 2 x 2 needs 8, which the tests above already start), each
    # against the one-process run (float32, so the printed losses to 1e-3).
    def run(*command: str) -> str:
        proc = subprocess.run([*command, "--steps", "10"], capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    def losses(output: str, worker: int | None = None) -> list[float]:
        prefix = "" if worker is None else rf"\[worker {worker}\] "
        found = re.findall(rf"^{prefix}(?:step \d+|held-out) loss ([0-9.]+)", output, re.M)
        assert len(found) == 3, output   # steps 1 and 10, held out
        return [float(value) for value in found]

    alone = losses(run(sys.executable, str(EXAMPLE_3D), "--data", "1", "--pipe", "1", "--model", "1"))
    assert alone[1] < alone[0] - 1.0, alone   # it learns
    for axis in ("--data", "--pipe"):
        output = run(sys.executable, "-m", "stratagem", "launch", "--workers", "4", str(EXAMPLE_3D), axis, "1")
        for worker in range(4):
            assert losses(output, worker) == pytest.approx(alone, abs=1e-3), (axis, output)


def test_three_axes_example_is_the_documented_one() -> None:
    # docs/pipeline.md shows the example's strategy and model: every line of that block is in the script (the
    # mesh's sizes there come from the command line)
    document = (Path(__file__).resolve().parents[3] / "docs" / "pipeline.md").read_text()
    block = re.search(r"```text\n(def loss_fn.*?)```", document, re.S).group(1)
    script = {line.split("#")[0].strip() for line in EXAMPLE_3D.read_text().splitlines()}
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    missing = [line for line in lines if line and line not in script and not line.startswith("mesh=")]
    assert not missing, missing
