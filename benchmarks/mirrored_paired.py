#!/usr/bin/env python
"""Plain PyTorch and MirroredStrategy(2) in the same process, timed in alternating chunks.

``benchmarks/ddp.py`` times ``plain`` and ``mirrored`` in fresh processes, one after the other;
on a shared host the speed of the same configuration moves by half between minutes, so the ratio
of two such runs is undecided for any affordable number of rounds. Here one process holds both
models, built from the same weights and trained on the same global batches with nanoGPT's loop
(``--accumulate`` micro-steps, ``clip_grad_norm_``, AdamW with weight-decay groups):

- ``plain``: torch's default intra-op threads, each global micro-batch whole;
- ``mirrored``: ``sg.MirroredStrategy(["cpu:0", "cpu:1"])``, the step in ``strategy.run`` on two
  replica threads (half the rows each, ``strategy.no_sync()`` for the micro-steps before the
  last, the loss through ``sg.nn.mean_over_replicas``).

It times ``--chunk`` steps of one, then ``--chunk`` of the other, the order swapped every pair.
torch's intra-op thread count is process-wide: before each chunk (untimed) it is set back to
torch's default, which plain uses and which the strategy divides between its replicas during
``run``. A pair's ratio (mirrored's chunk median over plain's) compares two chunks a fraction of a
second apart, so what the host does over minutes cancels; the verdict reads the median of the
undisturbed pairs' ratios and its 95 % interval. Each mode runs in a process of its own: ``eager``,
``compiled`` (``torch.compile`` of each model) and ``compiled_cpp`` (``torch.compile(model,
options={"cpp_wrapper": True})``); the target of a compiled mode's ratio is the eager one's median.

Why ``compiled_cpp``: inductor's default (Python) wrapper calls each fused CPU kernel through a
binding that holds the GIL while the kernel runs, so two replica threads' compiled kernels take
turns instead of running on two cores at once; the C++ wrapper runs the whole graph with the GIL
released. Plain PyTorch (one Python thread) gains a little from it, the replicas more.

The plain model also runs with the module forward pre-hook that stratagem installs at the first
multi-replica ``run`` (it returns at once outside ``run``): the process's modules all see it.
Both models train the same steps, so their losses agree after the run (the check line). Each
side's CPU time a step and the cores it kept busy (CPU time over wall time) say whether a slower
side did more work or left cores idle (replica threads waiting on each other or on the GIL).

    python benchmarks/mirrored_paired.py                         # the three modes, 40 pairs each
    python benchmarks/mirrored_paired.py --modes eager compiled_cpp
    python benchmarks/mirrored_paired.py --modes eager --pairs 4 --chunk 2     # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402
from ddp_paired import child_run, parse_paired_args  # noqa: E402

REPLICAS = 2
#: eager; ``torch.compile`` of each model; and compiled with inductor's C++ wrapper
MODES = ("eager", "compiled", "compiled_cpp")


def child_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import stratagem as sg

    default_threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.distinct, args.rows * REPLICAS, args.accumulate, args.block + 1),
                           generator=g)
    batches = [(t[..., :-1], t[..., 1:]) for t in tokens]   # (global rows, micro-steps, block)
    compiled, k = args.child.startswith("compiled"), args.accumulate
    # compiled_cpp: inductor's C++ wrapper runs each compiled graph with the GIL released
    options = {"cpp_wrapper": True} if args.child == "compiled_cpp" else None

    def build() -> tuple[Any, Any]:
        net = h.gpt(args.dim, args.layers, args.vocab, args.heads, tied=True, seed=args.seed)
        params = [p for p in net.parameters() if p.requires_grad]   # nanoGPT's groups
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=args.lr, betas=(0.9, 0.95))
        return net, optimizer

    plain_net, plain_opt = build()
    strategy = sg.MirroredStrategy([f"cpu:{r}" for r in range(REPLICAS)])
    with strategy.scope():
        mirrored_net, mirrored_opt = build()
    models = {"plain": torch.compile(plain_net, options=options) if compiled else plain_net,
              "mirrored": torch.compile(mirrored_net, options=options) if compiled else mirrored_net}

    def train_step(side: str, x: Any, y: Any) -> None:
        model, optimizer = models[side], (plain_opt if side == "plain" else mirrored_opt)
        for m in range(k):
            loss = F.cross_entropy(model(x[:, m]).flatten(0, 1), y[:, m].flatten()) / k
            if side == "plain":
                loss.backward()
                continue
            with strategy.no_sync() if m < k - 1 else contextlib.nullcontext():
                sg.nn.mean_over_replicas(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # an endless cycle over the batches; next() splits one for the replicas
    replica_batches = iter(strategy.experimental_distribute_dataset(itertools.cycle(batches)))
    done = {"plain": 0, "mirrored": 0}

    def step(side: str) -> None:
        if side == "plain":
            train_step("plain", *batches[done["plain"] % len(batches)])
        else:
            strategy.run(train_step, args=("mirrored", *next(replica_batches)))
        done[side] += 1

    def chunk(side: str, steps: int) -> dict:
        """``steps`` steps of one side, each timed; CPU and the cores other processes kept busy."""
        torch.set_num_threads(default_threads)   # (untimed; run lowers it for its replicas, then restores)
        times = []
        with h.CpuWindow() as window:
            for _ in range(steps):
                t0 = time.perf_counter()
                step(side)
                times.append(1e3 * (time.perf_counter() - t0))
        return {"median_ms": h.median(times), "cpu_ms": 1e3 * window.own_cores * window.seconds / steps,
                "foreign": window.foreign_cores}

    started = time.perf_counter()
    for side in ("mirrored", "plain"):   # warm-up (compiles); mirrored first: its forward pre-hook is then in place
        chunk(side, args.warmup)
    warmup_s = time.perf_counter() - started
    graphs = counters["stats"]["unique_graphs"]
    pairs = []
    for p in range(args.pairs):
        order = ("plain", "mirrored") if p % 2 == 0 else ("mirrored", "plain")
        pairs.append({side: chunk(side, args.chunk) for side in order})

    def probe(net: Any) -> float:   # a first micro-batch's loss, eager, outside run (the primary weights)
        with torch.no_grad():
            x, y = batches[0][0][:, 0], batches[0][1][:, 0]
            return float(F.cross_entropy(net(x).flatten(0, 1), y.flatten()))

    return {"pairs": pairs, "warmup_s": warmup_s, "graphs_after_warmup": graphs, "threads": default_threads,
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"]),
            "loss": {"plain": probe(plain_net), "mirrored": probe(mirrored_net)}, "steps": dict(done)}


def report(args: argparse.Namespace, mode: str, r: dict, target: float | None) -> tuple[list[str], list[float]]:
    pairs = r["pairs"]
    quiet = [p for p in pairs if all(s["foreign"] is None or s["foreign"] <= args.max_other_load for s in p.values())]
    use = quiet or pairs
    ratios = [p["mirrored"]["median_ms"] / p["plain"]["median_ms"] for p in use]
    cpu = [p["mirrored"]["cpu_ms"] / p["plain"]["cpu_ms"] for p in use]
    ms = {side: h.median([p[side]["median_ms"] for p in use]) for side in ("plain", "mirrored")}
    cpu_ms = {side: h.median([p[side]["cpu_ms"] for p in use]) for side in ("plain", "mirrored")}
    lines = [f"{mode}: plain {ms['plain']:.2f} ms ({cpu_ms['plain']:.1f} CPU ms, {cpu_ms['plain'] / ms['plain']:.2f} "
             f"cores busy), Mirrored(2) {ms['mirrored']:.2f} ms ({cpu_ms['mirrored']:.1f} CPU ms, "
             f"{cpu_ms['mirrored'] / ms['mirrored']:.2f} cores busy) a step (medians of the pairs' chunks); {len(quiet)} "
             f"of {len(pairs)} pairs undisturbed; warm-up {r['warmup_s']:.1f} s; {r['threads']} intra-op threads by default"]
    if not quiet:
        verdict = "n/a (no pair undisturbed)"
    else:
        verdict = h.verdict(ratios, target) if target is not None else f"interval {h.interval_text(ratios)}"
    lines.append(f"Mirrored(2)/plain {mode}: {h.median(ratios):.3f}  IQR {h.quartiles(ratios) or '-'}  "
                 f"range {h.spread(ratios, 3) or '-'}  " + (f"target {verdict}" if target is not None else verdict)
                 + f"; CPU time ratio {h.median(cpu):.3f} (IQR {h.quartiles(cpu) or '-'})")
    diff = abs(r["loss"]["mirrored"] - r["loss"]["plain"]) / abs(r["loss"]["plain"])
    lines.append(f"Check ({mode}): after {r['steps']['plain']} steps each, loss plain {r['loss']['plain']:.6f}, "
                 f"Mirrored(2) {r['loss']['mirrored']:.6f}, relative difference {diff:.1e}"
                 + ("" if diff <= 1e-3 else "  MISMATCH"))
    if mode != "eager":
        breaks = r["graph_breaks"]
        lines.append(f"{mode}: {r['graphs']} graph(s) (plain's and each replica's), {r['graphs_after_warmup']} "
                     f"during warm-up; compiled again after: {r['graphs'] - r['graphs_after_warmup']}; graph breaks: "
                     + (", ".join(f"{n} x {reason!r}" for reason, n in breaks.items()) if breaks else "none"))
    return lines, ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_paired_args(argv, __doc__.split("\n\n")[0], pairs=40, chunk=6, modes=MODES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if h.as_child(args, child_main):
        return 0
    h.log(f"plain and Mirrored(2) in the same process: {args.modes}, {args.pairs} pairs of {args.chunk}-step chunks, "
          f"load {h.loadavg()}")
    lines, eager_ratios = [], None
    for mode in sorted(args.modes, key=MODES.index):   # eager first: its median is the compiled modes' target
        argv, timeout = child_run(args, mode)
        result = h.run_json([sys.executable, os.path.abspath(__file__), *argv], timeout)
        target = h.median(eager_ratios) if mode != "eager" and eager_ratios else None
        more, ratios = report(args, mode, result, target)
        lines += more
        eager_ratios = ratios if mode == "eager" else eager_ratios
        h.log(f"{mode} done")
    print(f"\nGPT {args.layers} x {args.dim} ({args.heads} heads, vocab {args.vocab}, tied), {args.block} tokens x "
          f"{args.rows} rows per replica x {args.accumulate} micro-steps, AdamW, clip {args.clip}, float32; one "
          f"process; {h.usable_cores()} cores; commit {h.git_commit()}")
    print("\n".join(lines))
    print("A pair: one chunk of each side, back to back, in the same process; a ratio: Mirrored(2)'s chunk median "
          f"over plain's; pairs with other processes keeping more than {args.max_other_load} cores busy set aside; "
          "the verdict (compiled modes, against the eager median) needs the median's 95 % interval on one side "
          "of it.")
    warning = h.load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
