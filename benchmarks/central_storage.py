#!/usr/bin/env python
"""CentralStorageStrategy against MirroredStrategy and plain PyTorch: memory held, and step time.

The workload is the Mirrored benchmark's MLP 784-1024-1024-10 with SGD (momentum 0.9) or Adam
(``--optimizer``), on ``--replicas`` compute devices. Configurations, each in a fresh process,
in interleaved rounds (see benchmarks/README.md): ``plain`` (PyTorch on one device),
``mirrored`` (``MirroredStrategy``) and ``central`` (``CentralStorageStrategy``, parameters on
the CPU).

Memory, per configuration, after training (gradients and optimizer state exist):

- on CPU (logical devices ``cpu:0``, ``cpu:1``, ...: one memory): the bytes of every distinct
  tensor storage the process holds, input batches excluded, split into parameters (what the
  module holds), the replicas' own copies (storage other than the parameters'), gradients, and
  the rest (optimizer state). Then what each GPU would hold, from the measured sizes.
- on CUDA (``--device cuda``: every visible GPU, or ``--replicas`` of them):
  ``torch.cuda.max_memory_allocated`` of each device over the timed steps.

    python benchmarks/central_storage.py                          # CPU, 2 replicas, SGD, batch 128 and 512
    python benchmarks/central_storage.py --optimizer adam --replicas 3 --rounds 3
    python benchmarks/central_storage.py --device cuda            # on a machine with GPUs
    python benchmarks/central_storage.py --quick                  # smoke test
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

CONFIGS = ("plain", "mirrored", "central")
MIB = 2.0 ** 20


# ================================================================ child side

def torch_child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    cuda = args.device == "cuda"
    if cuda:
        count = torch.cuda.device_count()
        if count == 0:
            return {"skipped": "--device cuda: no CUDA device is visible"}
        devices = [f"cuda:{i}" for i in range(min(args.replicas or count, count))]
    else:
        devices = [f"cpu:{i}" for i in range(args.replicas or 2)]
    first = torch.device(devices[0].replace("cpu:0", "cpu"))
    x_np, y_np = h.synthetic_batches(args.batch, args.distinct, seed=args.seed)
    xs = [torch.from_numpy(x) for x in x_np]
    ys = [torch.from_numpy(y) for y in y_np]
    inputs = {t.untyped_storage().data_ptr() for t in xs + ys}

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        if args.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        return torch.optim.SGD(params, lr=h.LR, momentum=h.MOMENTUM)

    torch.manual_seed(args.seed)
    config = args.child
    strategy = None
    if config == "plain":
        model = h.mlp().to(first)
        optimizer = make_optimizer(model.parameters())
        batches = [(x.to(first), y.to(first)) for x, y in zip(xs, ys)]
        inputs |= {t.untyped_storage().data_ptr() for b in batches for t in b}

        def one_step(i: int) -> None:
            x, y = batches[i % args.distinct]
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    else:
        strategy = (sg.MirroredStrategy(devices) if config == "mirrored"
                    else sg.CentralStorageStrategy(devices, parameter_device="cpu"))
        with strategy.scope():
            model = h.mlp()
            optimizer = make_optimizer(model.parameters())

        def step(batch: Any) -> None:
            x, y = batch
            loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        iterator = iter(strategy.experimental_distribute_dataset(itertools.cycle(list(zip(xs, ys)))))

        def one_step(i: int) -> None:
            strategy.run(step, args=(next(iterator),))

    if cuda:
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)

    def probe() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(xs[0].to(next(model.parameters()).device)),
                                         ys[0].to(next(model.parameters()).device)))

    result = h.timed_loop(one_step, warmup=args.warmup, steps=args.steps, patience_s=args.patience,
                          max_other_load=args.max_other_load, probe=probe)
    result["devices"] = devices
    if cuda:
        torch.cuda.synchronize()
        result["peak_mib"] = [torch.cuda.max_memory_allocated(d) / MIB for d in devices]
    else:
        result["held_mib"] = held_storages(model, strategy, inputs)
    return result


def held_storages(model: Any, strategy: Any, exclude: set[int]) -> dict[str, float]:
    """MiB of the distinct tensor storages this process holds, by role (input batches excluded)."""
    import gc

    import torch

    gc.collect()
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in exclude:
                sizes[storage.data_ptr()] = storage.nbytes()
    params = list(model.parameters())
    copies = [c for p in params for c in (strategy.experimental_local_results(p) if strategy else (p,))]
    roles = {"parameters": {p.untyped_storage().data_ptr() for p in params}}
    roles["replica copies"] = {c.untyped_storage().data_ptr() for c in copies} - roles["parameters"]
    roles["gradients"] = {t.grad.untyped_storage().data_ptr() for t in params + copies if t.grad is not None}
    counted: set[int] = set()
    result = {}
    for role, ptrs in roles.items():
        ptrs = (ptrs & sizes.keys()) - counted
        result[role] = sum(sizes[p] for p in ptrs) / MIB
        counted |= ptrs
    result["optimizer state, other"] = sum(n for p, n in sizes.items() if p not in counted) / MIB
    result["total"] = sum(sizes.values()) / MIB
    return result


# ================================================================ parent side

def measure(args: argparse.Namespace, config: str, batch: int) -> dict:
    argv = ["--child", config, "--batch", str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--distinct", str(args.distinct), "--seed", str(args.seed), "--patience", str(args.patience),
            "--max-other-load", str(args.max_other_load), "--device", args.device,
            "--optimizer", args.optimizer] + (["--replicas", str(args.replicas)] if args.replicas else [])
    timeout = 120 + args.patience + (args.steps + args.warmup) * 0.5 * max(1.0, batch / 512)
    result = h.run_json([sys.executable, os.path.abspath(__file__), *argv], timeout)
    if "skipped" in result:
        raise RuntimeError(result["skipped"])
    result["median_ms"] = h.median(result["step_ms"])
    return result


def run_tables(args: argparse.Namespace) -> tuple[list[str], dict]:
    out, raw = [], {}
    for batch in args.batch_sizes:
        rounds = h.Rounds(list(CONFIGS), args.rounds, h.Quiet(args.max_wait, args.max_other_load))
        rounds.run(lambda config, rnd: measure(args, config, batch))
        raw[batch] = {"rounds": rounds.results, "errors": rounds.errors}
        table = []
        for config in CONFIGS:
            results = [r for r in rounds.results[config] if not r["contended"]] or rounds.results[config]
            if not results:
                out.append(f"batch {batch}: {config} FAILED")
                continue
            steps = [t for r in results for t in r["step_ms"]]
            row = [config + ("!" if all(r["contended"] for r in results) else ""), batch,
                   f"{h.median(steps):.2f}", f"{batch / h.median(steps) * 1e3:,.0f}"]
            for baseline in ("plain", "mirrored"):
                ratios = rounds.ratio(config, baseline, "median_ms")
                row += [f"{h.median(ratios):.3f} {h.spread(ratios, 2)}" if ratios else ""]
            memory = results[-1].get("held_mib") or {}
            peaks = results[-1].get("peak_mib")
            row += [f"{memory['total']:.1f}" if memory else " / ".join(f"{p:.1f}" for p in peaks)]
            row += [f"{memory.get(k, 0.0):.1f}" for k in ("parameters", "replica copies", "gradients",
                                                         "optimizer state, other")] if memory else ["", "", "", ""]
            row += [f"{results[-1]['final_loss']:.5f}"]
            table.append(row)
        headers = ["config", "batch", "median ms", "samples/s", "x plain (range)", "x mirrored (range)",
                   "held MiB" if args.device == "cpu" else "peak MiB per GPU", "params", "copies", "grads",
                   "state+other", "loss"]
        out += [h.format_table(headers, table, align="lrrrllrrrrrr"), ""]
        if args.device == "cpu" and rounds.results["plain"]:
            out += gpu_projection(rounds.results["plain"][-1]["held_mib"], args)
    return out, raw


def gpu_projection(plain: dict[str, float], args: argparse.Namespace) -> list[str]:
    """What each of N GPUs would hold, from the sizes measured in plain PyTorch."""
    p, g, s = plain["parameters"], plain["gradients"], plain["optimizer state, other"]
    n = args.replicas or 2
    return [f"Per GPU on {n} GPUs, from these sizes (P = parameters {p:.1f}, G = gradients {g:.1f}, "
            f"S = {args.optimizer} state {s:.1f} MiB): Mirrored holds P+G+S = {p + g + s:.1f} MiB on every GPU; "
            f"CentralStorage holds a copy and its gradients, P+G = {p + g:.1f} MiB "
            f"({(s) / (p + g + s):.0%} less), and P+G+S = {p + g + s:.1f} MiB once on the CPU. "
            f"Activations come on top of both.", ""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--replicas", type=int, help="compute devices (default: 2 logical CPU devices; every GPU)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    h.add_timing_options(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    h.apply_timing_defaults(args, p)
    if args.replicas is not None and args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        h.emit(torch_child(args))
        return 0
    h.exit_cleanly_on_sigterm()
    h.log(f"CentralStorageStrategy benchmark: {args.device}, {args.optimizer}, batch sizes {args.batch_sizes}, "
          f"{args.rounds} round(s) of {args.warmup} warm-up + {args.steps} timed steps, load {h.loadavg()}")
    lines, raw = run_tables(args)
    print(f"\nMLP {'-'.join(map(str, h.MLP_LAYERS))} ({h.param_count() / 1e6:.2f} M params), {args.optimizer}; "
          f"{args.replicas or ('2' if args.device == 'cpu' else 'all')} {args.device} replicas; {args.rounds} "
          f"round(s) x {args.steps} steps (+{args.warmup} warm-up); {h.usable_cores()} cores; commit {h.git_commit()}")
    print("\n".join(lines))
    print("'x plain' / 'x mirrored' = median over rounds of the ratio of median step times measured in the same "
          "round, (min-max) over rounds; '!' = no undisturbed steps. Memory: distinct tensor storages held after "
          "training (CPU), or torch.cuda.max_memory_allocated per device (CUDA).")
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": raw}, f, indent=1, default=str)
    return 1 if any(b["errors"] for b in raw.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
