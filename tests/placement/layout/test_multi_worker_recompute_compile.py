"""Checkpointed blocks and a compiled model under MultiWorkerMirroredStrategy (2 real worker
processes, gloo over loopback) train as plain single-device PyTorch does on the whole batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stratagem.testing import assert_succeeded, run_local_cluster

from . import tiny_gpt
from .history import assert_history_matches

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).with_name("recompute_script.py")   # imports tiny_gpt from its folder
BATCHES = [8, 8, 6]   # 6 rows over 2 workers with 2 replicas each: 2/2/1/1
CLIP = 2.0            # recompute_script.CLIP


def run_and_compare(tmp_path: Path, modes: list[str], replicas_per_worker: int, timeout: float) -> None:
    args = [str(tmp_path), "--modes", ",".join(modes), "--replicas-per-worker", str(replicas_per_worker),
            "--batches", ",".join(map(str, BATCHES))]
    results = run_local_cluster(SCRIPT, 2, args=args, timeout=timeout)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, out in enumerate(outputs):
        assert out["num_replicas"] == 2 * replicas_per_worker
        for mode in modes:
            got, chief = out["modes"][mode], outputs[0]["modes"][mode]
            assert got["initial"] == chief["initial"], f"worker {rank} did not start from the chief's values"
            kind, _, clip = mode.partition("+")
            model = tiny_gpt.make_model(shared_blocks=kind == "shared")
            model.load_state_dict({k: torch.tensor(v, dtype=tiny_gpt.DTYPE) for k, v in chief["initial"].items()})
            expected = tiny_gpt.plain_history(model, tiny_gpt.make_batches(BATCHES), clip=CLIP if clip else None,
                                              twice=kind == "twice")
            where = f"worker {rank}, {mode}"
            if clip:   # every replica's clip_grad_norm_ saw the global batch's gradient norm
                for step, (got_step, want) in enumerate(zip(got["history"], expected)):
                    assert want["norm"] > CLIP
                    assert got_step["norms"] == pytest.approx([want["norm"]] * replicas_per_worker, rel=1e-9), \
                        f"{where}, step {step}"
            if kind == "compile":
                # inductor fuses float64 operations in another order than eager PyTorch
                _assert_close_history(got["history"], expected, where, tolerance=1e-9)
                # steps 0 and 1 have the same shapes: nothing compiled again (the last, smaller batch may be)
                assert 0 < got["graphs"][0] == got["graphs"][1], f"{where}: graphs after each step {got['graphs']}"
            else:
                assert_history_matches(got["history"], expected, where)


def _assert_close_history(history: list[dict], expected: list[dict], where: str, tolerance: float) -> None:
    assert len(history) == len(expected), where
    for step, (got, want) in enumerate(zip(history, expected)):
        assert got["loss"] == pytest.approx(want["loss"], rel=tolerance), f"{where}, step {step}"
        for name, value in want["params"].items():
            torch.testing.assert_close(torch.tensor(got["params"][name], dtype=value.dtype), value,
                                       rtol=tolerance, atol=tolerance,
                                       msg=lambda m: f"{where}, step {step}, {name}: {m}")


@pytest.mark.timeout(450)
def test_two_workers_checkpointed_and_compiled(tmp_path: Path) -> None:
    run_and_compare(tmp_path, ["reentrant", "nonreentrant+clip", "shared+clip", "twice+clip", "compile"],
                    replicas_per_worker=1, timeout=400)


@pytest.mark.timeout(600)
def test_two_workers_two_replicas_compiled_and_checkpointed(tmp_path: Path) -> None:
    run_and_compare(tmp_path, ["compile+clip", "reentrant", "shared+clip", "twice"], replicas_per_worker=2,
                    timeout=560)
