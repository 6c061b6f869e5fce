#!/usr/bin/env python
"""What the timeline costs: ``sg.Model.fit`` with ``sg.experimental.Timeline`` against without.

The Mirrored benchmark's MLP 784-1024-1024-10 (SGD, lr 0.01, momentum 0.9, cross-entropy) under
Mirrored(2), ``--samples`` synthetic examples in global batches of ``--batch``, ``--epochs``
epochs, ``verbose=0``:

- ``off``: ``model.fit(...)`` -- the recorder off, every site one flag check;
- ``on``: ``model.fit(..., callbacks=[sg.experimental.Timeline(path)])`` -- every span kept and
  the trace written to a temporary file at the end of fit (its writing counted).

Each round is a fresh interpreter that builds the model, warms up, then runs both ``--repeats``
times alternately from the same seed. The ratio on/off is taken per pair of neighbouring runs
and reported as the median over all pairs, for wall time and for the process's CPU time (less
sensitive to other processes on a shared machine). Target: <= 1.03 (3% a step).

    python benchmarks/timeline.py                 # 5 rounds
    python benchmarks/timeline.py --rounds 3 --repeats 6 --samples 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

CONFIGS = ("off", "on")
TARGET = 1.03


def child(args: argparse.Namespace) -> dict:
    """Both runs in one process, alternating, each from the same seed: paired timings."""
    import numpy as np
    import torch

    import stratagem as sg

    rng = np.random.default_rng(args.seed)
    x = torch.from_numpy(rng.standard_normal((args.samples, 784), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=args.samples, dtype=np.int64))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(args.seed)
    with strategy.scope():
        model = sg.Model(h.mlp())
        model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=h.LR, momentum=h.MOMENTUM),
                      loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    folder = tempfile.mkdtemp(prefix="stratagem-timeline-bench-")
    events = []

    def train(config: str, epochs: int, rows: int) -> None:
        callbacks = [sg.experimental.Timeline(os.path.join(folder, "trace.json"))] if config == "on" else []
        model.fit(x[:rows], y[:rows], batch_size=args.batch, epochs=epochs, verbose=0, callbacks=callbacks)
        if config == "on":
            with open(os.path.join(folder, "trace.json")) as f:
                events.append(f.read().count('"ph": "X"'))

    result: dict[str, Any] = {f"{c}_{k}": [] for c in CONFIGS for k in ("ms", "cpu_ms")}
    for repeat in range(args.repeats + 1):   # repeat 0 warms up (threads, allocator, first calls)
        for config in (CONFIGS if repeat % 2 else CONFIGS[::-1]):
            torch.manual_seed(args.seed + repeat)
            wall, cpu = time.perf_counter(), time.process_time()
            train(config, args.epochs if repeat else 1, args.samples if repeat else args.batch * 4)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if repeat:
                result[f"{config}_ms"].append(wall * 1e3)
                result[f"{config}_cpu_ms"].append(cpu * 1e3)
    result["spans_per_step"] = events[-1] / (args.epochs * -(-args.samples // args.batch))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine, in all")
    parser.add_argument("--max-other-load", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=4, help="paired runs per round (each process)")
    parser.add_argument("--child", choices=["both"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        h.exit_cleanly_on_sigterm()
        h.emit(child(args))
        return
    warning = h.load_warning()
    if warning:
        print(warning)
    quiet = h.Quiet(args.max_wait, args.max_other_load)
    wall, cpu, spans = [], [], 0.0
    for rnd in range(args.rounds):
        quiet.wait()
        argv = [sys.executable, os.path.abspath(__file__), "--child", "both", "--samples", str(args.samples),
                "--batch", str(args.batch), "--epochs", str(args.epochs), "--seed", str(args.seed),
                "--repeats", str(args.repeats)]
        try:
            result = h.run_json(argv, timeout=900, env=h.child_env())
        except (RuntimeError, TimeoutError) as error:
            print(f"round {rnd + 1} failed: {error}")
            continue
        wall += [n / f for n, f in zip(result["on_ms"], result["off_ms"])]
        cpu += [n / f for n, f in zip(result["on_cpu_ms"], result["off_cpu_ms"])]
        spans = result["spans_per_step"]
        h.log(f"[round {rnd + 1}/{args.rounds}] on {h.median(result['on_ms']):.0f} ms, off "
              f"{h.median(result['off_ms']):.0f} ms (medians of {args.repeats} paired runs)")
    if not wall:
        print("no round succeeded")
        return
    ratio = h.median(wall)
    print(f"timeline on / off, wall time: {ratio:.3f}x (median of {len(wall)} paired runs, range "
          f"{h.spread(wall, 3)}); CPU time: {h.median(cpu):.3f}x (range {h.spread(cpu, 3)}); "
          f"{spans:.0f} spans a step; target <= {TARGET:.2f}: {'ok' if ratio <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
