#!/usr/bin/env python
"""A DistributedDataParallel script and its stratagem port, eager and compiled, side by side.

The loop is nanoGPT's ``train.py`` (as in examples/ddp_train.py): a GPT with tied embeddings,
``--accumulate`` micro-steps per step with the exchange skipped on all but the last
(``model.require_backward_grad_sync``), ``clip_grad_norm_``, AdamW with weight-decay groups,
``zero_grad(set_to_none=True)``; float32, synthetic tokens. Configurations:

- ``ddp``: 2 worker processes (gloo over loopback, 1 intra-op thread each), the model compiled
  (``compiled``) or not (``eager``), then wrapped in ``DistributedDataParallel``;
- ``ours``: the same processes and script ported as docs/from_ddp.md says:
  ``sg.MultiWorkerMirroredStrategy()`` + ``sg.experimental_set_strategy(strategy)`` before the
  model, no wrapper, ``backward()``/``step()`` outside ``strategy.run``, the loss through
  ``sg.nn.mean_over_replicas``;
- ``plain``: one process, torch's default threads, the global micro-batches whole;
- ``mirrored``: one process, ``sg.MirroredStrategy(["cpu:0", "cpu:1"])``, the step in
  ``strategy.run`` (``strategy.no_sync()`` for the micro-steps before the last).

Each worker of a step sees the same rows under DDP and ours (its slice of the global micro-batch),
so both train alike (the check line). Every measurement runs in fresh processes; rounds are
interleaved; a ratio is taken per round against the baseline of the same round (ours / DDP,
mirrored / plain) and summarised by its median and interquartile range. Targets: ours / DDP
<= 1.05 eager and compiled; Mirrored(2) / plain compiled at most its eager ratio. For compiled
configurations the report says what dynamo compiled: graphs, graph breaks (with their reasons)
and whether anything was compiled again after the warm-up.

    python benchmarks/ddp.py                          # 4 rounds, every configuration
    python benchmarks/ddp.py --rounds 1 --steps 2     # smoke test
    python benchmarks/ddp.py --configs ddp:eager ours:eager --rounds 8
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

WORLD, TIMEOUT_S = 2, 120.0
CONFIGS = {"ddp:eager": "DDP", "ours:eager": "port (MWMS)", "ddp:compiled": "DDP", "ours:compiled": "port (MWMS)",
           "plain:eager": "plain, 1 process", "mirrored:eager": "Mirrored(2), 1 process",
           "plain:compiled": "plain, 1 process", "mirrored:compiled": "Mirrored(2), 1 process"}
PAIRS = (("ours", "ddp"), ("mirrored", "plain"))   # (measured, baseline)
STEP_TARGET = 1.05   # ours / DDP, eager and compiled


# ================================================================ one process

def child_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import stratagem as sg

    kind, _, mode = args.child.partition(":")
    workers = kind in ("ddp", "ours")
    if workers:   # one intra-op thread per process: 2 processes on 2 cores
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    rows = args.rows * WORLD   # a global micro-batch
    tokens = torch.randint(0, args.vocab, (args.distinct, rows, args.accumulate, args.block + 1), generator=g)
    if workers:   # what a DistributedSampler hands this worker
        tokens = tokens[:, args.rank * args.rows:(args.rank + 1) * args.rows]
    batches = [(t[..., :-1], t[..., 1:]) for t in tokens]   # (rows, micro-steps, block)

    strategy = None
    if kind == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    elif kind == "ours":
        strategy = sg.MultiWorkerMirroredStrategy(
            communication_options=sg.CommunicationOptions(timeout_seconds=TIMEOUT_S))
        sg.experimental_set_strategy(strategy)
    elif kind == "mirrored":
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope() if kind == "mirrored" else contextlib.nullcontext():
        net = h.gpt(args.dim, args.layers, args.vocab, args.heads, tied=True, seed=args.seed)
        params = [p for p in net.parameters() if p.requires_grad]   # nanoGPT's groups
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=args.lr, betas=(0.9, 0.95))
    model = torch.compile(net) if mode == "compiled" else net
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    k = args.accumulate

    def micro_loss(x: Any, y: Any) -> Any:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / k   # the micro-steps' gradients add up
        return loss if strategy is None else sg.nn.mean_over_replicas(loss)

    def train_step(x: Any, y: Any) -> None:
        for m in range(k):
            if kind == "mirrored":   # per replica thread; DDP's attribute is one for both replicas
                with strategy.no_sync() if m < k - 1 else contextlib.nullcontext():
                    micro_loss(x[:, m], y[:, m]).backward()
                continue
            if workers:   # DDP exchanges gradients at the last micro-step only
                model.require_backward_grad_sync = m == k - 1
            micro_loss(x[:, m], y[:, m]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if kind == "mirrored":
        # an endless cycle over references to the batches; next() splits one for the replicas
        iterator = iter(strategy.experimental_distribute_dataset(itertools.cycle(batches)))

        def step(i: int) -> None:
            strategy.run(train_step, args=next(iterator))
    else:
        def step(i: int) -> None:
            train_step(*batches[i % len(batches)])

    def probe() -> float:   # after warm-up + steps: a first micro-batch's loss, eager (compiles nothing)
        with torch.no_grad():
            x, y = batches[0][0][:, 0], batches[0][1][:, 0]
            return float(F.cross_entropy(net(x).flatten(0, 1), y.flatten()))

    result: dict[str, Any] = {"kind": kind, "mode": mode, "threads": torch.get_num_threads(),
                              "params": sum(p.numel() for p in params)}
    started = time.perf_counter()
    for i in range(args.warmup):   # compiles (first forward and backward) under ``compiled``
        step(i)
    result["warmup_s"] = time.perf_counter() - started
    graphs = counters["stats"]["unique_graphs"]
    if workers:   # both workers time the same number of steps: a step is a collective
        loop = dict(steps=args.steps, max_steps=args.steps, siblings=True)
    else:
        loop = dict(steps=args.steps, patience_s=args.patience)
    timing = h.timed_loop(lambda i: step(args.warmup + i), warmup=0, max_other_load=args.max_other_load,
                          probe=probe, **loop)
    result.update(timing, graphs_after_warmup=graphs, graphs=counters["stats"]["unique_graphs"],
                  graph_breaks=dict(counters["graph_break"]))
    if kind == "ddp":
        dist.barrier()
        dist.destroy_process_group()
    elif kind == "ours":
        strategy.reduce(sg.ReduceOp.SUM, torch.zeros(1), axis=None)   # a barrier
        sg.experimental_set_strategy(None)
    return result


# ================================================================ parent

def measure(args: argparse.Namespace, config: str) -> dict:
    kind, _, mode = config.partition(":")
    argv = ["--child", config, "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--max-other-load", str(args.max_other_load), "--patience", str(args.patience)] + \
        [f"--{name}={getattr(args, name)}" for name in MODEL_OPTIONS]
    # generous: under load plain PyTorch's two intra-op threads take seconds a step, and compiling minutes
    timeout = 120 + (300 if mode == "compiled" else 0) + (args.steps + args.warmup) * 6.0 + args.patience
    script = os.path.abspath(__file__)
    if kind in ("ddp", "ours"):
        ranks = h.run_workers(script, argv, world=WORLD, timeout=timeout)
    else:
        ranks = [h.run_json([sys.executable, script, *argv], timeout)]
    r0 = ranks[0]
    return {"ranks": ranks, "contended": bool(r0["contended"]), "median_ms": h.median(r0["step_ms"]),
            "p90_ms": h.percentile(r0["step_ms"], 90), "cpu_ms": sum(h.median(r["cpu_ms"]) for r in ranks),
            "loss": r0["final_loss"], "warmup_s": r0["warmup_s"], "graphs": r0["graphs"],
            "graphs_after_warmup": r0["graphs_after_warmup"], "graph_breaks": r0["graph_breaks"]}


def report(args: argparse.Namespace, rounds: h.Rounds) -> list[str]:
    table, ratio_lines, compile_lines, ratios_by = [], [], [], {}
    for mode in ("eager", "compiled"):
        for kind, base in PAIRS:
            config, baseline = f"{kind}:{mode}", f"{base}:{mode}"
            for name in (baseline, config):
                rs = rounds.results.get(name)
                if rs is None:
                    continue
                if not rs:
                    table.append([name, CONFIGS[name], "FAILED"] + [""] * 6)
                    continue
                table.append([name + ("!" if any(r["contended"] for r in rs) else ""), CONFIGS[name],
                              f"{h.median([r['median_ms'] for r in rs]):.2f}",
                              f"{h.median([r['p90_ms'] for r in rs]):.2f}", h.spread([r["median_ms"] for r in rs]),
                              f"{h.median([r['cpu_ms'] for r in rs]):.1f}", f"{h.median([r['warmup_s'] for r in rs]):.1f}",
                              f"{sum(len(r['ranks'][0]['step_ms']) for r in rs if not r['contended'])}",
                              len(rs)])
                if mode == "compiled":
                    compile_lines.append(_compiled_summary(name, rs))
            if config in rounds.results and baseline in rounds.results:
                clean = rounds.ratio(config, baseline, "median_ms", clean=True)   # (False: disturbed rounds only)
                ratios_by[(kind, mode)] = (clean or rounds.ratio(config, baseline, "median_ms"), bool(clean))
    for mode in ("eager", "compiled"):
        if ("ours", mode) in ratios_by:
            ratio_lines.append(_ratio_line(f"ours/DDP {mode}", *ratios_by[("ours", mode)], STEP_TARGET))
    eager, compiled = ratios_by.get(("mirrored", "eager")), ratios_by.get(("mirrored", "compiled"))
    if eager is not None:
        ratio_lines.append(_ratio_line("Mirrored(2)/plain eager", *eager, None))
    if compiled is not None:
        target = h.median(eager[0]) if eager and eager[0] else None
        ratio_lines.append(_ratio_line("Mirrored(2)/plain compiled", *compiled, target)
                           + ("" if target else "  (target: the eager ratio, not measured)"))
    lines = [h.format_table(["config", "what", "median ms", "p90 ms", "round ms range", "CPU ms", "warm-up s",
                             "steps kept", "rounds"], table, align="llrrrrrrr"), ""]
    lines += ratio_lines + [""] + compile_lines
    for mode in ("eager", "compiled"):
        for kind, base in PAIRS:
            losses = [r["loss"] for c in (f"{kind}:{mode}", f"{base}:{mode}") for r in rounds.results.get(c, [])
                      if r.get("loss") is not None]
            check = h.loss_check(f"Check ({kind} vs {base}, {mode}): loss after warm-up + steps", losses)
            lines += [check] if check else []
    lines.append("Step times: the median of rank 0's kept steps (other processes kept <= "
                 f"{args.max_other_load} cores busy); a ratio: per round, the same round's medians (rounds where "
                 "neither side was disturbed throughout, when there are any), then median and interquartile range "
                 "over rounds; a verdict needs the median's 95 % interval (order statistics, narrower as rounds are "
                 "added) on one side of the target. '!' = some round kept no "
                 "undisturbed step.")
    return lines


def _ratio_line(name: str, ratios: list[float], undisturbed: bool, target: float | None) -> str:
    """The ratio's line; ``undisturbed``: from rounds in which both sides kept undisturbed steps
    (else from disturbed rounds: no verdict)."""
    if not ratios:
        return f"{name}: n/a (no round measured both)"
    if not undisturbed and target is not None:
        return (f"{name}: {h.median(ratios):.3f}!  range {h.spread(ratios, 3) or '-'}  target <={target:.2f} n/a "
                f"(!: no round kept undisturbed steps on both sides)")
    text = (f"{name}: {h.median(ratios):.3f}{'' if undisturbed else '!'}  IQR {h.quartiles(ratios) or '-'}  "
            f"range {h.spread(ratios, 3) or '-'}")
    return text + (f"  target {h.verdict(ratios, target)}" if target is not None else
                   f"  ({len(ratios)} round{'s' if len(ratios) > 1 else ''})")


def _compiled_summary(config: str, rs: list[dict]) -> str:
    """What dynamo did in rank 0 / the process of each round (the same code: the same answer)."""
    r = rs[-1]
    breaks = r["graph_breaks"]
    again = [x["graphs"] - x["graphs_after_warmup"] for x in rs]
    return (f"{config}: {r['graphs']} graph(s) compiled, {r['graphs_after_warmup']} of them during warm-up; "
            f"compiled again after warm-up: {max(again)}; graph breaks: "
            + (", ".join(f"{n} x {reason!r}" for reason, n in breaks.items()) if breaks else "none"))


MODEL_OPTIONS = ("layers", "dim", "heads", "vocab", "block", "rows", "accumulate", "distinct", "lr", "clip")


def add_shared_options(p: argparse.ArgumentParser) -> None:
    """The model's and loop's options (:data:`MODEL_OPTIONS`), passed on to the workers, and the
    hidden ones a worker is started with."""
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--block", type=int, default=64, help="tokens per sequence")
    p.add_argument("--rows", type=int, default=4, help="sequences per micro-batch per worker (plain: x 2)")
    p.add_argument("--accumulate", type=int, default=4, help="micro-steps per step (one exchange, at the last)")
    p.add_argument("--distinct", type=int, default=8, help="distinct synthetic global batches, cycled")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_'s max norm")
    for hidden in ("--child", "--rank", "--port"):
        p.add_argument(hidden, type=int if hidden != "--child" else str, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compiled: they compile)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds, fresh processes each")
    p.add_argument("--max-rounds", type=int, default=0,
                   help="rounds in all at most, run past --rounds while ours/DDP is undecided (default: no more)")
    add_shared_options(p)
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="set aside steps during which other processes kept more cores busy")
    p.add_argument("--patience", type=float, default=4.0,
                   help="one-process configurations: seconds to go on timing to collect undisturbed steps")
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds in all to wait for a quiet machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write every raw measurement here")
    args = p.parse_args(argv)
    if min(args.steps, args.rounds, args.distinct, args.accumulate, args.rows) < 1 or args.warmup < 0:
        p.error("--steps, --rounds, --distinct, --accumulate, --rows must be >= 1; --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if h.as_child(args, child_main):
        return 0
    h.log(f"DDP vs its stratagem port: {args.configs}, {args.rounds} round(s) of {args.warmup} warm-up + "
          f"{args.steps} steps, load {h.loadavg()}")
    rounds = h.Rounds(args.configs, args.rounds, h.Quiet(args.max_wait, args.max_other_load))

    def decided() -> bool:   # ours / DDP, eager and compiled, met or missed by the middle half of the rounds
        return all(h.decision(rounds.ratio(f"ours:{mode}", f"ddp:{mode}", "median_ms", clean=True), STEP_TARGET)
                   != "undecided" for mode in ("eager", "compiled") if f"ours:{mode}" in rounds.results)
    rounds.run(lambda config, rnd: measure(args, config), max_rounds=args.max_rounds, decided=decided)
    print(f"\nGPT {args.layers} x {args.dim} ({args.heads} heads, vocab {args.vocab}, tied), {args.block} tokens x "
          f"{args.rows} rows per worker x {args.accumulate} micro-steps, AdamW, clip {args.clip}, float32; "
          f"workers: {WORLD} processes x 1 thread, gloo on loopback; {args.rounds} round(s) x {args.steps} steps "
          f"(+{args.warmup} warm-up); {h.usable_cores()} cores; commit {h.git_commit()}")
    print("\n".join(report(args, rounds)))
    status = rounds.finish()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rounds.results, "errors": rounds.errors}, f, indent=1,
                      default=str)
    return status


if __name__ == "__main__":
    sys.exit(main())
