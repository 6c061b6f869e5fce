"""Checkpoint save and restore: sg.Checkpoint against torch.save of the same state, side by side.

    python benchmarks/checkpoint.py                 # ~1-2 min on 2 cores
    python benchmarks/checkpoint.py --rounds 5 --dir /some/disk

The state is a 24 M-parameter MLP (784-4096-4096-1024-10) with Adam's moments after one step:
about 290 MB in float32. For each strategy (OneDeviceStrategy, MirroredStrategy on 2 logical
CPU devices) and each round, in an order rotated from round to round:

- baseline: ``torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})``
  to one file, then ``os.fsync`` (a checkpoint that is not on disk is not a checkpoint), and
  ``torch.load`` + ``load_state_dict`` back;
- ours: ``sg.Checkpoint(model=model, optimizer=optimizer).save(path)`` (atomic: temporary
  directory, sha256 of every file, fsync, rename) and ``restore(path)`` (every checksum
  verified before anything changes).

Prints the median seconds per round, ours/baseline (the median over rounds of the paired
ratio, with its range) and the bytes each wrote (target: ours <= 1.2x the baseline's time, no
more bytes than one logical copy plus a small manifest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stratagem as sg  # noqa: E402
from benchmarks._harness import load_warning, mlp  # noqa: E402

LAYERS = (784, 4096, 4096, 1024, 10)


def make(strategy: sg.Strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = mlp(LAYERS)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randn(64, LAYERS[0]), torch.randint(0, 10, (64,)))

    def step(b):
        x, y = b
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for dist_batch in strategy.experimental_distribute_dataset([batch]):
        strategy.run(step, args=(dist_batch,))   # Adam's state exists from here on
    return model, optimizer


def size_of(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def baseline_save(model, optimizer, path: str) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def baseline_restore(model, optimizer, path: str) -> None:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = tempfile.mkdtemp(prefix="stratagem-ckpt-bench-", dir=args.dir)
    strategies = {"OneDevice": lambda: sg.OneDeviceStrategy("cpu"),
                  "Mirrored(2)": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"])}
    rows = []
    try:
        for name, build in strategies.items():
            model, optimizer = make(build())
            params = sum(p.numel() for p in model.parameters())
            checkpoint = sg.Checkpoint(model=model, optimizer=optimizer)
            times: dict[str, list[float]] = {key: [] for key in ("base_save", "ours_save", "base_restore", "ours_restore")}
            sizes = {}
            for round_ in range(args.rounds):
                base_path = os.path.join(root, f"{name}-{round_}.pt")
                ours_path = os.path.join(root, f"{name}-{round_}.ckpt")
                order = ["base", "ours"] if round_ % 2 == 0 else ["ours", "base"]
                for who in order:
                    if who == "base":
                        times["base_save"].append(timed(lambda: baseline_save(model, optimizer, base_path)))
                        times["base_restore"].append(timed(lambda: baseline_restore(model, optimizer, base_path)))
                    else:
                        times["ours_save"].append(timed(lambda: checkpoint.save(ours_path)))
                        times["ours_restore"].append(timed(lambda: checkpoint.restore(ours_path)))
                sizes = {"base": size_of(base_path), "ours": size_of(ours_path)}
                os.remove(base_path)
                shutil.rmtree(ours_path)
            for op in ("save", "restore"):
                ratios = [o / b for o, b in zip(times[f"ours_{op}"], times[f"base_{op}"])]
                rows.append((name, op, statistics.median(times[f"base_{op}"]), statistics.median(times[f"ours_{op}"]),
                             statistics.median(ratios), min(ratios), max(ratios)))
            rows.append((name, "bytes", sizes["base"], sizes["ours"], sizes["ours"] / sizes["base"], None, None))
            print(f"{name}: {params / 1e6:.1f} M parameters + Adam", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'strategy':<12} {'op':<8} {'torch.save':>12} {'sg.Checkpoint':>14} {'ours/base':>10}  range")
    for name, op, base, ours, ratio, lo, hi in rows:
        if op == "bytes":
            print(f"{name:<12} {op:<8} {base / 2**20:>10.1f}MB {ours / 2**20:>12.1f}MB {ratio:>10.3f}")
        else:
            print(f"{name:<12} {op:<8} {base:>11.3f}s {ours:>13.3f}s {ratio:>10.2f}  {lo:.2f}-{hi:.2f}")
    warning = load_warning()
    if warning:
        print(warning)


if __name__ == "__main__":
    main()
