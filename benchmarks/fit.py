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

Every measurement runs in a fresh interpreter after a warm-up epoch, in interleaved rounds;
``x custom`` is the median over rounds of the ratio of the two times measured in the same
round. Target: <= 1.05.

    python benchmarks/fit.py                 # 5 rounds
    python benchmarks/fit.py --rounds 3 --samples 2048
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
    import numpy as np
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    rng = np.random.default_rng(args.seed)
    x = torch.from_numpy(rng.standard_normal((args.samples, 784), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=args.samples, dtype=np.int64))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(args.seed)
    with strategy.scope():
        module = h.mlp()
        optimizer = torch.optim.SGD(module.parameters(), lr=h.LR, momentum=h.MOMENTUM)
        loss_metric = sg.metrics.Mean(name="loss")
        accuracy = sg.metrics.SparseCategoricalAccuracy(name="accuracy")

    if args.child == "fit":
        model = sg.Model(module, strategy=strategy)
        model.compile(optimizer=optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[accuracy])

        def train(epochs: int, rows: int) -> Any:
            return model.fit(x[:rows], y[:rows], batch_size=args.batch, epochs=epochs, verbose=0).history["loss"]
    else:
        def step(batch: Any) -> None:
            inputs, labels = batch
            logits = module(inputs)
            per_example = F.cross_entropy(logits, labels, reduction="none")
            loss = sg.nn.compute_average_loss(per_example)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_metric.update_state(per_example.detach())
            accuracy.update_state(labels, logits.detach())

        def train(epochs: int, rows: int) -> Any:
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

    train(1, args.batch * 4)   # warm-up: threads, allocator, first-call costs
    started = time.perf_counter()
    losses = train(args.epochs, args.samples)
    seconds = time.perf_counter() - started
    return {"total_ms": seconds * 1e3, "final_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine, in all")
    parser.add_argument("--max-other-load", type=float, default=0.3)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        h.exit_cleanly_on_sigterm()
        h.emit(child(args))
        return
    warning = h.load_warning()
    if warning:
        print(warning)

    def measure(config: str, rnd: int) -> dict:
        argv = [sys.executable, os.path.abspath(__file__), "--child", config, "--samples", str(args.samples),
                "--batch", str(args.batch), "--epochs", str(args.epochs), "--seed", str(args.seed)]
        return h.run_json(argv, timeout=600, env=h.child_env())

    rounds = h.Rounds(CONFIGS, args.rounds, h.Quiet(args.max_wait, args.max_other_load)).run(measure)
    ratios = rounds.ratio("fit", "custom", "total_ms")
    rows = []
    for config in CONFIGS:
        times = [r["total_ms"] for r in rounds.results[config]]
        rows.append([config, f"{h.median(times):.0f}" if times else "failed",
                     f"{args.epochs * args.samples / h.median(times) * 1e3:,.0f}" if times else ""])
    print(h.format_table(["config", "median ms (2 epochs)", "samples/s"], rows, align="lrr"))
    losses = {c: [r["final_loss"] for r in rounds.results[c]] for c in CONFIGS}
    if all(losses.values()):
        diff = abs(losses["fit"][0] - losses["custom"][0]) / abs(losses["custom"][0])
        print(f"Check: last epoch's loss, fit vs custom, relative difference {diff:.1e}"
              + ("" if diff < 1e-4 else " -- DIFFERENT TRAINING (shuffling orders differ)"))
    if ratios:
        ratio = h.median(ratios)
        print(f"fit / custom loop: {ratio:.3f}x (median of {len(ratios)} rounds, range {h.spread(ratios, 3)}); "
              f"target <= {TARGET:.2f}: {'ok' if ratio <= TARGET else 'MISSED'}")
    for error in rounds.errors:
        print("error:", error)


if __name__ == "__main__":
    main()
