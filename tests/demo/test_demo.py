"""``stratagem demo``: in-process runs per strategy, the real command, and its usage errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import stratagem as sg
from stratagem.cli import main
from stratagem.demo import (DemoResult, ShuffledBatches, TrainConfig, format_result, max_relative_difference,
                            run_demo)
from stratagem.demo.cluster import ClusterDemoError, run_cluster_demo
from stratagem.testing import run_task

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("forked_launches")]


@pytest.mark.parametrize("strategy, replicas", [
    ("mirrored", 2),
    ("mirrored", 3),      # 64 -> 22/21/21 and the last batch 29 -> 10/10/9
    ("one_device", 1),
    ("default", 1),
    ("central_storage", 3),
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


@pytest.mark.multiprocess
def test_command_line_quiet_run() -> None:
    completed = run_task([sys.executable, "-m", "stratagem", "demo", "--epochs", "1", "--quiet"],
                         timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "test accuracy" in completed.stdout
    assert "PASS" in completed.stdout
    assert "train:" not in completed.stderr        # --quiet: no progress bar


def _demo(*flags: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """``stratagem demo FLAGS`` (forked from the test fork server: torch imported once)."""
    return run_task([sys.executable, "-m", "stratagem", "demo", *flags], timeout=timeout,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["mirrored", "multi_worker"])
def test_progress_without_a_terminal_is_plain_lines(strategy: str) -> None:
    # a bar redrawn with carriage returns makes CI logs and the launcher's prefixed output unreadable
    completed = _demo("--strategy", strategy, "--epochs", "2")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    output = completed.stdout + completed.stderr
    assert "\r" not in output, output
    lines = [line for line in output.splitlines() if "train " in line and " steps (" in line]
    assert 2 <= len(lines) <= 12, output
    assert "train 46/46 steps (100%) epoch 2/2 loss" in lines[-1], lines


@pytest.mark.multiprocess
def test_command_line_multi_worker_starts_its_workers_and_matches_plain_pytorch() -> None:
    completed = _demo("--strategy", "multi_worker", "--epochs", "1", "--quiet")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "test accuracy" in completed.stdout
    assert "for 23 steps" in completed.stdout
    assert "equivalence     PASS" in completed.stdout
    assert "train:" not in completed.stderr and "[worker" not in completed.stderr   # --quiet


@pytest.mark.multiprocess
def test_command_line_parameter_server_passes_on_accuracy() -> None:
    # Asynchronous: no equivalence. 8 epochs' worth of steps (184) reach about 0.95 (threshold 0.9).
    completed = _demo("--strategy", "parameter_server", "--epochs", "8", "--quiet")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "test accuracy" in completed.stdout
    assert "for 184 steps" in completed.stdout and "steps/s" in completed.stdout
    assert "equivalence     not applicable: asynchronous training" in completed.stdout
    assert "accuracy check  PASS: test accuracy" in completed.stdout and ">= 0.9" in completed.stdout
    assert "train:" not in completed.stderr and "[chief]" not in completed.stderr   # --quiet


@pytest.mark.multiprocess
def test_failed_cluster_raises_with_the_tasks_last_lines() -> None:
    config = TrainConfig(epochs=1, batch_size=64, lr=0.1, optimizer="no-such-optimizer", seed=0)
    with pytest.raises(ClusterDemoError, match="multi_worker cluster failed with exit status 1") as info:
        run_cluster_demo("multi_worker", 1, config, tolerance=1e-4, min_accuracy=0.9, progress=False,
                         out=None)
    assert "KeyError: 'no-such-optimizer'" in str(info.value)   # the tasks' output, kept while quiet
    assert "[worker " in str(info.value)


def test_asynchronous_result_is_judged_on_accuracy() -> None:
    result = DemoResult(accuracy=0.85, max_rel_diff=None, passed=False, steps=46, seconds=0.5,
                        reference_accuracy=0.85, tolerance=1e-4, strategy="ParameterServerStrategy(...)",
                        num_replicas=1, num_workers=2, min_accuracy=0.9)
    text = format_result(result)
    assert "equivalence     not applicable" in text
    assert "accuracy check  FAIL: test accuracy 0.8500 < 0.9" in text
    assert "--epochs 5" in text


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
    (["demo", "--strategy", "one_device", "--replicas", "2"],
     "--replicas applies to --strategy mirrored and central_storage and multi_worker only"),
    (["demo", "--strategy", "parameter_server", "--replicas", "2"],
     "--replicas applies to --strategy mirrored and central_storage and multi_worker only"),
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


@pytest.mark.multiprocess
def test_the_digits_split_is_stratified_standardised_and_needs_no_scikit_learn_import() -> None:
    code = ("import sys, torch\nfrom stratagem.demo import load_digits_split\n"
            "d = load_digits_split()\n"
            "assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)\n"
            "assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64\n"
            "train = torch.bincount(d.y_train, minlength=10).double()\n"
            "test = torch.bincount(d.y_test, minlength=10).double()\n"
            "assert ((test / (train + test) - 0.2).abs() < 0.01).all(), test / (train + test)\n"
            "assert d.x_train.mean(0).abs().max() < 1e-5\n"
            "assert not any(m.startswith('sklearn') for m in sys.modules)\n"
            "again = load_digits_split()\n"
            "assert torch.equal(again.x_test, d.x_test) and torch.equal(again.y_test, d.y_test)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
