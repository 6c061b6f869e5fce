"""The ``balance`` and ``recompute`` parts of ``model_parallel.py``: PipelineStrategy's options, measured.

Every rank is a process with 1 intra-op thread, gloo over loopback, started from TF_CONFIG; each
round runs in fresh processes. Inside a round the configurations are built side by side in the
same processes and their steps alternate (the order rotated at every step), so a busy moment of
a shared machine slows all alike; a ratio is the median of the per-step ratios, then the median
over rounds (range in brackets).

- **balance** (``--part balance``): an ``nn.Sequential`` of ``len(pattern)`` blocks
  ``Linear(D, H) - ReLU - Linear(H, D)``, ``H = 4D`` for a heavy block (``H`` in ``--pattern``)
  and ``D`` for a light one (``L``): their costs differ 4x. Trained by the schedule with the even
  split (the default: the same number of blocks per stage), ``split_points="auto"`` (by time) and
  ``split_points="auto", balance_by="memory"``. Reported: each split, the step time against the
  even split's, and the prediction from the per-stage costs the strategy printed: a step of m
  micro-batches takes about ``(m - 1) max(c) + sum(c)``.
- **recompute** (``--part recompute``): ``--layers`` transformer-MLP blocks ``LayerNorm - Linear(D,
  4D) - GELU - Linear(4D, D)`` plus the residual, trained without recomputation, with
  ``recompute=True`` (each stage) and with every block named. Reported per rank: the activations
  held between forward and backward (the peak bytes of tensors autograd saved and had not freed,
  ``saved_tensors_hooks``, each storage once, parameters left out) against the textbook value with
  recomputation (a stage keeps its input per micro-batch in flight: ``m`` for GPipe, ``min(m, p-r)``
  for 1F1B; a block its input), and the step time against the textbook estimate of one extra
  forward, ``(2F + B) / (F + B)`` with ``F`` and ``F + B`` timed on the whole model in each process
  (``4/3`` when the backward costs two forwards). The recomputation's own transient memory (one
  region's activations of one micro-batch, during its backward) is inside torch's checkpoint and
  not counted by the hooks.

    python benchmarks/model_parallel.py --part balance [--quick] [--schedule gpipe] [--pattern HHHLLLLL]
    python benchmarks/model_parallel.py --part recompute [--quick] [--schedule 1f1b] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402
import _pipeline_timeline as tl  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_parallel.py")
CONFIGS = {"balance": {"even": {}, "auto": {"split_points": "auto"},
                       "auto-memory": {"split_points": "auto", "balance_by": "memory"}},
           "recompute": {"off": {}, "stage": {"recompute": True}, "blocks": {"recompute": "blocks"}}}


# ================================================================ one rank

def uneven_model(dim: int, pattern: str, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, 4 * dim if c == "H" else dim), nn.ReLU(),
                                         nn.Linear(4 * dim if c == "H" else dim, dim)) for c in pattern))


def mlp_blocks(dim: int, layers: int, seed: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc, self.out = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: Any) -> Any:
            return x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))

    torch.manual_seed(seed)
    return nn.Sequential(*(Block() for _ in range(layers)))


def rank_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed + 1)
    x, y = torch.randn(args.batch, args.dim, generator=g), torch.randn(args.batch, args.dim, generator=g)
    build = (lambda: uneven_model(args.dim, args.pattern, args.seed)) if args.part == "balance" else \
        (lambda: mlp_blocks(args.dim, args.layers, args.seed))
    result: dict = {"rank": sg.cluster.resolve().worker_rank}
    if args.part == "recompute":   # F and F + B of one micro-batch on the whole model, in this process
        result.update(_forward_backward_ms(build(), x[:args.batch // args.microbatches], y, args.steps))
    steps, models = {}, {}
    for name, options in CONFIGS[args.part].items():
        if options.get("recompute") == "blocks":
            options = {"recompute": [str(i) for i in range(args.layers)]}
        strategy = sg.experimental.PipelineStrategy(num_microbatches=args.microbatches, schedule=args.schedule,
                                                    loss_fn=F.mse_loss, **options)
        with strategy.scope():
            model = build()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        steps[name], models[name] = _step(strategy, model, optimizer, x, y), (strategy, model)
    names = list(steps)
    losses: dict[str, float] = {}
    for _ in range(args.warmup):   # the first step of "auto" measures and cuts
        for name in names:
            losses[name] = steps[name]()
    if args.part == "recompute":   # one more step each, its saved activations counted
        result["held"] = {}
        for name in names:
            tracker = tl.SavedActivations([p for p in models[name][1].parameters() if not p.is_meta])
            with tracker:
                losses[name] = steps[name]()
            result["held"][name] = tracker.peak
    ms: dict[str, list[float]] = {name: [] for name in names}
    for k in range(args.steps):
        for name in names[k % len(names):] + names[:k % len(names)]:
            t0 = time.perf_counter()
            losses[name] = steps[name]()
            ms[name].append(1e3 * (time.perf_counter() - t0))
    result.update({"ms": ms, "loss": losses, "split": {n: s.split_points_of(m) for n, (s, m) in models.items()},
                   "stages": models[names[0]][0].stages_of(models[names[0]][1])})
    return result


def _step(strategy: Any, model: Any, optimizer: Any, x: Any, y: Any) -> Any:
    def train_step(x: Any, y: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = strategy.forward_backward(model, x, y)
        optimizer.step()
        return loss
    return lambda: float(strategy.run(train_step, args=(x, y)))


def _forward_backward_ms(model: Any, x: Any, y: Any, repeats: int) -> dict:
    import torch.nn.functional as F

    f, fb = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), y[:x.shape[0]])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        f.append(1e3 * (t1 - t0))
        fb.append(1e3 * (t2 - t0))
    return {"f_ms": h.median(f[1:]), "fb_ms": h.median(fb[1:])}


# ================================================================ parent

def run_round(args: argparse.Namespace) -> dict:
    """One round in fresh processes: every rank's result, and the lines the strategy printed."""
    from stratagem.testing import local_cluster

    cluster = local_cluster(args.world)
    argv = [sys.executable, SCRIPT, "--part", args.part, "--child", *args.child_argv]
    timeout = 180 + (args.warmup + args.steps + 1) * len(CONFIGS[args.part]) * args.step_budget_s
    with h.Processes() as procs:
        for rank in range(args.world):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
            procs.start(f"rank {rank}", argv, h.child_env(TF_CONFIG=tf_config))
        names = [f"rank {r}" for r in range(args.world)]
        procs.wait(names, timeout)
        outputs = [procs.output(n) for n in names]
    ranks = [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out in outputs]
    printed = [ln for out in outputs for ln in out.splitlines() if ln.startswith("PipelineStrategy:")]
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "printed": printed}


def paired(rank: dict, name: str, base: str) -> float:
    return h.median([a / b for a, b in zip(rank["ms"][name], rank["ms"][base])])


def balance_report(args: argparse.Namespace, rounds: list[dict]) -> list[str]:
    first = rounds[0]["ranks"][0]
    lines = [f"Balanced stages: p={args.world}, {args.schedule}, m={args.microbatches}, blocks {args.pattern} "
             f"(H: Linear({args.dim}, {4 * args.dim}) - ReLU - Linear({4 * args.dim}, {args.dim}); L: width "
             f"{args.dim}), batch {args.batch}, float32, SGD; {len(rounds)} round(s) x {args.steps} steps"]
    head = ["config", "split_points", "ms/step", "x even", "range", "predicted x even", "loss"]
    table = []
    for name in CONFIGS["balance"]:
        ratios = [paired(r["ranks"][0], name, "even") for r in rounds]
        announced = [ln for ln in rounds[0]["printed"] if ("balance_by='memory'" in ln) == (name == "auto-memory")]
        predicted = _predicted(announced[0], args.microbatches) if announced and name != "even" else None
        table.append([name, str(first["split"][name]), f"{h.median([h.median(r['ranks'][0]['ms'][name]) for r in rounds]):.1f}",
                      f"{h.median(ratios):.3f}", h.spread(ratios, 3), "" if predicted is None else f"{predicted:.3f}",
                      f"{first['loss'][name]:.6g}"])
    lines += [h.format_table(head, table), "what the strategy printed (rank 0, first round):"]
    lines += ["  " + ln for ln in rounds[0]["printed"]]
    return lines + ["predicted: a step of m micro-batches through stages of costs c_s (per micro-batch, as printed) "
                    "takes (m - 1) max(c) + sum(c) (the slowest stage paces the others, the first and last "
                    "micro-batch cross every stage; no communication, no optimizer); its ratio, balanced over "
                    "even (for balance_by='memory' the time per stage was not printed, so no prediction)"]


def _predicted(line: str, m: int) -> float | None:
    found = re.search(r"ms of forward\+backward per stage: \[([^\]]*)\] \(an even split: \[([^\]]*)\]\)", line)
    if not found:
        return None
    chosen, even = ([float(v) for v in part.split(",")] for part in found.groups())
    return ((m - 1) * max(chosen) + sum(chosen)) / ((m - 1) * max(even) + sum(even))


def recompute_report(args: argparse.Namespace, rounds: list[dict]) -> list[str]:
    p, m, mib = args.world, args.microbatches, 1 << 20
    rows = -(-args.batch // m)
    lines = [f"Activation recomputation: p={p}, {args.schedule}, m={m}, {args.layers} blocks LayerNorm - "
             f"Linear({args.dim}, {4 * args.dim}) - GELU - Linear({4 * args.dim}, {args.dim}) + residual, batch "
             f"{args.batch}, float32, SGD; {len(rounds)} round(s) x {args.steps} steps"]
    ranks0 = rounds[0]["ranks"]
    held_head = ["config"] + [f"held MiB r{r}" for r in range(p)] + [f"x off r{r}" for r in range(p)] + \
        [f"textbook MiB r{r}" for r in range(p)]
    table = []
    for name in CONFIGS["recompute"]:
        held = [ranks0[r]["held"][name] for r in range(p)]
        off = [ranks0[r]["held"]["off"] for r in range(p)]
        expected = []
        for r in range(p):
            in_flight = m if args.schedule == "gpipe" else tl.in_flight_1f1b(p, m, r)
            regions = {"off": None, "stage": 1, "blocks": len(ranks0[r]["stages"]) * args.layers // p}[name]
            expected.append("" if regions is None else f"{regions * in_flight * rows * args.dim * 4 / mib:.2f}")
        table.append([name] + [f"{v / mib:.2f}" for v in held] + [f"{a / b:.3f}" for a, b in zip(held, off)] + expected)
    lines += ["held: activations saved for backward and live at once, per rank (peak during a step)",
              h.format_table(held_head, table),
              "textbook: the recomputed regions' inputs (rows x D x 4 bytes) per micro-batch in flight "
              f"({'m' if args.schedule == 'gpipe' else 'min(m, p-r)'}); the loss's own saved tensors on the last "
              "stage come on top", ""]
    f = h.median([r["ranks"][0]["f_ms"] for r in rounds])
    fb = h.median([r["ranks"][0]["fb_ms"] for r in rounds])
    head = ["config", "ms/step", "x off", "range", "textbook x off", "loss"]
    table = []
    for name in CONFIGS["recompute"]:
        ratios = [paired(r["ranks"][0], name, "off") for r in rounds]
        table.append([name, f"{h.median([h.median(r['ranks'][0]['ms'][name]) for r in rounds]):.1f}",
                      f"{h.median(ratios):.3f}", h.spread(ratios, 3), "" if name == "off" else f"{(f + fb) / fb:.3f}",
                      f"{ranks0[0]['loss'][name]:.6g}"])
    return lines + [h.format_table(head, table),
                    f"textbook: one extra forward, (2F + B) / (F + B) with F = {f:.1f} ms and F + B = {fb:.1f} ms "
                    f"of one micro-batch through the whole model in one process ({(f + fb) / fb:.3f}; 4/3 = 1.333 "
                    f"when B = 2F)"]


def parse_args(argv: list[str], part: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"model_parallel.py --part {part}", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="pipeline processes (default 2)")
    p.add_argument("--schedule", default="gpipe" if part == "balance" else "1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--dim", type=int, help="width D (default 512; --quick 128)")
    p.add_argument("--pattern", default="HHHLLLLL", help="balance: heavy (H) and light (L) blocks in order")
    p.add_argument("--layers", type=int, default=8, help="recompute: blocks (default 8)")
    p.add_argument("--batch", type=int, help="batch size (default 256; --quick 64)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, help="timed steps of each configuration (default 12; --quick 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2; --quick 1)")
    p.add_argument("--rounds", type=int, help="rounds, fresh processes each (default 3; --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller model, 1 round")
    p.add_argument("--json", metavar="PATH", help="also write every raw measurement here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(dim=128, batch=64, steps=4, warmup=1, rounds=1) if args.quick else \
        dict(dim=512, batch=256, steps=12, warmup=2, rounds=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds, args.warmup, args.world) < 1 or set(args.pattern) - {"H", "L"}:
        p.error("--steps, --rounds, --warmup, --world must be >= 1; --pattern holds H and L only")
    args.part = part
    args.layers = len(args.pattern) if part == "balance" else args.layers
    args.child_argv = ["--world", str(args.world), "--schedule", args.schedule, "--dim", str(args.dim),
                       "--pattern", args.pattern, "--layers", str(args.layers), "--batch", str(args.batch),
                       "--microbatches", str(args.microbatches), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--seed", str(args.seed)]
    args.step_budget_s = 20.0 * (args.dim / 512) ** 2 * args.batch / 256 + 2.0
    return args


def main(argv: list[str], part: str) -> int:
    args = parse_args(argv, part)
    if args.child:
        h.emit(rank_main(args))
        return 0
    h.exit_cleanly_on_sigterm()
    load = h.loadavg()
    h.log(f"{part}: p={args.world}, {args.schedule}, {args.rounds} round(s); load {load}")
    rounds, failed = [], False
    for rnd in range(args.rounds):
        try:
            rounds.append(run_round(args))
            h.log(f"[round {rnd + 1}/{args.rounds}] done")
        except (RuntimeError, TimeoutError) as error:
            failed = True
            print(f"FAILED: round {rnd + 1}: {error}")
    if rounds:
        print(f"\n{h.usable_cores()} cores, load average at start {load}; commit {h.git_commit()}")
        print("\n".join(balance_report(args, rounds) if part == "balance" else recompute_report(args, rounds)))
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rounds": rounds}, f, indent=1, default=str)
    return 1 if failed or not rounds else 0
