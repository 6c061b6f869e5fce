"""``stratagem demo``: in-process runs per strategy, the real command, and its usage errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import stratagem as sg
from stratagem.cli import main
from stratagem.demo import ShuffledBatches, format_result, max_relative_difference, run_demo

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("strategy, replicas", [
    ("mirrored", 2),
    ("mirrored", 3),      # 64 -> 22/21/21 and the last batch 29 -> 10/10/9
    ("one_device", 1),
    ("default", 1),
])
def test_demo_matches_plain_pytorch(strategy: str, replicas: int) -> None:
    result = run_demo(strategy=strategy, replicas=replicas, epochs=1, progress=False)
    assert result.passed, format_result(result)
    assert result.max_rel_diff < 1e-4
    assert result.num_replicas == replicas
    assert result.steps == 23          # ceil(1437 / 64): the last batch is uneven
    assert result.accuracy == pytest.approx(result.reference_accuracy, abs=1 / 360)
    assert result.accuracy > 0.5       # one epoch: well above chance (0.1)
    assert not sg.has_strategy()       # the demo leaves no scope behind


def test_demo_adam_with_empty_replica_slices() -> None:
    # 5 rows over 8 replicas: replicas 5..7 get empty slices and still take part in each step.
    result = run_demo(replicas=8, batch_size=5, epochs=1, optimizer="adam", lr=1e-3, progress=False)
    assert result.passed, format_result(result)


def test_demo_restores_thread_count() -> None:
    before = torch.get_num_threads()
    run_demo(strategy="one_device", epochs=1, progress=False)
    assert torch.get_num_threads() == before


def test_run_demo_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        run_demo(replicas=0, progress=False)
    with pytest.raises(ValueError, match="unknown strategy 'tpu'; choose one of mirrored"):
        run_demo(strategy="tpu", progress=False)


def test_too_many_replicas_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--replicas", "100"]) == 2
    assert "use 64 or fewer" in capsys.readouterr().err


def test_shuffled_batches_depend_on_epoch_only() -> None:
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    batches = ShuffledBatches(x, y, batch_size=4, seed=3)
    batches.set_epoch(1)
    first, again = [b[1] for b in batches], [b[1] for b in batches]
    batches.set_epoch(2)
    other = [b[1] for b in batches]
    assert [len(b) for b in first] == [4, 4, 2]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_max_relative_difference() -> None:
    ref = {"w": torch.tensor([2.0, -4.0]), "b": torch.zeros(3)}
    assert max_relative_difference(ref, ref) == 0.0
    assert max_relative_difference({"w": torch.tensor([2.0, -4.4]), "b": torch.zeros(3)}, ref) \
        == pytest.approx(0.1)
    assert max_relative_difference({"w": ref["w"], "b": torch.full((3,), float("nan"))}, ref) == float("inf")


def test_command_line_quiet_run() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "stratagem", "demo", "--epochs", "1", "--quiet"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "test accuracy" in completed.stdout
    assert "PASS" in completed.stdout
    assert "train:" not in completed.stderr        # --quiet: no progress bar


def test_command_line_header_and_bar(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "1", "--replicas", "3"]) == 0
    captured = capsys.readouterr()
    assert "MirroredStrategy, 3 replicas on cpu:0, cpu:1, cpu:2" in captured.out
    assert "last batch 29 -> 10/10/9" in captured.out
    assert "equivalence     PASS" in captured.out
    assert "23/23" in captured.err                 # the tqdm bar, on stderr


@pytest.mark.parametrize("argv, message", [
    (["demo", "--replicas", "0"], "--replicas: must be a positive integer (1 or more), got 0; e.g. 2"),
    (["demo", "--epochs", "two"], "--epochs: expected a positive integer, got 'two'"),
    (["demo", "--lr", "-1"], "--lr: must be a positive number, got -1"),
    (["demo", "--strategy", "tpu"], "invalid choice: 'tpu'"),
    (["demo", "--strategy", "one_device", "--replicas", "2"], "--replicas applies to --strategy mirrored only"),
])
def test_bad_flags_exit_non_zero_with_a_message(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err
