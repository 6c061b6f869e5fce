#!/usr/bin/env python
"""DDP and its stratagem port in the same two worker processes, timed in alternating chunks.

``benchmarks/ddp.py`` times each configuration in fresh processes, a configuration after the
other; on a shared host the same configuration's step time moves by half between minutes (the
CPU time of a step too: the host's other tenants slow the cores, and no process list here shows
them), so the ratio of two such runs straddles a 5 % target for any affordable number of rounds.
Here each of the 2 workers holds both models -- the ``DistributedDataParallel`` one (over a
process group of its own) and the port's (``sg.MultiWorkerMirroredStrategy()`` +
``sg.experimental_set_strategy``, no wrapper, ``backward()``/``step()`` outside ``strategy.run``,
the loss through ``sg.nn.mean_over_replicas``) -- built from the same weights, trained on the same
batches with nanoGPT's loop (accumulation, ``require_backward_grad_sync``, ``clip_grad_norm_``,
AdamW groups), and times ``--chunk`` steps of one, then ``--chunk`` of the other, the order
swapped every pair (DDP first, then the port first). A pair's ratio (the port's chunk median over
DDP's) compares two chunks a fraction of a second apart, so what the host does over minutes
cancels; the verdict reads the median of the undisturbed pairs' ratios and its 95 % interval
(``_harness.verdict``). Target: the port at most 1.05x DDP, eager and compiled.

Both models train the same steps, so after the run their losses agree (the check line).

    python benchmarks/ddp_paired.py                        # eager and compiled, 60 pairs each
    python benchmarks/ddp_paired.py --modes eager --pairs 4 --chunk 2     # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402
from ddp import MODEL_OPTIONS, add_shared_options  # noqa: E402   (the same model and loop)

WORLD, TIMEOUT_S, STEP_TARGET = 2, 120.0, 1.05


def child_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import stratagem as sg

    torch.set_num_threads(1)   # one intra-op thread per process: 2 processes on 2 cores
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.distinct, args.rows * WORLD, args.accumulate, args.block + 1),
                           generator=g)[:, args.rank * args.rows:(args.rank + 1) * args.rows]   # this worker's rows
    batches = [(t[..., :-1], t[..., 1:]) for t in tokens]
    compiled, k = args.child == "compiled", args.accumulate

    strategy = sg.MultiWorkerMirroredStrategy(
        communication_options=sg.CommunicationOptions(timeout_seconds=TIMEOUT_S))
    ddp_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def build() -> tuple[Any, Any]:
        net = h.gpt(args.dim, args.layers, args.vocab, args.heads, tied=True, seed=args.seed)
        params = [p for p in net.parameters() if p.requires_grad]   # nanoGPT's groups
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=args.lr, betas=(0.9, 0.95))
        return net, optimizer

    ddp_net, ddp_opt = build()   # no strategy set: plain PyTorch
    ddp_model = torch.nn.parallel.DistributedDataParallel(torch.compile(ddp_net) if compiled else ddp_net,
                                                          process_group=ddp_group)
    sg.experimental_set_strategy(strategy)
    our_net, our_opt = build()
    our_model = torch.compile(our_net) if compiled else our_net
    sg.experimental_set_strategy(None)
    sides = {"ddp": (ddp_model, ddp_opt, None), "ours": (our_model, our_opt, strategy)}

    def train_step(side: str, i: int) -> None:
        model, optimizer, scoped = sides[side]
        x, y = batches[i % len(batches)]
        for m in range(k):
            model.require_backward_grad_sync = m == k - 1   # the exchange at the last micro-step only
            loss = F.cross_entropy(model(x[:, m]).flatten(0, 1), y[:, m].flatten()) / k
            (loss if scoped is None else sg.nn.mean_over_replicas(loss)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    done = {"ddp": 0, "ours": 0}

    def chunk(side: str, steps: int) -> tuple[list[float], float | None]:
        """``steps`` steps of one side, each timed; the cores other processes kept busy meanwhile."""
        scoped = sides[side][2]
        sg.experimental_set_strategy(scoped)   # (untimed: the port runs with its strategy set, DDP without)
        times = []
        try:
            with h.CpuWindow(siblings=True) as window:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    train_step(side, done[side])
                    times.append(1e3 * (time.perf_counter() - t0))
                    done[side] += 1
        finally:
            sg.experimental_set_strategy(None)
        return times, window.foreign_cores

    started = time.perf_counter()
    for side in ("ddp", "ours"):   # warm-up (compiles)
        chunk(side, args.warmup)
    warmup_s = time.perf_counter() - started
    graphs = counters["stats"]["unique_graphs"]
    pairs = []
    for p in range(args.pairs):
        order = ("ddp", "ours") if p % 2 == 0 else ("ours", "ddp")
        got = {side: chunk(side, args.chunk) for side in order}
        pairs.append({side: {"median_ms": h.median(ms), "foreign": foreign} for side, (ms, foreign) in got.items()})

    def probe(net: Any) -> float:   # a first micro-batch's loss, eager
        with torch.no_grad():
            x, y = batches[0][0][:, 0], batches[0][1][:, 0]
            return float(F.cross_entropy(net(x).flatten(0, 1), y.flatten()))

    result = {"pairs": pairs, "warmup_s": warmup_s, "graphs_after_warmup": graphs,
              "graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"]),
              "loss": {"ddp": probe(ddp_net), "ours": probe(our_net)}, "steps": dict(done)}
    dist.barrier(group=ddp_group)
    sg.experimental_set_strategy(strategy)
    strategy.reduce(sg.ReduceOp.SUM, torch.zeros(1), axis=None)   # a barrier
    sg.experimental_set_strategy(None)
    return result


def report(args: argparse.Namespace, mode: str, ranks: list[dict]) -> list[str]:
    r0 = ranks[0]
    pairs = r0["pairs"]
    quiet = [p for p in pairs if all(s["foreign"] is None or s["foreign"] <= args.max_other_load for s in p.values())]
    use = quiet or pairs
    ratios = [p["ours"]["median_ms"] / p["ddp"]["median_ms"] for p in use]
    ddp_ms = h.median([p["ddp"]["median_ms"] for p in use])
    ours_ms = h.median([p["ours"]["median_ms"] for p in use])
    lines = [f"{mode}: DDP {ddp_ms:.2f} ms, port {ours_ms:.2f} ms a step (medians of the pairs' chunk medians, "
             f"rank 0); {len(quiet)} of {len(pairs)} pairs undisturbed; warm-up {r0['warmup_s']:.1f} s"]
    verdict = h.verdict(ratios, STEP_TARGET) if quiet else "n/a (no pair undisturbed on both sides)"
    lines.append(f"ours/DDP {mode}: {h.median(ratios):.3f}  IQR {h.quartiles(ratios) or '-'}  "
                 f"range {h.spread(ratios, 3) or '-'}  target {verdict}")
    losses = [r["loss"][side] for r in ranks for side in ("ddp", "ours")]
    by_rank = [abs(r["loss"]["ours"] - r["loss"]["ddp"]) / abs(r["loss"]["ddp"]) for r in ranks]
    lines.append(f"Check ({mode}): after {r0['steps']['ddp']} steps each, loss DDP {r0['loss']['ddp']:.6f}, port "
                 f"{r0['loss']['ours']:.6f}, max relative difference {max(by_rank):.1e}"
                 + ("" if max(by_rank) <= 1e-3 else "  MISMATCH") + f" ({len(losses)} losses)")
    if mode == "compiled":
        breaks = r0["graph_breaks"]
        lines.append(f"compiled: {r0['graphs']} graph(s), {r0['graphs_after_warmup']} during warm-up; compiled "
                     f"again after: {r0['graphs'] - r0['graphs_after_warmup']}; graph breaks: "
                     + (", ".join(f"{n} x {reason!r}" for reason, n in breaks.items()) if breaks else "none"))
    return lines


def parse_paired_args(argv: list[str] | None, description: str, *, pairs: int, chunk: int,
                      modes: tuple[str, ...] = ("eager", "compiled")) -> argparse.Namespace:
    """The options of a paired benchmark (this one, ``mirrored_paired.py``): modes, pairs, chunks, the model's."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--modes", nargs="+", choices=list(modes), default=list(modes))
    p.add_argument("--pairs", type=int, default=pairs, help="timed pairs of chunks per mode")
    p.add_argument("--chunk", type=int, default=chunk, help="steps per chunk")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps of each side first (compiled: they compile)")
    add_shared_options(p)
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="set aside pairs during which other processes kept more cores busy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.pairs, args.chunk, args.distinct, args.accumulate, args.rows, args.warmup) < 1:
        p.error("--pairs, --chunk, --distinct, --accumulate, --rows, --warmup must be >= 1")
    return args


def child_run(args: argparse.Namespace, mode: str) -> tuple[list[str], float]:
    """A paired benchmark's child (``mode``'s run): its arguments and a generous deadline."""
    argv = ["--child", mode, "--pairs", str(args.pairs), "--chunk", str(args.chunk), "--warmup", str(args.warmup),
            "--seed", str(args.seed)] + [f"--{name}={getattr(args, name)}" for name in MODEL_OPTIONS]
    return argv, 180 + (300 if mode.startswith("compiled") else 0) + 2 * (args.pairs * args.chunk + args.warmup) * 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_paired_args(argv, __doc__.split("\n\n")[0], pairs=60, chunk=8)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if h.as_child(args, child_main):
        return 0
    h.log(f"DDP and its port in the same processes: {args.modes}, {args.pairs} pairs of {args.chunk}-step chunks, "
          f"load {h.loadavg()}")
    lines = []
    for mode in args.modes:
        argv, timeout = child_run(args, mode)
        ranks = h.run_workers(os.path.abspath(__file__), argv, world=WORLD, timeout=timeout)
        lines += report(args, mode, ranks)
        h.log(f"{mode} done")
    print(f"\nGPT {args.layers} x {args.dim} ({args.heads} heads, vocab {args.vocab}, tied), {args.block} tokens x "
          f"{args.rows} rows per worker x {args.accumulate} micro-steps, AdamW, clip {args.clip}, float32; workers: "
          f"{WORLD} processes x 1 thread, gloo on loopback; {h.usable_cores()} cores; commit {h.git_commit()}")
    print("\n".join(lines))
    print("A pair: one chunk of each side, back to back, in the same processes; a ratio: the port's chunk median "
          "over DDP's; pairs with other processes keeping more than "
          f"{args.max_other_load} cores busy set aside; the verdict needs the median's 95 % interval on one side "
          "of the target.")
    warning = h.load_warning()
    if warning:
        print(warning)
    return 1 if any("MISMATCH" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
