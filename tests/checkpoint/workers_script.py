"""A multi-worker job that saves a checkpoint (mode save) or resumes from one (mode restore).

Run with `python -m stratagem launch --workers N workers_script.py OUT CKPT_DIR --mode save|restore`.
Trains a small model with Adam over 2 epochs of a shuffled DataLoader (40 samples, global batch 8)
under MultiWorkerMirroredStrategy; mode save stops after --steps steps and saves with a
CheckpointManager, mode restore restores the newest checkpoint and trains to the end. Each worker
writes OUT/<mode>-rank<r>.json: the sample ids of its slice at every step, how often it wrote a
checkpoint, whether the checkpoint was complete when save returned, and the final parameters.

--own-disk simulates hosts that do not share a file system: worker r works in CKPT_DIR/worker<r>
and its manager's directory is the relative path "ckpts" there -- the same path on every worker,
with different files behind it.

Mode swap saves CKPT_DIR/ckpt-a at step 3 and CKPT_DIR/ckpt-b at step 5 (Checkpoint.save), then
the chief copies CKPT_DIR whole to CKPT_DIR-moved and swaps ckpt-a and ckpt-b on disk; after one
more step every worker restores CKPT_DIR/ckpt-a (refused: "refused" is the error, or None),
CKPT_DIR-moved/ckpt-a, and CKPT_DIR/ckpt-a with saved_as="ckpt-b", recording the steps and
parameters after each.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.checkpoint import checkpoint as checkpoint_module

EPOCHS = 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g), torch.arange(40))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--mode", choices=["save", "restore", "swap"], required=True)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--own-disk", action="store_true")
    args = parser.parse_args()

    writes = []

    class CountingWriter(checkpoint_module.DirectoryWriter):
        def __init__(self, path, *args, **kwargs):
            writes.append(str(path))
            super().__init__(path, *args, **kwargs)
    checkpoint_module.DirectoryWriter = CountingWriter

    strategy = sg.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_rank
    if args.own_disk:
        disk = Path(args.ckpt_dir, f"worker{rank}")
        disk.mkdir(parents=True, exist_ok=True)
        os.chdir(disk)
        args.ckpt_dir = "ckpts"
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(42)
    data = strategy.experimental_distribute_dataset(DataLoader(dataset(), batch_size=8, shuffle=True))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, steps=0)
    manager = sg.CheckpointManager(ckpt, args.ckpt_dir)
    report = {"rank": rank, "ids": []}
    if args.mode == "restore":
        report["restored"] = manager.restore_or_initialize()

    def params() -> dict:
        return {k: v.tolist() for k, v in model.state_dict().items()}

    def step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(data.epoch, EPOCHS):
        for x, y, ids in data:
            strategy.run(step, args=(x, y))
            ckpt.steps += 1
            report["ids"].append(torch.cat(strategy.experimental_local_results(ids)).tolist())
            if args.mode == "save" and ckpt.steps == args.steps:
                path = manager.save()
                report["saved"] = path
                report["complete_on_return"] = (Path(path) / "manifest.json").is_file()
                break
            if args.mode == "swap" and ckpt.steps in (3, 5, 6):
                if ckpt.steps < 6:
                    report[f"step{ckpt.steps}"] = params()
                    ckpt.save(Path(args.ckpt_dir, "ckpt-a" if ckpt.steps == 3 else "ckpt-b"))
                    continue
                swap(strategy, ckpt, Path(args.ckpt_dir), report, params)
                break
        else:
            continue
        break
    report["writes"] = writes
    report["steps"] = ckpt.steps
    report["final"] = {k: v.tolist() for k, v in model.state_dict().items()}
    Path(args.out, f"{args.mode}-rank{rank}.json").write_text(json.dumps(report))


def swap(strategy, ckpt, ckpt_dir: Path, report: dict, params) -> None:
    """Mode swap after step 6: the chief swaps the checkpoints on disk, every worker restores them."""
    if strategy.cluster_resolver.worker_rank == 0:
        shutil.copytree(ckpt_dir, f"{ckpt_dir}-moved")   # a legitimate copy, names kept
        os.rename(ckpt_dir / "ckpt-a", ckpt_dir / "swap")
        os.rename(ckpt_dir / "ckpt-b", ckpt_dir / "ckpt-a")
        os.rename(ckpt_dir / "swap", ckpt_dir / "ckpt-b")
    strategy.checkpoint_collective.broadcast_object("swapped")   # every worker waits for the chief
    before = params()
    try:
        ckpt.restore(ckpt_dir / "ckpt-a")
        report["refused"] = None
    except sg.errors.CheckpointError as err:
        report["refused"] = str(err)
    report["unchanged"] = ckpt.steps == 6 and params() == before
    ckpt.restore(Path(f"{ckpt_dir}-moved", "ckpt-a"))
    report["moved"] = {"steps": ckpt.steps, "params": params()}
    ckpt.restore(ckpt_dir / "ckpt-a", saved_as="ckpt-b")
    report["saved_as"] = {"steps": ckpt.steps, "params": params()}


if __name__ == "__main__":
    main()
