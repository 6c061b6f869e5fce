"""Resuming on another number of workers: a job of 3 workers loses one for good and goes on with 2
from its last checkpoint, then gets it back (2 -> 3); the global batch is kept, so the result is that
of the uninterrupted 3-worker job and of plain PyTorch on the global batches (float64), with the
exact sequence of samples (nothing skipped or repeated), the step, epoch and learning rate going on.
Through ``fit`` + ``BackupAndRestore`` and a custom loop with ``CheckpointManager``; ZeRO stages 1, 2
and 3; ``distribute_datasets_from_function``, resized at an epoch boundary, refused in mid-epoch (on
every worker, the checkpoints intact), and resized in mid-epoch when its pipelines read one global
order (``InputOptions(experimental_resizable=True)``); in one process, the same rule for a change of
replica count and for a tracked iterator.

Each job is ``stratagem launch``-ed (``launch_local``) with a worker count; "a node lost for good"
is the last worker SIGKILLing itself right after it printed that a checkpoint was complete, which
ends that launch; the next launch, with another worker count, resumes from the same directory.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.data.sharding import split_sizes
from stratagem.launch import launch_local

from . import resize_script as script

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(script.__file__)
# float64: the sums over 2 or 3 workers add the same terms in other orders than one process does
# (measured after 18-21 Adam steps: at most 2.2e-16 absolute, 1e-14 relative)
RTOL, ATOL = 1e-12, 1e-14


def launch(workers: int, out: Path, loop: str, tag: str, *args: str, ok: bool = True) -> str:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, [str(out), str(out / "ckpts"), "--loop", loop, "--tag", tag, *args],
                          num_workers=workers, stdout=stdout, stderr=stderr, grace_period=2.0, join_timeout=120)
    output = stdout.getvalue() + stderr.getvalue()
    assert (status == 0) == ok, f"status {status}:\n{output}"
    return output


def read_run(out: Path, tag: str, workers: int) -> tuple[int, dict[int, dict]]:
    """A launch's resume step and its steps: {step: {"epoch", "lr", "ids" (the global batch), "slices"}}."""
    logs = [[json.loads(line) for line in (out / f"{tag}-rank{r}.jsonl").read_text().splitlines()]
            for r in range(workers)]
    resumes = {log[0]["resume"] for log in logs}
    assert len(resumes) == 1, f"{tag}: the workers resumed at different steps {resumes}"
    steps: dict[int, dict] = {}
    for rank, log in enumerate(logs):
        for entry in log[1:]:
            step = steps.setdefault(entry["step"], {"epoch": entry["epoch"], "lr": entry["lr"], "slices": {}})
            assert (step["epoch"], step["lr"]) == (entry["epoch"], entry["lr"]), (tag, rank, entry)
            step["slices"][rank] = entry["ids"]
    for step in steps.values():
        step["ids"] = sum((step["slices"][r] for r in sorted(step["slices"])), [])
    return resumes.pop(), steps


def stitched(out: Path, runs: list[tuple[str, int]]) -> list[dict]:
    """The steps of successive launches, one after the other; checks that each launch resumed at
    the last step its predecessor trained (whose checkpoint was complete before its worker died)."""
    whole: list[dict] = []
    for tag, workers in runs:
        resume, steps = read_run(out, tag, workers)
        assert resume == len(whole), f"{tag} resumed at step {resume}, after {len(whole)} steps trained"
        whole += [dict(steps[s], step=s, workers=workers) for s in sorted(steps) if s > resume]
        assert [s["step"] for s in whole] == list(range(1, len(whole) + 1)), tag
    return whole


def final(out: Path, tag: str, workers: int) -> list[dict]:
    return [json.loads((out / f"{tag}-final-rank{r}.json").read_text()) for r in range(workers)]


# ------------------------------------------------------------------ plain PyTorch

def reference(loop: str) -> tuple[list[dict], dict[str, torch.Tensor], float]:
    """One process on the global batches: each step's ids, epoch and lr; the final parameters and lr."""
    x, y = script.arrays(loop)
    net = script.make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=script.LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=script.GAMMA)
    torch.manual_seed(42)
    loader = DataLoader(TensorDataset(x, y), batch_size=script.GLOBAL_BATCH[loop], shuffle=True)
    one_pipeline = script.global_order_loader(loop, sg.InputContext()) if loop == "function" else None
    steps = []
    for epoch in range(script.EPOCHS):
        if loop == "fit":
            optimizer.param_groups[0]["lr"] = script.LR * script.GAMMA ** epoch
            batches = list(loader)
        elif loop == "custom":
            batches = list(loader)
        else:   # the same global order, read whole
            batches = list(one_pipeline)
        for bx, by in batches:
            steps.append({"epoch": epoch, "lr": optimizer.param_groups[0]["lr"], "ids": bx[:, 5].long().tolist()})
            optimizer.zero_grad()
            F.cross_entropy(net(bx), by).backward()
            optimizer.step()
            if loop != "fit":
                scheduler.step()
    return steps, net.body.state_dict(), optimizer.param_groups[0]["lr"]


def assert_as_plain_pytorch(loop: str, whole: list[dict], finals: list[dict],
                            uninterrupted: list[dict] | None = None) -> None:
    steps, params, lr = reference(loop)
    assert [s["ids"] for s in whole] == [s["ids"] for s in steps]   # nothing skipped, nothing repeated
    assert [s["epoch"] for s in whole] == [s["epoch"] for s in steps]
    assert [s["lr"] for s in whole] == pytest.approx([s["lr"] for s in steps], rel=1e-15)
    for s in whole:   # the global batch kept: each worker's slice as the split rules say
        assert [len(s["slices"][r]) for r in range(s["workers"])] == split_sizes(len(s["ids"]), s["workers"]), s
    for rank, got in enumerate(finals):
        assert got["step"] == len(steps) and got["lr"] == pytest.approx(lr, rel=1e-15)
        for name, value in params.items():
            torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value,
                                       rtol=RTOL, atol=ATOL, msg=lambda m: f"worker {rank}, {name}: {m}")
            if uninterrupted is not None:
                torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64),
                                           torch.tensor(uninterrupted[0]["params"][name], dtype=torch.float64),
                                           rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"worker {rank} against the uninterrupted job, {name}: {m}")


# ------------------------------------------------------------------ the tests

@pytest.mark.multiprocess
@pytest.mark.parametrize("loop, first_kill, second_kill", [
    ("fit", 8, 13),          # in epoch 1 (6 steps an epoch, the last of 4 rows), then in epoch 2
    ("custom", 5, 14),
])
def test_three_workers_lose_one_then_get_it_back_and_end_as_if_never_stopped(
        tmp_path: Path, loop: str, first_kill: int, second_kill: int) -> None:
    (tmp_path / "whole").mkdir()
    launch(3, tmp_path / "whole", loop, "whole")
    uninterrupted = final(tmp_path / "whole", "whole", 3)
    assert_as_plain_pytorch(loop, stitched(tmp_path / "whole", [("whole", 3)]), uninterrupted)

    out = tmp_path / "resized"
    out.mkdir()
    launch(3, out, loop, "three", "--kill-at", f"step {first_kill}", ok=False)
    assert max(read_run(out, "three", 3)[1]) == first_kill   # no worker trained past the lost one
    launch(2, out, loop, "two", "--kill-at", f"step {second_kill}", ok=False)   # its share goes to the others
    launch(3, out, loop, "back")                                                # it comes back at the next restart
    whole = stitched(out, [("three", 3), ("two", 2), ("back", 3)])
    assert {s["workers"] for s in whole} == {2, 3}
    assert_as_plain_pytorch(loop, whole, final(out, "back", 3), uninterrupted)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding, placement", [("optimizer", "ZeroUpdate"), ("gradients", "ZeroUpdate"),
                                                 ("parameters", "FullyShardedPlacement")])
def test_zero_checkpoints_resume_on_fewer_workers(tmp_path: Path, sharding: str, placement: str) -> None:
    """The optimizer state (and, at stage 3, the parameters) sharded over 3 workers, saved as one
    logical copy, restored sharded over 2."""
    launch(3, tmp_path, "custom", "three", "--sharding", sharding, "--kill-at", "step 10", ok=False)
    assert max(read_run(tmp_path, "three", 3)[1]) == 10
    launch(2, tmp_path, "custom", "two", "--sharding", sharding)
    finals = final(tmp_path, "two", 2)
    assert {f["placement"] for f in finals} == {placement}
    assert_as_plain_pytorch("custom", stitched(tmp_path, [("three", 3), ("two", 2)]), finals)


@pytest.mark.multiprocess
def test_per_worker_pipelines_resize_at_epoch_boundaries_and_refuse_mid_epoch(tmp_path: Path) -> None:
    """distribute_datasets_from_function: each worker's position is its own pipeline's. Resized at
    the end of an epoch it resumes (a fresh epoch on every pipeline); resized in the middle of one
    it is refused on every worker, and the same checkpoints still resume on the count that wrote them."""
    launch(3, tmp_path, "function", "three", "--kill-at", "epoch 0", ok=False)
    launch(2, tmp_path, "function", "two", "--kill-at", "step 10", ok=False)
    started = time.monotonic()
    output = launch(3, tmp_path, "function", "refused", ok=False)
    assert time.monotonic() - started < 120
    raised = re.search(r"\[worker \d\] .*CheckpointError: none of the 2 checkpoints in \S+ can be restored; "
                       r"the newest: (.*)", output)
    assert raised, output
    message = raised.group(1)
    for rank in range(3):   # every worker refused it (the workers agree before anything changes)
        assert f"worker {rank}: checkpoint " in message, message
    assert "the dataset position was saved by 2 worker(s) with 2 replica(s) in sync" in message, message
    assert "in the middle of epoch 1 (step 3); this job has 3 worker(s) and 3 replica(s)" in message, message
    assert "Resume on 2 worker(s) with 2 replica(s)" in message, message
    assert "pass options=sg.InputOptions(experimental_resizable=True)" in message, message
    assert all((tmp_path / f"refused-rank{rank}.jsonl").read_text() == "" for rank in range(3))   # no step ran
    launch(2, tmp_path, "function", "end")
    whole = stitched(tmp_path, [("three", 3), ("two", 2), ("end", 2)])
    assert_as_plain_pytorch("function", whole, final(tmp_path, "end", 2))


@pytest.mark.multiprocess
def test_per_worker_pipelines_of_one_global_order_resize_mid_epoch(tmp_path: Path) -> None:
    launch(3, tmp_path, "function", "three", "--resizable", "--kill-at", "step 4", ok=False)
    launch(2, tmp_path, "function", "two", "--resizable")
    assert_as_plain_pytorch("function", stitched(tmp_path, [("three", 3), ("two", 2)]), final(tmp_path, "two", 2))


# ------------------------------------------------------------------ in one process

def _function_job(replicas: int, directory: Path, *, stop: int | None = None, resizable: bool = False):
    """distribute_datasets_from_function under MirroredStrategy(replicas): each step's global batch ids."""
    strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    options = sg.InputOptions(experimental_resizable=resizable)
    data = strategy.distribute_datasets_from_function(lambda ctx: script.global_order_loader("function", ctx), options)
    ckpt = sg.Checkpoint(data=data, step=0)
    manager = sg.CheckpointManager(ckpt, directory, max_to_keep=1)
    manager.restore_or_initialize()
    seen = []
    for _ in range(data.epoch, 2):
        for x, _ in data:
            seen.append(sum((part[:, 5].long().tolist() for part in strategy.experimental_local_results(x)), []))
            ckpt.step += 1
            if ckpt.step == stop:
                manager.save()
                return seen
    return seen


def test_replica_count_change_of_per_replica_pipelines(tmp_path: Path) -> None:
    """The same rule when the replicas of one process change (2 -> 3): refused in mid-epoch, exact
    with experimental_resizable (the pipeline reads its replicas' slices of one global order)."""
    whole = _function_job(2, tmp_path / "whole")
    assert len(whole) == 14 and sorted(sum(whole[:7], [])) == list(range(42))
    _function_job(2, tmp_path / "plain", stop=3)
    with pytest.raises(sg.errors.CheckpointError, match=r"saved by 1 worker\(s\) with 2 replica\(s\) in sync.*"
                                                        r"middle of epoch 0 \(step 3\); this job has 1 worker\(s\) "
                                                        r"and 3 replica\(s\).*Resume on 1 worker\(s\) with 2 "
                                                        r"replica\(s\)"), pytest.warns(RuntimeWarning):
        _function_job(3, tmp_path / "plain")
    first = _function_job(2, tmp_path / "resizable", stop=3, resizable=True)
    assert first + _function_job(3, tmp_path / "resizable", resizable=True) == whole


def test_a_tracked_iterator_follows_the_same_rule(tmp_path: Path) -> None:
    """sg.Checkpoint(data=iterator): refused on another replica count in mid-epoch, nothing changed
    (the iterator reads on where it was); with experimental_resizable it is moved to the saved step."""
    whole = _function_job(2, tmp_path / "whole")

    def iterator_of(replicas: int, resizable: bool):
        strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
        data = strategy.distribute_datasets_from_function(
            lambda ctx: script.global_order_loader("function", ctx), sg.InputOptions(experimental_resizable=resizable))
        iterator = iter(data)
        return iterator, lambda: sum((part[:, 5].long().tolist()
                                      for part in strategy.experimental_local_results(next(iterator)[0])), [])

    for resizable in (False, True):
        iterator, read = iterator_of(2, resizable)
        first = [read() for _ in range(3)]
        path = sg.Checkpoint(data=iterator).save(tmp_path / f"ckpt-{resizable}")
        iterator, read = iterator_of(3, resizable)
        if not resizable:
            with pytest.raises(sg.errors.CheckpointError, match=r"middle of epoch 0 \(step 3\)"):
                sg.Checkpoint(data=iterator).restore(path)
            assert read() == whole[0]   # untouched: it reads on from where it was
            continue
        sg.Checkpoint(data=iterator).restore(path)
        assert first + [read() for _ in range(4)] == whole[:7]


def test_a_global_batch_the_new_count_cannot_divide_is_refused_by_get_per_replica_batch_size() -> None:
    """With distribute_datasets_from_function the user divides the global batch: 6 rows over 4
    replicas is refused with the fix; experimental_distribute_dataset splits it as usual (2, 2, 1, 1)."""
    with pytest.raises(sg.errors.InvalidArgumentError, match="global batch size 6 is not divisible by the 4"):
        context = sg.InputContext(num_input_pipelines=4, input_pipeline_id=0, num_replicas_in_sync=4)
        context.get_per_replica_batch_size(6)
    strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch = next(iter(strategy.experimental_distribute_dataset([torch.arange(6)])))
    assert [len(part) for part in strategy.experimental_local_results(batch)] == split_sizes(6, 4) == [2, 2, 1, 1]
