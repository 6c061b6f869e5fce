"""The gradient contract under the mesh strategies (four real processes, float64): when ``backward()``
or ``forward_backward()`` returns, every process's ``.grad`` holds the whole global batch's gradient of
the parameters it holds, summed over the data axis -- as plain PyTorch on the whole batch, on both data
ranks alike -- so a NaN check and ``clip_grad_norm_`` read the same everywhere; several passes before a
step accumulate exactly, ``no_sync`` (and DDP's ``require_backward_grad_sync``) keeps this data group's
own part, and the step does not sum again. Under ZeRO-2 over the data axis ``.grad`` is None (the sum
lives in each data rank's range), and the step equals plain PyTorch's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stratagem.testing import assert_succeeded, run_local_cluster

from . import mesh_contract_script as script
from ..layout import pp_script, tp_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def plain(make_model, loss_fn, initial: dict, data: list) -> list[dict]:
    """The script's steps in plain PyTorch on the whole global batches."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_model()
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps = []
        for s, passes in enumerate(script.STEPS):
            optimizer.zero_grad()
            record = {}
            for kind, (x, y) in zip([p for p in passes if p != "clip"], data[2 * s:2 * s + 2]):
                loss_fn(model(x), y).backward()
                if kind == "local":
                    record["local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            record["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if "clip" in passes:
                record["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), script.MAX_NORM).item()
            optimizer.step()
            record["params"] = {k: v.clone() for k, v in model.state_dict().items()}
            steps.append(record)
        return steps
    finally:
        torch.set_default_dtype(torch.float32)


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(got, want, where: str) -> None:
    torch.testing.assert_close(got if isinstance(got, torch.Tensor) else f64(got), want, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"{where}: {m}")


def check(case: str, outputs: list[dict], want: list[dict]) -> None:
    for rank, result in enumerate(outputs):
        out = result[case]
        assert out["initial"] == outputs[0][case]["initial"], f"{case}: process {rank} did not start alike"
        partner = outputs[rank ^ 2][case]   # the other data rank, same place on the other axis
        for s, (got, expected) in enumerate(zip(out["steps"], want)):
            where = f"{case}, process {rank}, step {s}"
            assert got["grads"], f"{where}: no parameters held"
            assert got["finite"] is True, where
            for name, grad in got["grads"].items():
                if case == "zero2":   # reduce-scattered into the ranges: no whole gradient in .grad
                    assert grad is None, f"{where}, {name}"
                else:
                    close(grad, expected["grads"][name], f"{where}, {name} after backward")
            if "local" in expected:   # no_sync: each data group's own part; both parts sum to the batch's
                for name, mine in got["local"].items():
                    theirs = partner["steps"][s]["local"][name]
                    close(f64(mine) + f64(theirs), expected["local"][name], f"{where}, {name} under no_sync")
                    assert not torch.equal(f64(mine), expected["local"][name]), f"{where}: summed in no_sync"
            if "norm" in expected:
                assert got["norm"] == pytest.approx(expected["norm"], rel=1e-12), where
                assert expected["norm"] > script.MAX_NORM   # it clips
            for name, value in expected["params"].items():
                close(got["params"][name], value, f"{where}, {name} after the step")


def test_grad_after_backward_is_the_global_batchs_on_every_process(tmp_path: Path) -> None:
    results = run_local_cluster(Path(script.__file__), 4, args=[str(tmp_path)], timeout=270)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    check("tp", outputs, plain(tp_script.NormedMLP, lambda out, y: tp_script.per_example_loss(out, y).mean(),
                               outputs[0]["tp"]["initial"], script.batches(8, 8)))
    for name, _, _ in script.PIPELINES:
        check(name, outputs, plain(pp_script.make_model, pp_script.loss_fn, outputs[0][name]["initial"],
                                   script.batches(6, 3)))
        if name != "plan":   # processes 0 and 1: the pipe axis, each stage held once
            stages = sorted(s for r in range(2) for s in outputs[r][name]["stages"])
            assert stages == list(range(len(stages))) and len(stages) >= 2, (name, stages)
