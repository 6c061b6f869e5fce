"""Checkpoint save and restore: sg.Checkpoint against torch.save of the same state, side by side.

    python benchmarks/checkpoint.py                 # ~3-5 min on 2 shared cores
    python benchmarks/checkpoint.py --rounds 9 --dir /some/disk --cases OneDevice "2 workers"

The state is a 24 M-parameter MLP (784-4096-4096-1024-10) with Adam's moments after one step:
about 290 MB in float32. Cases: OneDeviceStrategy, MirroredStrategy on 2 logical CPU devices,
and MultiWorkerMirroredStrategy with 2 worker processes (gloo over loopback, one intra-op
thread each). Every case runs, in the same process(es) and on the same disk, once per round
and in an order rotated from round to round:

- ``torch.save+fsync``: ``torch.save({"model": model.state_dict(), "optimizer":
  optimizer.state_dict()})`` to one file, then ``os.fsync`` (a checkpoint that is not on disk
  is not a checkpoint); with 2 workers, worker 0 saves and both meet at ``dist.barrier()``
  -- what a DDP script does. Also ``torch.save`` without the fsync, for reference.
- ``torch.load``: ``torch.load(weights_only=True)`` + ``load_state_dict`` of both (with 2
  workers, both workers read the file, then ``dist.barrier()``). Also the same with
  ``mmap=True``, for reference: ``sg.Checkpoint`` reads through a memory map.
- ``sg.Checkpoint``: ``sg.Checkpoint(model=model, optimizer=optimizer).save(path)`` (atomic:
  temporary directory, a CRC-32 of every file, fsync, rename, manifest) and ``restore(path)``
  (sizes and checksums verified before anything changes). ``blocked``: how long
  ``save(path, blocking=False)`` holds the training loop (the state copied in memory; a thread
  writes the files), one worker only.

Times are seconds until the call returned (with 2 workers: on the slower worker, each
operation started at a barrier). Prints the median over rounds, ours / baseline as the median
of the ratios measured in the same round (with its range) and as the ratio of the fastest
rounds (on a busy machine the least disturbed ones), and the bytes written (target:
ours <= 1.2x torch.save+fsync and torch.load, no more bytes than one logical copy plus a small
manifest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stratagem as sg  # noqa: E402
from benchmarks._harness import load_warning, mlp  # noqa: E402

LAYERS = (784, 4096, 4096, 1024, 10)
OPS = ("base_save", "base_save_nofsync", "ours_save", "ours_save_blocked", "base_restore", "base_restore_mmap",
       "ours_restore")
COMPARED = (("save", "ours_save", "base_save", "torch.save+fsync"),
            ("save", "ours_save", "base_save_nofsync", "torch.save, no fsync"),
            ("blocked", "ours_save_blocked", "base_save", "torch.save+fsync"),
            ("restore", "ours_restore", "base_restore", "torch.load"),
            ("restore", "ours_restore", "base_restore_mmap", "torch.load(mmap=True)"))
CASES = {"OneDevice": lambda: sg.OneDeviceStrategy("cpu"),
         "Mirrored(2)": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
         "2 workers": None}   # run in 2 processes (see workers_case)


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


def baseline_save(model, optimizer, path: str, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def baseline_restore(model, optimizer, path: str, mmap: bool = False) -> None:
    state = torch.load(path, weights_only=True, mmap=mmap)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def measure(strategy: sg.Strategy, root: str, rounds: int, *, chief: bool = True,
            barrier: Callable[[], None] = lambda: None) -> tuple[dict[str, list[float]], dict[str, int], float]:
    """Every operation once per round, each started at a barrier; this process's seconds."""
    model, optimizer = make(strategy)
    checkpoint = sg.Checkpoint(model=model, optimizer=optimizer)
    times: dict[str, list[float]] = {op: [] for op in OPS}
    sizes: dict[str, int] = {}
    kinds = ["base", "nofsync", "ours"]
    for round_ in range(rounds):
        paths = {kind: os.path.join(root, f"{kind}-{round_}" + (".ckpt" if kind == "ours" else ".pt"))
                 for kind in kinds}
        paths["async"] = os.path.join(root, f"async-{round_}.ckpt")

        def base_save(fsync: bool, path: str) -> None:
            if chief:
                baseline_save(model, optimizer, path, fsync)
            barrier()

        def base_restore(mmap: bool) -> None:   # the file that the save just before wrote
            baseline_restore(model, optimizer, paths["nofsync" if mmap else "base"], mmap)
            barrier()

        def ours_restore() -> None:
            checkpoint.restore(paths["ours"])

        def ours_save_blocked() -> None:   # what a step waits for; the thread's write is not timed
            checkpoint.save(paths["async"], blocking=False)

        steps = {"base": [("base_save", lambda: base_save(True, paths["base"])),
                          ("base_restore", lambda: base_restore(False))],
                 "nofsync": [("base_save_nofsync", lambda: base_save(False, paths["nofsync"])),
                             ("base_restore_mmap", lambda: base_restore(True))],
                 "ours": [("ours_save", lambda: checkpoint.save(paths["ours"])), ("ours_restore", ours_restore)]
                 + ([("ours_save_blocked", ours_save_blocked)] if strategy.topology.num_workers == 1 else [])}
        order = kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]
        for kind in order:
            for op, fn in steps[kind]:
                barrier()
                started = time.perf_counter()
                fn()
                times[op].append(time.perf_counter() - started)
                checkpoint.wait()
        barrier()
        if chief:
            sizes = {"base": size_of(paths["base"]), "ours": size_of(paths["ours"])}
            for kind, path in paths.items():
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
    return times, sizes, sum(p.numel() for p in model.parameters()) / 1e6


def workers_case(root: str, rounds: int) -> tuple[dict[str, list[float]], dict[str, int], float]:
    """The 2-worker case: this script again, as 2 MultiWorkerMirroredStrategy processes."""
    from stratagem.testing import run_local_cluster

    results = run_local_cluster(os.path.abspath(__file__), 2, timeout=300 + 120 * rounds,
                                args=["--child", "--rounds", str(rounds), "--dir", root])
    for result in results:
        if result.returncode != 0:
            raise RuntimeError(f"{result.task} failed ({result.returncode}):\n{result.output}")
    line = next(line for line in results[0].output.splitlines() if line.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    return report["times"], report["sizes"], report["params"]


def child(root: str, rounds: int) -> None:
    """One worker of the 2-worker case: prints the slower worker's times per round (worker 0)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy()
    chief = strategy.cluster_resolver.worker_rank == 0
    times, sizes, params = measure(strategy, root, rounds, chief=chief, barrier=dist.barrier)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    slowest = {op: [max(worker[op][i] for worker in everyone) for i in range(len(times[op]))] for op in OPS}
    if chief:
        print("RESULT " + json.dumps({"times": slowest, "sizes": sizes, "params": params}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.dir, args.rounds)
    torch.set_num_threads(2)
    root = tempfile.mkdtemp(prefix="stratagem-ckpt-bench-", dir=args.dir)
    rows = []
    try:
        for name in args.cases:
            if CASES[name] is None:
                times, sizes, params = workers_case(root, args.rounds)
            else:
                times, sizes, params = measure(CASES[name](), root, args.rounds)
            for op, ours, base, label in COMPARED:
                if not times[ours]:   # a save that does not block needs one worker
                    continue
                ratios = [o / b for o, b in zip(times[ours], times[base])]
                rows.append((name, op, label, statistics.median(times[base]), statistics.median(times[ours]),
                             statistics.median(ratios), min(ratios), max(ratios), min(times[ours]) / min(times[base])))
            rows.append((name, "bytes", "torch.save", sizes["base"], sizes["ours"], sizes["ours"] / sizes["base"],
                         None, None, None))
            print(f"{name}: {params:.1f} M parameters + Adam, {args.rounds} rounds", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'case':<12} {'op':<8} {'baseline':<22} {'baseline':>10} {'sg.Checkpoint':>14} {'ours/base':>10}  "
          f"{'range':<10} {'min/min':>7}")
    for name, op, label, base, ours, ratio, lo, hi, of_minima in rows:
        if op == "bytes":
            print(f"{name:<12} {op:<8} {label:<22} {base / 2**20:>8.1f}MB {ours / 2**20:>12.1f}MB {ratio:>10.3f}  "
                  f"{ours - base:+,d} bytes")
        else:
            print(f"{name:<12} {op:<8} {label:<22} {base:>9.3f}s {ours:>13.3f}s {ratio:>10.2f}  "
                  f"{f'{lo:.2f}-{hi:.2f}':<10} {of_minima:>7.2f}")
    print("\nseconds: medians over rounds; ours/base: the median of the ratios of the same round (and their "
          "range);\nmin/min: the fastest round of each, the least disturbed by other processes.")
    warning = load_warning()
    if warning:
        print(warning)


if __name__ == "__main__":
    main()
