#!/usr/bin/env python
"""``sg.Model.fit`` against the same training written as a custom loop, both under Mirrored(2).

The Mirrored benchmark's MLP 784-1024-1024-10 (SGD, lr 0.01, momentum 0.9, cross-entropy),
``--samples`` synthetic examples in global batches of ``--batch``, 2 epochs, reshuffled every
epoch, with metrics on in both: the loss as a ``Mean`` and ``SparseCategoricalAccuracy``,
updated in every replica at every step.

- ``custom``: the README's loop -- each epoch a permutation, the batches cut from the tensors,
  ``experimental_distribute_dataset``, ``strategy.run(step)``; the metrics read at the end
  of each epoch;
- ``fit``: ``model.fit(x, y, batch_size=..., epochs=2, verbose=0)``, whose input is a
  DataLoader over the tensors (one indexing per batch) through the same distributed dataset.

Each round is a fresh interpreter that builds both (same initial weights), warms both up, then
runs them ``--repeats`` times alternately, each run from the same seed (so both train
identically: the check line compares their losses). The ratio is taken per pair of
neighbouring runs and reported as the median over all pairs, for wall time and for the
process's CPU time (less sensitive to other processes on a shared machine). Target: <= 1.05.

    python benchmarks/fit.py                 # 5 rounds
    python benchmarks/fit.py --rounds 3 --repeats 6 --samples 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

CONFIGS = ("custom", "fit")
TARGET = 1.05


def child(args: argparse.Namespace) -> dict:
    """Both trainings in one process, alternating, each from the same seed: paired timings."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    rng = np.random.default_rng(args.seed)
    x = torch.from_numpy(rng.standard_normal((args.samples, 784), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=args.samples, dtype=np.int64))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])

    def build() -> tuple:
        torch.manual_seed(args.seed)
        with strategy.scope():
            module = h.mlp()
            optimizer = torch.optim.SGD(module.parameters(), lr=h.LR, momentum=h.MOMENTUM)
            return (module, optimizer, sg.metrics.Mean(name="loss"),
                    sg.metrics.SparseCategoricalAccuracy(name="accuracy"))

    module, optimizer, _, fit_accuracy = build()
    with strategy.scope():
        model = sg.Model(module)
        model.compile(optimizer=optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[fit_accuracy])

    def train_fit(epochs: int, rows: int) -> list[float]:
        return model.fit(x[:rows], y[:rows], batch_size=args.batch, epochs=epochs, verbose=0).history["loss"]

    c_module, c_optimizer, loss_metric, accuracy = build()

    def step(batch: Any) -> None:
        inputs, labels = batch
        logits = c_module(inputs)
        per_example = F.cross_entropy(logits, labels, reduction="none")
        loss = sg.nn.compute_average_loss(per_example)
        c_optimizer.zero_grad()
        loss.backward()
        c_optimizer.step()
        loss_metric.update_state(per_example.detach())
        accuracy.update_state(labels, logits.detach())

    def train_custom(epochs: int, rows: int) -> list[float]:
        losses = []
        for _ in range(epochs):
            loss_metric.reset_state()
            accuracy.reset_state()
            # the permutation a shuffling DataLoader draws (fit's), from the same global generator:
            # its iterator's base seed, then the sampler's seed
            torch.empty((), dtype=torch.int64).random_()
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
            batches = [(x[i], y[i]) for i in order.split(args.batch)]
            for batch in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, args=(batch,))
            losses.append(float(loss_metric.result()))
            float(accuracy.result())
        return losses

    trains = {"custom": train_custom, "fit": train_fit}
    result: dict[str, Any] = {f"{c}_{k}": [] for c in CONFIGS for k in ("ms", "cpu_ms", "loss")}
    for repeat in range(args.repeats + 1):   # repeat 0 warms up (threads, allocator, first calls)
        for config in (CONFIGS if repeat % 2 else CONFIGS[::-1]):
            torch.manual_seed(args.seed + repeat)
            wall, cpu = time.perf_counter(), time.process_time()
            losses = trains[config](args.epochs if repeat else 1, args.samples if repeat else args.batch * 4)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if repeat:
                result[f"{config}_ms"].append(wall * 1e3)
                result[f"{config}_cpu_ms"].append(cpu * 1e3)
                result[f"{config}_loss"].append(losses[-1])
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
    wall, cpu, losses = [], [], []
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
        wall += [f / c for f, c in zip(result["fit_ms"], result["custom_ms"])]
        cpu += [f / c for f, c in zip(result["fit_cpu_ms"], result["custom_cpu_ms"])]
        losses += [abs(f - c) / abs(c) for f, c in zip(result["fit_loss"], result["custom_loss"])]
        h.log(f"[round {rnd + 1}/{args.rounds}] fit {h.median(result['fit_ms']):.0f} ms, custom "
              f"{h.median(result['custom_ms']):.0f} ms (medians of {args.repeats} paired runs)")
    if not wall:
        print("no round succeeded")
        return
    print(f"Check: last epoch's loss, fit vs custom, max relative difference {max(losses):.1e}"
          + (" (same training)" if max(losses) < 1e-5 else " -- DIFFERENT TRAINING"))
    ratio = h.median(wall)
    print(f"fit / custom loop, wall time: {ratio:.3f}x (median of {len(wall)} paired runs, range "
          f"{h.spread(wall, 3)}); CPU time: {h.median(cpu):.3f}x (range {h.spread(cpu, 3)}); "
          f"target <= {TARGET:.2f}: {'ok' if ratio <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
