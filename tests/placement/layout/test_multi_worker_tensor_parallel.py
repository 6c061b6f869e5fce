"""TensorParallelStrategy equals single-process PyTorch (float64), also clipping gradients by their global
norm, and refuses misuse on every process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratagem.testing import assert_succeeded, run_local_cluster

from ..._support import clips
from . import tp_embedding_script, tp_script
from .history import assert_history_matches, check_clipping, plain_history

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(tp_script.__file__)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tensor_parallel.py"


def reference_history(optimizer_kind: str, initial: dict) -> list[dict]:
    torch.set_default_dtype(torch.float64)
    try:
        model = tp_script.MegatronMLP()
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        optimizer = tp_script.make_optimizer(optimizer_kind, model.parameters())
        return plain_history(model, optimizer, tp_script.make_data(),
                             lambda out, y: tp_script.per_example_loss(out, y).mean()), optimizer
    finally:
        torch.set_default_dtype(torch.float32)


def run_and_compare(tmp_path: Path, data: int, model: int, optimizer: str) -> list[dict]:
    workers = data * model
    results = run_local_cluster(SCRIPT, workers, args=[str(tmp_path), "--mesh", f"{data},{model}",
                                                       "--optimizer", optimizer], timeout=170)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(workers)]
    expected, reference_optimizer = reference_history(optimizer, outputs[0]["initial"])
    want_state = reference_optimizer.state_dict()["state"]
    for rank, out in enumerate(outputs):
        assert out["num_replicas"] == data and out["model_rank"] == rank % model
        assert out["sharded"] == "DTensor" and out["local_rows"] == 16 // model
        assert out["initial"] == outputs[0]["initial"], f"process {rank} did not start from the chief's values"
        assert_history_matches(out["history"], expected, f"process {rank}")
        assert out["after_round_trip"] == out["history"][-1]["params"]
        for index, state in out["optimizer_state"].items():
            for key, value in state.items():
                torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), want_state[int(index)][key],
                                           rtol=1e-12, atol=1e-12)
        check_clipping(out["clipping"], tp_script.NormedMLP, lambda params: tp_script.make_optimizer(optimizer, params),
                       tp_script.make_data(len(clips.STEPS)), lambda out, y: tp_script.per_example_loss(out, y).mean(),
                       f"process {rank}")
        errors = out["errors"]
        assert "no module created in scope has that name" in errors["missing"] and "'fc1'" in errors["missing"]
        assert "unknown style 'diagonal'" in errors["style"]
        assert f"has {(data + 1) * model} processes, but the cluster has {workers}" in errors["mesh"]
        if model > 1:
            assert "out_features (15)" in errors["indivisible"]
    return outputs


def test_one_data_by_two_model_with_sgd(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 2, "sgd")


def test_two_data_by_two_model_with_adam(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, 2, "adam")


def test_a_split_embedding_looks_up_the_whole_batch_of_token_ids(tmp_path: Path) -> None:
    # torch's RowwiseParallel() takes its input as this process's share of the last dimension: on an
    # Embedding it would gather the token ids along the sequence ((4, 5) ids looked up as (4, 10)), which a
    # per-token loss refuses and a loss averaged over the tokens hides. "rowwise" gives an Embedding its ids
    # whole, as "colwise" and RowwiseParallel(input_layouts=Replicate()) do.
    script = Path(tp_embedding_script.__file__)
    results = run_local_cluster(script, 2, args=[str(tmp_path)], timeout=170)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for name in tp_embedding_script.PLANS:
        model = tp_embedding_script.make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        expected = plain_history(model, optimizer, tp_embedding_script.make_data(),
                                 lambda logits, y: tp_embedding_script.per_token_loss(logits, y).mean())
        for rank, out in enumerate(outputs):
            assert out[name]["initial"] == outputs[0][name]["initial"]
            assert_history_matches(out[name]["history"], expected, f"plan {name!r}, process {rank}")
    for out in outputs:
        errors = out["errors"]
        assert "input_layouts=Shard(dim=-1)" in errors["RowwiseParallel()"], errors
        assert "pass RowwiseParallel(input_layouts=Replicate(), ...)" in errors["RowwiseParallel()"], errors
        assert "plan entry 'embed' is 'sequence' on an nn.Embedding" in errors["sequence"], errors


def test_example_runs_as_its_docstring_says() -> None:
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLE), "--steps", "10"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[worker 0] step 10" in proc.stdout and "[worker 1] step 10" in proc.stdout, proc.stdout
