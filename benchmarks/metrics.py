#!/usr/bin/env python
"""What sg.metrics cost in a MirroredStrategy training step, against metrics written by hand.

Trains the benchmark MLP (784-1024-1024-10, SGD) under ``sg.MirroredStrategy(["cpu:0",
"cpu:1"])``, three ways, in interleaved rounds in one process:

- ``none``: the step alone (its loss reduced with ``strategy.reduce``, as a loop prints it);
- ``by_hand``: the step also returns the number of correct predictions and the loss sum; the
  loop reduces them with ``strategy.reduce`` and keeps running totals (a custom loop's metrics);
- ``sg_metrics``: the step updates ``sg.metrics.SparseCategoricalAccuracy`` and
  ``sg.metrics.Mean`` inside ``run``; the loop reads both ``result()`` after every step (as a
  progress bar does).

Prints ms per step and the ratios ``sg_metrics / by_hand`` and ``sg_metrics / none``, each the
median over rounds of the per-round ratio (range beside it). See benchmarks/README.md for how
steps are timed (undisturbed chunks only).

    python benchmarks/metrics.py                 # batch 128, 5 rounds
    python benchmarks/metrics.py --batch 512 --rounds 3
    python benchmarks/metrics.py --quick         # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

CONFIGS = ("none", "by_hand", "sg_metrics")


def build(batch: int, distinct: int):
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    torch.manual_seed(0)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = h.mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        accuracy = sg.metrics.get("accuracy", loss="sparse_categorical_crossentropy")
        loss_mean = sg.metrics.Mean(name="loss")
    x_np, y_np = h.synthetic_batches(batch, distinct)
    batches = list(strategy.experimental_distribute_dataset(
        [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in zip(x_np, y_np)]))

    def train(x, y):
        logits = model(x)
        per_example = F.cross_entropy(logits, y, reduction="none")
        loss = sg.nn.compute_average_loss(per_example)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return logits.detach(), per_example.detach(), loss.detach()

    def step_none(x, y):
        return train(x, y)[2]

    def step_by_hand(x, y):
        logits, per_example, loss = train(x, y)
        return loss, (logits.argmax(-1) == y).sum(), per_example.sum(), torch.tensor(float(len(y)))

    def step_sg(x, y):
        logits, per_example, loss = train(x, y)
        accuracy.update_state(y, logits)
        loss_mean.update_state(per_example)
        return loss

    totals = torch.zeros(3)

    def run(config: str, i: int) -> None:
        batch_i = batches[i % len(batches)]
        if config == "none":
            strategy.reduce("sum", strategy.run(step_none, args=batch_i), axis=None)
        elif config == "by_hand":
            loss, correct, loss_sum, count = strategy.run(step_by_hand, args=batch_i)
            strategy.reduce("sum", loss, axis=None)
            totals.add_(torch.stack([strategy.reduce("sum", v, axis=None).float() for v in (correct, loss_sum, count)]))
            (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
        else:
            strategy.reduce("sum", strategy.run(step_sg, args=batch_i), axis=None)
            accuracy.result().item(), loss_mean.result().item()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="undisturbed steps timed per measurement")
    parser.add_argument("--distinct", type=int, default=8)
    parser.add_argument("--max-other-load", type=float, default=0.3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 4
    run = build(args.batch, args.distinct)
    def measure(config: str, rnd: int) -> dict:
        timing = h.timed_loop(lambda i: run(config, i), warmup=3, steps=args.steps,
                              max_other_load=args.max_other_load, patience_s=5.0, max_steps=10 * args.steps)
        return {"step_ms": h.median(timing["step_ms"]), "cpu_ms": h.median(timing["cpu_ms"])}

    rounds = h.Rounds(CONFIGS, args.rounds).run(measure)
    rows = []
    for config in CONFIGS:
        ms = [r["step_ms"] for r in rounds.results[config]]
        cpu = [r["cpu_ms"] for r in rounds.results[config]]
        rows.append([config, f"{h.median(ms):.2f}" if ms else "failed", f"{h.median(cpu):.2f}" if cpu else ""])
    print(f"MirroredStrategy(2), MLP, batch {args.batch}: per step, median over {args.rounds} rounds")
    print(h.format_table(["config", "ms", "cpu ms"], rows))
    for key in ("step_ms", "cpu_ms"):
        for baseline in ("by_hand", "none"):
            ratios = rounds.ratio("sg_metrics", baseline, key)
            if ratios:
                print(f"{key}: sg_metrics / {baseline}: {h.median(ratios):.3f}x  (range {h.spread(ratios, 3)})")
    warning = h.load_warning()
    if warning:
        print(warning)
    sys.exit(1 if rounds.errors else 0)


if __name__ == "__main__":
    main()
