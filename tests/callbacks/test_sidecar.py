"""``sg.SidecarEvaluator`` in one process: checkpoints written by a thread while it watches, a
checkpoint deleted between listing and reading, the finished mark, and its errors."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stratagem as sg

from .test_callbacks import read_scalars

pytestmark = pytest.mark.timeout(60)


def weight_of(model, data, steps) -> dict:
    return {"weight": model.weight.item()}


def make_manager(folder: Path, max_to_keep=None) -> tuple[torch.nn.Module, sg.CheckpointManager]:
    module = torch.nn.Linear(1, 1, bias=False)
    return module, sg.CheckpointManager(sg.Checkpoint(model=module), folder, max_to_keep=max_to_keep)


def save_weight(module: torch.nn.Module, manager: sg.CheckpointManager, value: float) -> str:
    with torch.no_grad():
        module.weight.fill_(value)
    return manager.save()


@pytest.mark.parametrize("max_to_keep", [None, 2])
def test_each_checkpoint_written_while_it_watches_is_evaluated_once(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    max_to_keep: int | None) -> None:
    """Every checkpoint once; with max_to_keep, those deleted before it saw them are not evaluated."""
    module, manager = make_manager(tmp_path, max_to_keep=max_to_keep)

    def train():
        for n in range(1, 13):
            save_weight(module, manager, float(n))
        manager.mark_training_finished()

    evaluator = sg.SidecarEvaluator(torch.nn.Linear(1, 1, bias=False), None, tmp_path, evaluate_fn=weight_of,
                                    poll_interval=0.001, timeout=30, summary_dir=tmp_path / "eval")
    trainer = threading.Thread(target=train)
    trainer.start()
    results = evaluator.start()
    trainer.join()
    seen = sorted([*results, *evaluator.skipped])
    assert seen == (list(range(1, 13)) if max_to_keep is None else sorted(set(seen))) and 12 in results
    assert list(results) == sorted(results)
    assert all(result == {"weight": float(n)} for n, result in results.items())
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if "evaluated ckpt-" in line]) == len(results)
    assert lines[-1] == f"SidecarEvaluator: training finished (last checkpoint ckpt-12); {len(results)} evaluated"
    assert [step for step, _ in read_scalars(tmp_path / "eval")["eval_weight"]] == sorted(results)


def test_a_checkpoint_deleted_between_listing_and_reading_is_skipped(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    module, manager = make_manager(tmp_path)
    for n in (1, 2, 3):
        save_weight(module, manager, float(n))

    def evaluate_then_train_on(model, data, steps):
        if model.weight.item() == 1.0:      # while ckpt-1 is evaluated, training saves ckpt-4: 1 and 2 go
            manager.max_to_keep = 2
            save_weight(module, manager, 4.0)
            manager.mark_training_finished()
        return weight_of(model, data, steps)

    evaluator = sg.SidecarEvaluator(torch.nn.Linear(1, 1, bias=False), None, tmp_path,
                                    evaluate_fn=evaluate_then_train_on, timeout=10)
    assert evaluator.start() == {1: {"weight": 1.0}, 3: {"weight": 3.0}, 4: {"weight": 4.0}}
    assert evaluator.skipped == [2]
    assert "ckpt-2 was deleted (max_to_keep) before it could be read; skipped" in capsys.readouterr().out


def test_stops_after_max_evaluations_and_uses_model_evaluate(tmp_path: Path) -> None:
    module, manager = make_manager(tmp_path)
    for n in (1, 2, 3):
        save_weight(module, manager, float(n))
    calls = []
    target = torch.nn.Linear(1, 1, bias=False)

    def evaluate(data, steps=None, verbose=1, return_dict=False):
        calls.append((data, steps, verbose, return_dict))
        return {"loss": torch.tensor(target.weight.item())}

    model = SimpleNamespace(module=target, evaluate=evaluate)
    results = sg.SidecarEvaluator(model, "data", tmp_path, steps=5, max_evaluations=2, verbose=0).start()
    assert results == {1: {"loss": 1.0}, 2: {"loss": 2.0}}
    assert calls[0] == ("data", 5, 0, True)


def test_the_finished_mark(tmp_path: Path) -> None:
    module, manager = make_manager(tmp_path)
    manager.mark_training_finished()      # finished before any checkpoint: nothing to evaluate
    assert sg.SidecarEvaluator(module, None, tmp_path, evaluate_fn=weight_of, verbose=0).start() == {}
    save_weight(module, manager, 1.0)     # a resumed job is not finished
    assert not manager.finished_mark.exists()
    with pytest.raises(TimeoutError, match="did not mark itself finished"):
        sg.SidecarEvaluator(module, None, tmp_path, evaluate_fn=weight_of, timeout=0.2, poll_interval=0.01,
                            verbose=0).start()


def test_errors_are_not_silent(tmp_path: Path) -> None:
    module, manager = make_manager(tmp_path)
    path = Path(save_weight(module, manager, 1.0))
    (path / "model.pt").write_bytes(b"garbage")   # present but corrupt: a real error, not a skip
    with pytest.raises(sg.errors.CheckpointError, match="model.pt"):
        sg.SidecarEvaluator(module, None, tmp_path, evaluate_fn=weight_of, verbose=0).start()
    with pytest.raises(sg.errors.InvalidArgumentError, match="evaluate_fn"):
        sg.SidecarEvaluator(torch.nn.Linear(1, 1), None, tmp_path)
    with pytest.raises(sg.errors.InvalidArgumentError, match="max_evaluations"):
        sg.SidecarEvaluator(module, None, tmp_path, evaluate_fn=weight_of, max_evaluations=0)
    module, manager = make_manager(tmp_path / "other")
    save_weight(module, manager, 2.0)
    with pytest.raises(sg.errors.InvalidArgumentError, match="dict of results"):
        sg.SidecarEvaluator(module, None, manager.directory, evaluate_fn=lambda *args: 0.5, verbose=0).start()


@pytest.mark.parametrize("deleted", [["manifest.json"], ["manifest.json", "model.pt"], ["model.pt"]])
def test_a_checkpoint_being_deleted_by_hand_is_skipped_with_a_warning(tmp_path: Path, deleted: list[str]) -> None:
    # `rm -r ckpt-2` while the evaluator reads it: the manifest (or a file it lists) is already gone,
    # the directory still there; the evaluator says so and goes on to the next checkpoint
    module, manager = make_manager(tmp_path)
    for n in (1, 2, 3):
        save_weight(module, manager, float(n))
    manager.mark_training_finished()

    def evaluate_then_delete(model, data, steps):
        if model.weight.item() == 1.0:
            for name in deleted:
                (tmp_path / "ckpt-2" / name).unlink()
        return weight_of(model, data, steps)

    evaluator = sg.SidecarEvaluator(torch.nn.Linear(1, 1, bias=False), None, tmp_path,
                                    evaluate_fn=evaluate_then_delete, timeout=10, verbose=0)
    with pytest.warns(RuntimeWarning, match=rf"skipped {tmp_path / 'ckpt-2'}: it is being deleted \((its "
                      rf"manifest.json is gone|model.pt listed in its manifest is gone)\)"):
        results = evaluator.start()
    assert results == {1: {"weight": 1.0}, 3: {"weight": 3.0}}
    assert evaluator.skipped == [2]
