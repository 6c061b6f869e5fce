#!/usr/bin/env python
"""MultiWorkerMirroredStrategy against PyTorch's DistributedDataParallel, side by side.

Two worker processes, gloo over loopback, one intra-op thread each, global batch 128 (64 per
rank), SGD (lr 0.01, momentum 0.9), synthetic data (``--distinct`` global batches, cycled):

- ``ddp``: ``DistributedDataParallel`` with its defaults on a ``tcp://127.0.0.1`` process group;
  each rank keeps its 64 rows of every global batch; ``F.cross_entropy`` (mean).
- ``ours``: ``sg.MultiWorkerMirroredStrategy`` started with TF_CONFIG; every worker passes the
  global batches to ``experimental_distribute_dataset`` (which keeps this worker's slice inside
  the timed step) and runs ``strategy.run(step, ...)`` with ``sg.nn.compute_average_loss``.
- ``ab`` (unless ``--no-interleaved``): both built in the same two processes (DDP on the default
  group, the strategy on its own) and timed in alternating blocks of 5 steps, ABBA order.
- bandwidth (``--bw-steps``): a raw 64 MiB ``dist.all_reduce``, and ``strategy.run`` of a step
  whose only parameter has 16 Mi floats minus the same step without a strategy.

Models: the MLP 784-1024-1024-10 (``small``, 1.9 M parameters) and 784-4096-4096-1024-10
(``large``, 24 M). Every measurement runs in fresh processes; rounds are interleaved and the
ratio ours / DDP is the median over rounds of the ratio measured in the same round.

    python benchmarks/multi_worker.py                  # 4 rounds, both models, bandwidth
    python benchmarks/multi_worker.py --quick          # smoke test
    python benchmarks/multi_worker.py --accumulate 4 --bw-steps 0   # 4 micro-batches, one exchange
    python benchmarks/multi_worker.py --profile        # torch.profiler tables of both ranks' steps
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

WORLD, GLOBAL_BATCH, TIMEOUT_S, AB_BLOCK = 2, 128, 60.0, 5
BW_FLOATS = 16 * 2**20                 # 64 MiB of float32
MODELS = {"small": h.MLP_LAYERS, "large": (784, 4096, 4096, 1024, 10)}
STEP_TARGET = 1.05                     # ours / DDP step time, at most


# ================================================================ one rank

def rank_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import stratagem as sg

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    kind, _, model_name = args.child.partition(":")
    layers = MODELS.get(model_name, h.MLP_LAYERS)
    x_np, y_np = h.synthetic_batches(GLOBAL_BATCH, args.distinct, seed=args.seed)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in zip(x_np, y_np)]
    total = args.warmup + args.steps
    loop = dict(warmup=args.warmup, steps=args.steps, max_steps=args.steps, siblings=True,
                max_other_load=args.max_other_load)

    def init_ddp_group() -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def build_ddp() -> tuple[Any, Any]:
        torch.manual_seed(args.seed)
        model = h.mlp(layers)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=h.LR, momentum=h.MOMENTUM)
        rows = slice(args.rank * GLOBAL_BATCH // WORLD, (args.rank + 1) * GLOBAL_BATCH // WORLD)
        local = [(x[rows], y[rows]) for x, y in batches]   # what a DistributedSampler hands this rank

        def step(i: int) -> None:
            x, y = local[i % len(local)]
            opt.zero_grad()
            k = args.accumulate
            for m, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):   # DDP's exchange at the last only
                with ddp.no_sync() if m < k - 1 else contextlib.nullcontext():
                    (F.cross_entropy(ddp(xm), ym) / k).backward()
            opt.step()
        return model, step

    def build_ours(strategy: Any) -> tuple[Any, Any]:
        torch.manual_seed(args.seed)
        with strategy.scope():
            model = h.mlp(layers)
            opt = torch.optim.SGD(model.parameters(), lr=h.LR, momentum=h.MOMENTUM)
        iterator = iter(strategy.experimental_distribute_dataset([batches[i % len(batches)] for i in range(total)]))

        def replica_step(batch: Any) -> Any:
            x, y = batch
            opt.zero_grad()
            k = args.accumulate
            for m, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):   # one exchange, at the last
                loss = sg.nn.compute_average_loss(F.cross_entropy(model(xm), ym, reduction="none"),
                                                  global_batch_size=GLOBAL_BATCH)
                with strategy.no_sync() if m < k - 1 else contextlib.nullcontext():
                    loss.backward()
            opt.step()
            return loss
        return model, lambda i: strategy.run(replica_step, args=(next(iterator),))

    def loss_of(model: Any) -> float:
        with torch.no_grad():   # for ours, outside run the module reads its primary copy
            return float(F.cross_entropy(model(batches[0][0]), batches[0][1]))

    def new_strategy() -> Any:
        return sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=TIMEOUT_S))

    def barrier(strategy: Any) -> None:   # a cross-worker sum through the public API
        strategy.reduce(sg.ReduceOp.SUM, torch.zeros(1), axis=None)

    result: dict[str, Any] = {"rank": args.rank, "torch": torch.__version__}
    if kind in ("ddp", "ours"):
        if kind == "ddp":
            init_ddp_group()
            model, step = build_ddp()
        else:
            strategy = new_strategy()
            model, step = build_ours(strategy)
        if args.profile:
            for i in range(args.warmup):
                step(i)
            with h.Profile() as prof:
                for i in range(args.warmup, total):
                    step(i)
            result.update(events=prof.events, steps=args.steps)
        else:
            result.update(h.timed_loop(step, **loop, probe=lambda: loss_of(model)))
        dist.barrier() if kind == "ddp" else barrier(strategy)
    elif kind == "ab":
        init_ddp_group()
        ddp_model, ddp_step = build_ddp()
        ours_model, ours_step = build_ours(new_strategy())
        fns, done = {"ddp": ddp_step, "ours": ours_step}, {"ddp": 0, "ours": 0}
        for i in range(args.warmup):
            ddp_step(i)
            ours_step(i)
        times: dict[str, list] = {"ddp": [], "ours": [], "ddp_cpu": [], "ours_cpu": []}
        block = 0
        while min(done.values()) < args.steps:
            for name in (("ddp", "ours") if block % 4 in (0, 3) else ("ours", "ddp")):
                n = min(AB_BLOCK, args.steps - done[name])
                dist.barrier()
                start = args.warmup + done[name]
                t = h.timed_loop(lambda i: fns[name](start + i), warmup=0, steps=n, max_steps=n, siblings=True,
                                 min_chunk_s=float("inf"), max_other_load=args.max_other_load)
                times[name] += t["step_ms"]
                times[name + "_cpu"] += t["cpu_ms"]
                done[name] += n
            block += 1
        result.update(times, ddp_loss=loss_of(ddp_model), ours_loss=loss_of(ours_model))
        dist.barrier()
    elif kind == "bw_raw":
        init_ddp_group()
        buf = torch.ones(BW_FLOATS)
        result.update(h.timed_loop(lambda i: dist.all_reduce(buf.fill_(1.0) if i % 16 == 0 else buf), **loop))
        dist.barrier()
    elif kind == "bw_ours":
        strategy = new_strategy()

        class Big(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(BW_FLOATS))

            def forward(self) -> Any:
                return self.w.sum()

        def stepper(module: Any) -> Any:
            opt = torch.optim.SGD(module.parameters(), lr=1e-9)

            def step() -> None:
                opt.zero_grad()
                module().backward()
                opt.step()
            return step
        local_step = stepper(Big())
        with strategy.scope():
            big_step = stepper(Big())
        result["local_ms"] = h.timed_loop(lambda i: local_step(), **loop)["step_ms"]
        barrier(strategy)
        result["step_ms"] = h.timed_loop(lambda i: strategy.run(big_step), **loop)["step_ms"]
        barrier(strategy)
    else:
        raise SystemExit(f"unknown child {args.child!r}")
    if kind in ("ddp", "ab", "bw_raw"):
        dist.destroy_process_group()
    return result


# ================================================================ parent

def run_ranks(args: argparse.Namespace, child: str, profile: bool = False) -> list[dict]:
    """Both ranks of one measurement, in fresh processes with a deadline; their results."""
    per_step = 2.0 if child.endswith("large") or child.startswith("bw") else 0.3
    timeout = 90 + (args.steps + args.warmup) * per_step * (2 if child.startswith("ab") else 1)
    argv = ["--child", child, "--steps", str(args.bw_steps if child.startswith("bw") else args.steps),
            "--warmup", str(args.warmup), "--distinct", str(args.distinct), "--seed", str(args.seed),
            "--max-other-load", str(args.max_other_load), "--accumulate", str(args.accumulate)] + \
        (["--profile"] if profile else [])
    return h.run_workers(os.path.abspath(__file__), argv, world=WORLD, timeout=timeout)


def measure(args: argparse.Namespace, child: str) -> dict:
    for attempt in range(1 + args.retries):   # repeat a measurement that had no undisturbed step
        ranks = run_ranks(args, child)
        if not ranks[0].get("contended"):
            break
    r0 = ranks[0]
    out = {"ranks": ranks, "contended": bool(r0.get("contended"))}
    if child.startswith("ab"):
        out.update(ddp_ms=h.median(r0["ddp"]), ours_ms=h.median(r0["ours"]),
                   ddp_cpu_ms=h.median([a + b for a, b in zip(r0["ddp_cpu"], ranks[1]["ddp_cpu"])]),
                   ours_cpu_ms=h.median([a + b for a, b in zip(r0["ours_cpu"], ranks[1]["ours_cpu"])]),
                   loss=r0["ours_loss"], ddp_loss=r0["ddp_loss"])
    elif child == "bw_ours":
        out.update(comm_ms=h.median(r0["step_ms"]) - h.median(r0["local_ms"]), step_ms=h.median(r0["step_ms"]),
                   local_ms=h.median(r0["local_ms"]))
    else:
        out.update(median_ms=h.median(r0["step_ms"]), p90_ms=h.percentile(r0["step_ms"], 90),
                   cpu_ms=h.median(r0["cpu_ms"]) + h.median(ranks[1]["cpu_ms"]), loss=r0.get("final_loss"))
    return out


def report(args: argparse.Namespace, rounds: h.Rounds) -> list[str]:
    def mark(config: str) -> str:
        return "!" if any(r["contended"] for r in rounds.results[config]) else ""

    table, losses = [], []
    for model in args.models:
        name = f"{model} ({h.param_count(MODELS[model]) / 1e6:.1f} M)"
        for config, label in (("ddp", "DDP (gloo)"), ("ours", "MultiWorkerMirrored")):
            rs = rounds.results[f"{config}:{model}"]
            if not rs:
                table.append([name, label, "FAILED"] + [""] * 7)
                continue
            ratios = rounds.ratio(f"ours:{model}", f"ddp:{model}", "median_ms") if config == "ours" else []
            cpu = rounds.ratio(f"ours:{model}", f"ddp:{model}", "cpu_ms") if config == "ours" else []
            ratio = h.median(ratios) if ratios else None
            table.append([name, label + mark(f"{config}:{model}"), f"{h.median([r['median_ms'] for r in rs]):.2f}",
                          f"{h.median([r['p90_ms'] for r in rs]):.2f}",
                          "" if ratio is None else f"{ratio:.3f}", h.spread(ratios, 3),
                          "" if ratio is None else f"<={STEP_TARGET} {'ok' if ratio <= STEP_TARGET else 'MISSED'}",
                          f"{h.median([r['cpu_ms'] for r in rs]):.1f}", f"{h.median(cpu):.3f}" if cpu else "",
                          h.spread([r["median_ms"] for r in rs])])
            losses.append((model, config, h.median([r["loss"] for r in rs])))
    lines = [h.format_table(["model", "config", "median ms", "p90 ms", "ours/DDP", "range", "target", "CPU ms",
                             "CPU o/D", "round ms range"], table, align="llrrrrlrrr")]
    ab = [(m, rounds.results[f"ab:{m}"]) for m in args.models if rounds.results.get(f"ab:{m}")]
    if ab:
        lines.append(f"\nThe same in the same two processes (blocks of {AB_BLOCK} steps, ABBA order):")
        rows = []
        for model, rs in ab:
            ratios = [r["ours_ms"] / r["ddp_ms"] for r in rs]
            rows.append([model, f"{h.median([r['ddp_ms'] for r in rs]):.2f}",
                         f"{h.median([r['ours_ms'] for r in rs]):.2f}", f"{h.median(ratios):.3f}",
                         h.spread(ratios, 3), f"{h.median([r['ours_cpu_ms'] / r['ddp_cpu_ms'] for r in rs]):.3f}"])
            losses += [(model, "ddp", rs[0]["ddp_loss"]), (model, "ours", rs[0]["loss"])]
        lines.append(h.format_table(["model", "DDP ms", "ours ms", "ours/DDP", "range", "CPU o/D"], rows))
    raw, ours = rounds.results.get("bw_raw", []), rounds.results.get("bw_ours", [])
    if raw or ours:
        def busbw(ms: float) -> float:   # 2 (n-1)/n * bytes / time
            return 2 * (WORLD - 1) / WORLD * BW_FLOATS * 4 / (ms / 1e3) / 1e9
        rows = []
        if raw:
            ms = h.median([r["median_ms"] for r in raw])
            rows.append(["raw gloo dist.all_reduce", f"{ms:.2f}", f"{busbw(ms):.2f}", ""])
        if ours:
            ms = h.median([r["comm_ms"] for r in ours])
            paired = [raw_r["median_ms"] / o["comm_ms"] for raw_r in raw for o in ours
                      if raw_r["round"] == o["round"] and o["comm_ms"] > 0]
            rows.append(["ours: strategy.run step - local step", f"{ms:.2f}", f"{busbw(ms):.2f}" if ms > 0 else "",
                         f"{100 * h.median(paired):.1f}%" if paired else ""])
        lines += ["", h.format_table([f"{BW_FLOATS * 4 >> 20} MiB all-reduce, {WORLD} processes", "median ms",
                                      "bus GB/s", "ours/raw"], rows, align="lrrr")]
    for model in args.models:
        values = [loss for m, _, loss in losses if m == model and loss is not None]
        check = h.loss_check(f"Check ({model}): loss on global batch 0 after warmup+steps, ours vs DDP", values)
        lines += [check] if check else []
    lines.append("Step times are rank 0's kept steps (steps during which other processes kept <= "
                 f"{args.max_other_load} cores busy); 'ours/DDP' = median over rounds of the same round's ratio, "
                 "'range' its min-max; 'CPU ms' = both ranks' CPU time per step; '!' = some round had no "
                 "undisturbed step.")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="timed steps per measurement (default 20; --quick 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 5; --quick 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds, fresh processes each (default 4; --profile 1)")
    p.add_argument("--bw-steps", type=int, help="timed 64 MiB all-reduces per bandwidth measurement "
                                                "(default 16; --quick 3; 0 skips bandwidth)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                   help="skip DDP and ours side by side in the same processes")
    p.add_argument("--distinct", type=int, default=8, help="distinct synthetic global batches, cycled")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="set aside steps during which other processes kept more cores busy")
    p.add_argument("--retries", type=int, help="repeats of a measurement with no undisturbed step (default 1)")
    p.add_argument("--max-wait", type=float, help="seconds in all to wait for a quiet machine (default 90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="each step accumulates K micro-batches, exchanging gradients at the last only "
                        "(DDP's no_sync(), strategy.no_sync())")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 round, 4 steps")
    p.add_argument("--json", metavar="PATH", help="also write every raw measurement here")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of DDP's and ours' steps")
    for hidden in ("--child", "--rank", "--port"):
        p.add_argument(hidden, type=int if hidden != "--child" else str, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = (dict(steps=4, warmup=1, rounds=1, bw_steps=3, retries=0, max_wait=0.0) if args.quick else
                dict(steps=20, warmup=5, rounds=1 if args.profile else 4, bw_steps=16, retries=1, max_wait=90.0))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds, args.distinct) < 1 or min(args.warmup, args.bw_steps, args.retries) < 0:
        p.error("--steps, --rounds, --distinct must be >= 1; --warmup, --bw-steps, --retries >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        h.emit(rank_main(args))
        return 0
    h.exit_cleanly_on_sigterm()
    if args.profile:
        raw = {}
        for model in args.models:
            for config in ("ddp", "ours"):
                ranks = run_ranks(args, f"{config}:{model}", profile=True)
                raw[f"{config}:{model}"] = ranks
                for rank in ranks:
                    print(f"\n{config} {model}, rank {rank['rank']}: {rank['steps']} profiled steps "
                          f"after {args.warmup} warm-up")
                    print(h.profile_table(rank["events"], rank["steps"]))
        errors: list = []
    else:
        configs = [f"{c}:{m}" for m in args.models for c in (["ab"] if args.interleaved else []) + ["ddp", "ours"]]
        configs += ["bw_raw", "bw_ours"] if args.bw_steps else []
        h.log(f"MultiWorkerMirroredStrategy vs DDP: {WORLD} workers, global batch {GLOBAL_BATCH}, {args.rounds} "
              f"round(s) of {args.warmup} warm-up + {args.steps} steps, load {h.loadavg()}")
        rounds = h.Rounds(configs, args.rounds, h.Quiet(args.max_wait, args.max_other_load))
        rounds.run(lambda config, rnd: measure(args, config))
        print(f"\n{WORLD} worker processes x 1 intra-op thread, gloo over loopback, global batch {GLOBAL_BATCH}"
              + (f" in {args.accumulate} accumulated micro-batches" if args.accumulate > 1 else "")
              + f"; {args.rounds} round(s) x {args.steps} steps (+{args.warmup} warm-up); commit {h.git_commit()}")
        print("\n".join(report(args, rounds)))
        raw, errors = {"results": rounds.results, "errors": rounds.errors}, rounds.errors
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": raw}, f, indent=1, default=str)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
