"""PipelineStrategy equals single-process PyTorch (float64) for every schedule, also clipping gradients by their
global norm, and refuses misuse everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

from stratagem.testing import assert_succeeded, run_local_cluster

from . import pp_script
from .history import assert_history_matches, check_clipping, plain_history

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(280), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(pp_script.__file__)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pipeline.py"


def reference_history(case: str, initial: dict) -> list[dict]:
    """Plain PyTorch on the whole global batch of every step (mean loss)."""
    torch.set_default_dtype(torch.float64)
    optimizer_kind = case.split(":")[1]
    try:
        model = pp_script.model_for(case)
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        optimizer = pp_script.make_optimizer(optimizer_kind, model.parameters())
        return plain_history(model, optimizer, pp_script.make_data(), pp_script.loss_fn), optimizer
    finally:
        torch.set_default_dtype(torch.float32)


def check_checkpoint(path: Path, case: str, params: dict, reference_optimizer: torch.optim.Optimizer) -> None:
    """One logical copy, as plain PyTorch files; it restores into a plain model and optimizer."""
    torch.set_default_dtype(torch.float64)
    try:
        model = pp_script.model_for(case)
        optimizer = pp_script.make_optimizer(case.split(":")[1], model.parameters())
        sg.Checkpoint(model=model, optimizer=optimizer).restore(path)
    finally:
        torch.set_default_dtype(torch.float32)
    for name, value in params.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)
    want = reference_optimizer.state_dict()["state"]
    got = optimizer.state_dict()["state"]
    assert sorted(got) == sorted(want)
    for index, state in want.items():
        for key, value in state.items():
            torch.testing.assert_close(got[index][key], value, rtol=1e-12, atol=1e-12)


def predict(case: str, params: dict) -> torch.Tensor:
    model = pp_script.model_for(case).double()
    model.load_state_dict(params)
    with torch.no_grad():
        return model(pp_script.make_data((7,))[0][0])


class FirstEpochLogs(sg.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, dict] = {}

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.seen.setdefault(batch, dict(logs))


def reference_fit(initial: dict) -> dict:
    """sg.Model.fit under the default strategy, as pp_script.fit's jobs together (float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = pp_script.compiled(sg.Model(pp_script.make_model()), ["mae"])
        model.module.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        x, y, w = pp_script.fit_data()
        steps = FirstEpochLogs()
        history = model.fit(x, y, batch_size=pp_script.FIT_BATCH, epochs=2, shuffle=False, verbose=0,
                            sample_weight=w, validation_data=(x[:12], y[:12]), callbacks=[steps])
        return {"history": history.history, "final": model.module.state_dict(), "at_step_3": steps.seen[2],
                "evaluate": model.evaluate(x, y, batch_size=pp_script.FIT_BATCH, verbose=0, return_dict=True,
                                           sample_weight=w),
                "predict": model.predict(x, batch_size=pp_script.FIT_BATCH)}
    finally:
        torch.set_default_dtype(torch.float32)


def check_fit(outputs: list[dict], printed: list[str]) -> None:
    """sg.Model.fit / evaluate / predict under the pipeline equal the default strategy's, on every process."""
    want = reference_fit(outputs[0]["fit"]["initial"])
    saved = pp_script.make_model().double()
    sg.Checkpoint(model=saved).restore(outputs[0]["fit"]["saved"])   # ModelCheckpoint's one logical copy
    for rank, result in enumerate(outputs):
        out = result["fit"]
        assert set(out["stopped_logs"]) == {"loss"}   # the loss tracker only: no outputs travel
        assert out["stopped_logs"]["loss"] == pytest.approx(want["at_step_3"]["loss"], rel=1e-10)
        for name, value in want["final"].items():
            torch.testing.assert_close(torch.tensor(out["final"][name], dtype=torch.float64), value,
                                       rtol=1e-12, atol=1e-12, msg=lambda m: f"fit, process {rank}, {name}: {m}")
            torch.testing.assert_close(saved.state_dict()[name], value, rtol=1e-12, atol=1e-12)
        # the resumed job's second epoch: the loss, the metric and validation over every global batch
        for key in ("loss", "mae", "val_loss", "val_mae"):
            assert out["history"][key][-1] == pytest.approx(want["history"][key][-1], rel=1e-10), (rank, key)
        assert out["evaluate"] == pytest.approx(want["evaluate"], rel=1e-10)
        torch.testing.assert_close(torch.tensor(out["predict"], dtype=torch.float64), want["predict"])
        # progress lines: the chief (global rank 0) only
        assert ("Epoch 2/2" in printed[rank]) == (rank == 0), printed[rank][-2000:]


def run_and_compare(tmp_path: Path, data: int, pipe: int, cases: list[str], *, fit: bool = False,
                    clip: tuple[str, ...] = ()) -> list[dict]:
    workers = data * pipe
    results = run_local_cluster(SCRIPT, workers, args=[str(tmp_path), "--mesh", f"{data},{pipe}",
                                                       "--cases", ",".join(cases), *(["--fit"] if fit else []),
                                                       "--clip", ",".join(clip)], timeout=250)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(workers)]
    if fit:
        check_fit(outputs, [r.output for r in results])
    for case in cases:
        total = sum(p.numel() for p in pp_script.model_for(case).parameters())
        expected, reference_optimizer = reference_history(case, outputs[0][case]["initial"])
        check_checkpoint(tmp_path / f"ckpt-{case.replace(':', '-')}", case, expected[-1]["params"],
                         reference_optimizer)
        predicted = predict(case, expected[-1]["params"])
        held = {}
        for rank, result in enumerate(outputs):
            out = result[case]
            assert out["num_replicas"] == data
            assert out["initial"] == outputs[0][case]["initial"], f"{case}: process {rank} did not start alike"
            assert out["optimizer_params"] == out["held_params"] > 0 and out["optimizer_meta_state"] == 0
            held[rank % pipe] = (out["stages"], out["held_params"])
            assert_history_matches(out["history"], expected, f"{case}, process {rank}")
            assert out["after_round_trip"] == out["history"][-1]["params"]
            torch.testing.assert_close(torch.tensor(out["predict"], dtype=torch.float64), predicted)
            for index, state in reference_optimizer.state_dict()["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(torch.tensor(out["optimizer_state"][str(index)][key],
                                                            dtype=torch.float64), value, rtol=1e-12, atol=1e-12)
            assert len(out["optimizer_state"]) == len(reference_optimizer.state_dict()["state"])
            assert out["restored"] == out["history"][-1]["params"], f"{case}: restored into another layout"
            assert out["restored_optimizer"] == out["optimizer_state"]
            if pipe > 1:
                assert "holds only stage(s)" in out["direct_call"] and "forward_backward" in out["direct_call"]
        # every stage is held once along the pipe axis; no process holds the whole model
        stages = sorted(s for s, _ in held.values() for s in s)
        assert stages == list(range(len(stages))) and len(stages) >= pipe
        assert sum(count for _, count in held.values()) == total
    for case in clip:   # clip_grad_norm_ / clip_grad_value_ between forward_backward and step
        for rank, result in enumerate(outputs):
            check_clipping(result["clipping"][case], pp_script.make_model,
                           lambda params: pp_script.make_optimizer(case.split(":")[1], params), pp_script.clip_data(),
                           pp_script.loss_fn, f"clipping {case}, process {rank}")
    for rank, result in enumerate(outputs):
        errors = result["errors"]
        assert "'fc9' names no child" in errors["missing"]
        assert "needs 9 stages" in errors["too_many_stages"] and "only 8 children" in errors["too_many_stages"]
        assert "'blocks.9' names no module of the Tokens" in errors["traced_missing"]
        assert "longest nn.ModuleList of the Tokens ('blocks') has only 1" in errors["traced_too_many"]
        assert "could not trace the Branches with torch.export" in errors["data_dependent"]
        assert "nn.Sequential(embedding, *blocks, head)" in errors["data_dependent"]
        assert "used by several stages" in errors["tied"] and "embed.weight" in errors["tied"]
        assert f"has {3 * workers} processes, but the cluster has {workers}" in errors["mesh"]
        assert "schedule must be one of" in errors["schedule"] and "'pipedream'" in errors["schedule"]
        assert f"needs a multiple of {pipe} stages" in errors["interleaved_stages"]
        assert f"needs {2 * pipe} stages" in errors["zero_bubble_stages"]
        if workers > 1:
            assert "different PipelineStrategy configurations" in errors["different"]
        if pipe > 1:
            assert "got batches of different shapes" in errors["different_batches"]
    return outputs


def test_every_schedule_on_two_stages_processes(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 2, ["gpipe:sgd", "1f1b:adam", "interleaved:sgd", "zero_bubble:adam",
                                     "split:adam", "traced-gpipe:sgd", "traced-1f1b:adam", "traced-interleaved:sgd"],
                    fit=True, clip=("1f1b:sgd", "interleaved:adam"))


def test_pipeline_by_data_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, 2, ["interleaved:adam", "traced-1f1b:sgd"], fit=True, clip=("gpipe:adam",))


def test_example_runs_as_its_docstring_says() -> None:
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLE), "--steps", "10",
               "--schedule", "interleaved", "--traced"]   # (the nn.Sequential form: in pp_script)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[worker 0] step 10" in proc.stdout and "[worker 1] step 10" in proc.stdout, proc.stdout
    assert "stages [0, 2] of pipe rank 0" in proc.stdout and "stages [1, 3] of pipe rank 1" in proc.stdout
    assert "[worker 0] held-out loss" in proc.stdout and "[worker 1] held-out loss" in proc.stdout


def test_four_stages_processes_with_middle_stages(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 4, ["1f1b:sgd", "zero_bubble:adam"])


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_pipeline_peer_lost_mid_training_stops_the_other_with_a_clear_error(tmp_path: Path, how: str) -> None:
    """SIGKILL or SIGSTOP of the second stage's process at step 3: the first stage's step fails with an
    UnavailableError naming it, within the communication timeout, and applies nothing to its stage."""
    from . import pp_fault_script

    results = run_local_cluster(Path(pp_fault_script.__file__), 2, args=[str(tmp_path), how], timeout=150)
    first, second = results
    assert "losing at step 3" in second.output and "step 3 done" not in second.output
    assert first.returncode == 3, first.output
    out = json.loads((tmp_path / "rank0.json").read_text())
    assert out["step"] == 3 and out["type"] == "UnavailableError", out
    assert "the pipeline schedule" in out["error"] and "worker 1" in out["error"], out["error"]
    assert out["seconds"] < pp_fault_script.TIMEOUT + 60, out
    assert out["unchanged"], "the failed step changed the first stage's parameters"
