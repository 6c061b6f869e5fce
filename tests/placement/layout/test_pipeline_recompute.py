"""PipelineStrategy(recompute=...) trains exactly as plain PyTorch (float64, 2 real processes) on every schedule
of tests/placement/layout/test_multi_worker_pipeline.py, for an nn.Sequential and a traced model, the whole stage or named modules;
with dropout it equals the run without recomputation (the random state is replayed); the activations held
between forward and backward shrink; misuse is refused on every process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .history import assert_history_matches

from . import pp_options_script as script
from .pp_options_runs import as_expected, launch, plain_history

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_recompute_equals_plain_pytorch_and_the_run_without_it(tmp_path: Path) -> None:
    outputs, printed = launch(tmp_path, "recompute")
    for case, (model_name, kind, _) in script.RECOMPUTE.items():
        expected, predicted = plain_history(model_name, kind, outputs[0][case]["initial"])
        for rank, result in enumerate(outputs):
            out = result[case]
            assert out["initial"] == outputs[0][case]["initial"], f"{case}: process {rank} did not start alike"
            assert_history_matches(out["history"], expected, f"{case}, process {rank}")
            if "predict" in out:   # (nn.Sequential models)
                torch.testing.assert_close(torch.tensor(out["predict"], dtype=torch.float64), predicted,
                                           rtol=1e-12, atol=1e-12)
    for case in script.DROPOUT:
        for rank, result in enumerate(outputs):
            with_, without = result[case]["with"], result[case]["without"]
            assert with_["initial"] == without["initial"]
            # the masks differ from step to step (else this would prove little) and are replayed exactly
            assert with_["history"][0]["loss"] != with_["history"][1]["loss"]
            assert_history_matches(with_["history"], as_expected(without["history"]), f"{case}, process {rank}")
            # the activations inside the recomputed regions were not held between forward and backward
            assert 0 < with_["peak"] < 0.7 * without["peak"], (case, rank, with_["peak"], without["peak"])
    for rank, result in enumerate(outputs):
        errors = result["errors"]
        assert "different PipelineStrategy configurations" in errors["mismatch_recompute"], errors["mismatch_recompute"]
        assert "recompute must be True or 'stage'" in errors["recompute_value"] and "got 5" in errors["recompute_value"]
        assert "recompute names '9', which is no submodule of the Sequential" in errors["recompute_missing"]
        assert "recompute names ['unused'], which no stage of the Tokens calls" in errors["recompute_uncalled"]
    assert all(any(line.startswith(f"case {case} done") for line in printed[rank]) for case in script.RECOMPUTE for rank in printed)
