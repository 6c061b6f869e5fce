"""Exact resume of input: the batches a resumed job sees are those the uninterrupted job would have
seen next -- nothing skipped, nothing repeated -- and it ends with the same parameters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.testing import run_task

from .common import build, killed_at_line, make_strategy

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).parent
EPOCHS = 3


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(27, 5, generator=g), torch.randint(0, 3, (27,), generator=g), torch.arange(27))


def job(kind: str, *, stop: int | None = None, path: Path | None = None, restore: str | None = None,
        loader_generator: bool = False):
    """An epoch loop over a shuffled DataLoader; returns (sample ids per step, saved path, model)."""
    strategy = make_strategy(kind)
    model, optimizer, _ = build(strategy)
    torch.manual_seed(42)
    generator = torch.Generator().manual_seed(7) if loader_generator else None
    data = strategy.experimental_distribute_dataset(
        DataLoader(samples(), batch_size=6, shuffle=True, generator=generator))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data)
    if restore is not None:
        torch.manual_seed(1234)   # whatever the random state now: the restore decides
        ckpt.restore(restore)

    def step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    seen = []
    for epoch in range(data.epoch, EPOCHS):
        for x, y, ids in data:
            strategy.run(step, args=(x, y))
            seen.append(torch.cat(strategy.experimental_local_results(ids)).tolist())
            if len(seen) == stop:
                return seen, ckpt.save(path), model
    return seen, None, model


@pytest.mark.parametrize("kind, resume_kind, stop, loader_generator", [
    ("mirrored2", "mirrored2", 3, False),     # mid-epoch
    ("mirrored2", "mirrored2", 5, True),      # the last batch of an epoch read, the epoch not yet ended
    ("mirrored2", "one_device", 7, False),    # resumed under another strategy
    ("one_device", "mirrored3", 11, True),
])
def test_interrupted_epoch_loop_resumes_exactly(tmp_path: Path, kind: str, resume_kind: str, stop: int,
                                                loader_generator: bool) -> None:
    full, _, reference = job(kind, loader_generator=loader_generator)
    assert len(full) == 15 and sorted(sum(full[:5], [])) == list(range(27))
    first, path, _ = job(kind, stop=stop, path=tmp_path / "ckpt", loader_generator=loader_generator)
    rest, _, resumed = job(resume_kind, restore=path, loader_generator=loader_generator)
    assert first + rest == full
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=2e-5, atol=2e-6)


def test_an_iterator_is_tracked_and_repositioned(tmp_path: Path) -> None:
    strategy = make_strategy("mirrored2")
    torch.manual_seed(3)
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=4, shuffle=True))
    iterator = iter(data)
    ids = [torch.cat(strategy.experimental_local_results(next(iterator)[2])).tolist() for _ in range(7)]
    torch.manual_seed(3)
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=4, shuffle=True))
    iterator = iter(data)
    ckpt = sg.Checkpoint(data=iterator)
    first = [torch.cat(strategy.experimental_local_results(next(iterator)[2])).tolist() for _ in range(3)]
    path = ckpt.save(tmp_path / "c")
    next(iterator)   # read on past the save: the restore moves this very iterator back
    ckpt.restore(path)
    rest = [torch.cat(strategy.experimental_local_results(next(iterator)[2])).tolist() for _ in range(4)]
    assert first + rest == ids


def test_distribute_datasets_from_function_resumes_exactly(tmp_path: Path) -> None:
    def run(stop=None, restore=None):
        strategy = make_strategy("mirrored2")
        torch.manual_seed(9)

        def dataset_fn(ctx):
            return DataLoader(samples(), batch_size=ctx.get_per_replica_batch_size(6), shuffle=True)

        data = strategy.distribute_datasets_from_function(dataset_fn)
        ckpt = sg.Checkpoint(data=data)
        if restore:
            ckpt.restore(restore)
        seen = []
        for _ in range(data.epoch, 2):
            for _, _, ids in data:
                seen.append([r.tolist() for r in strategy.experimental_local_results(ids)])
                if len(seen) == stop:
                    return seen, ckpt.save(tmp_path / "c")
        return seen, None

    full, _ = run()
    first, path = run(stop=6)
    rest, _ = run(restore=path)
    assert first + rest == full and len(full) == 10


@pytest.mark.multiprocess
def test_a_killed_job_resumes_from_its_backup(tmp_path: Path) -> None:
    """SIGKILL after the job printed that a backup was saved; run again: the steps after the
    backup run again, and the whole sequence equals that of a job never stopped."""
    script = [sys.executable, str(HERE / "resume_script.py")]
    killed_at_line(script + [str(tmp_path / "backup"), str(tmp_path / "killed.jsonl"), "--pause-at", "6"],
                   "saved 6")
    resumed = run_task(script + [str(tmp_path / "backup"), str(tmp_path / "resumed.jsonl")], timeout=100)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.splitlines()[0] == "resumed 1 1"   # 6 steps = epoch 0 (5 steps) + 1
    whole = run_task(script + [str(tmp_path / "whole"), str(tmp_path / "whole.jsonl")], timeout=100)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    def log(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    killed, again, reference = log("killed.jsonl"), log("resumed.jsonl"), log("whole.jsonl")
    assert [e["step"] for e in killed] == list(range(1, 7))
    assert [e["step"] for e in again] == list(range(7, 16))
    assert [e["ids"] for e in killed + again] == [e["ids"] for e in reference]
    final = json.loads((tmp_path / "resumed.jsonl.final").read_text())
    expected = json.loads((tmp_path / "whole.jsonl.final").read_text())
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(final[name]), torch.tensor(value), rtol=2e-5, atol=2e-6)
    assert not list((tmp_path / "backup").iterdir())   # deleted at the end of training


def test_a_per_worker_dataset_is_refused_with_the_reason_and_the_alternative() -> None:
    from stratagem.ps.closures import PerWorkerDataset

    dataset = PerWorkerDataset("d0")   # what ClusterCoordinator.create_per_worker_dataset returns (a subclass)
    for tracked in (dataset, iter(dataset)):
        with pytest.raises(sg.errors.InvalidArgumentError,
                           match=r"per-worker dataset .* no position says which elements .* starts from its "
                                 r"beginning\. Track an int instead"):
            sg.Checkpoint(data=tracked, epoch=0)
