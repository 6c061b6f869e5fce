"""The pipeline part of ``model_parallel.py``: bubble, activation memory and step time.

Model: ``layers`` x (Linear(D, D) + ReLU, the last without ReLU), MSE loss against a random
target, SGD (lr 0.01, momentum 0.9), float32, one fixed batch; D=2048, 4 layers, batch 512
by default (``--quick``: D=256, batch 64). Every rank is a process with 1 intra-op thread,
gloo over loopback, free ports; every measurement runs in fresh processes.

1. **Bubble** (one pair of processes per round runs every schedule x m): per rank, the
   fraction of each ``schedule.step`` spent outside its stages' forward / backward /
   weight-gradient calls (:class:`_pipeline_timeline.Timeline`), median over timed steps,
   against (p-1)/(m+p-1) (and (p-1)/(2m+p-1) for 2 chunks per rank).
2. **Activation memory**: peak bytes of tensors autograd saved for backward, live at once
   (``saved_tensors_hooks``; each memory range once, parameters excluded), per rank; 1F1B /
   GPipe against the share of micro-batches each rank holds in flight, min(m, p-r) / m.
3. **Step time** at ``--microbatches`` (default 4): one process (plain PyTorch on the whole
   model, p intra-op threads: the same cores), DDP on p processes (batch / p each), the raw
   ``torch.distributed.pipelining`` schedules, and stratagem's pipeline strategy on the same
   schedules (:func:`ours_pipeline`); ratios per round, medians over rounds. The bubble and
   memory tables are of the raw schedules: the strategy runs the same torch schedules (its
   stage objects are internal), so its overhead shows in the step time, ours / raw.
4. **Ours against raw in the same processes** (``ab:<schedule>``): both built side by side,
   steps alternating in ABBA order; the overhead with the machine's load shared alike.

Schedules: ``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved``
(ScheduleInterleaved1F1B, 2 chunks per rank in loop placement: rank r holds stages r and
r+p) and ``zero_bubble`` (ScheduleZBVZeroBubble, V placement: rank r holds stages r and
2p-1-r). The 2-chunk schedules need ``layers`` divisible by 2p.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402
import _pipeline_timeline as tl  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 2}
LR, MOMENTUM, GROUP_TIMEOUT_S = 0.01, 0.9, 120
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_parallel.py")


class Unavailable(Exception):
    """A configuration this checkout cannot run (reported as such, not as a failure)."""


# ================================================================ one rank

def build_model(dim: int, layers: int, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    mods: list = []
    for i in range(layers):
        mods += [torch.nn.Linear(dim, dim)] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    return torch.nn.Sequential(*mods)


def split(model: Any, num_stages: int) -> list:
    """``model``'s Linear(+ReLU) blocks in ``num_stages`` consecutive, equal parts."""
    import torch

    blocks, current = [], []
    for mod in model:
        current.append(mod)
        if not isinstance(mod, torch.nn.Linear):
            blocks.append(current)
            current = []
    blocks.append(current)
    per = len(blocks) // num_stages
    return [torch.nn.Sequential(*[m for b in blocks[i * per:(i + 1) * per] for m in b]) for i in range(num_stages)]


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    if schedule == "interleaved":
        return [rank, rank + world]
    if schedule == "zero_bubble":
        return [rank, 2 * world - 1 - rank]
    return [rank]


def check_layout(schedule: str, layers: int, world: int) -> None:
    stages = CHUNKS[schedule] * world
    if layers % stages:
        raise Unavailable(f"{schedule} needs the {layers} layers split into {stages} stages (--layers {stages})")


def raw_pipeline(schedule: str, model: Any, microbatches: int, rank: int, world: int) -> tuple[Any, list, list]:
    """``torch.distributed.pipelining`` on the default group: (schedule, stages, parameters)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp

    check_layout(schedule, len([m for m in model if isinstance(m, torch.nn.Linear)]), world)
    num_stages = CHUNKS[schedule] * world
    parts = split(model, num_stages)
    mine = stage_indices(schedule, rank, world)
    stages = [pp.PipelineStage(parts[i], i, num_stages, torch.device("cpu")) for i in mine]
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
           "zero_bubble": pp.ScheduleZBVZeroBubble}[schedule]
    sched = cls(stages[0] if CHUNKS[schedule] == 1 else stages, microbatches, loss_fn=F.mse_loss)
    return sched, stages, [p for i in mine for p in parts[i].parameters()]


def ours_pipeline(schedule: str, args: argparse.Namespace, x: Any, y: Any, losses: list) -> Callable[[], None]:
    """One training step under stratagem's ``PipelineStrategy`` (started from TF_CONFIG): the
    same model, micro-batches, loss and SGD as :func:`raw_pipeline` + :func:`pipeline_step`,
    through the public API (``strategy.run`` of a step calling ``forward_backward``)."""
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    if not hasattr(sg.experimental, "PipelineStrategy"):
        raise Unavailable("sg.experimental.PipelineStrategy is not in this checkout")
    check_layout(schedule, args.layers, args.world)
    strategy = sg.experimental.PipelineStrategy(num_microbatches=args.microbatches, schedule=schedule,
                                                loss_fn=F.mse_loss)
    with strategy.scope():
        model = build_model(args.dim, args.layers, args.seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def train_step(x: Any, y: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = strategy.forward_backward(model, x, y)
        opt.step()
        return loss

    def step() -> None:
        losses[:] = list(strategy.experimental_local_results(strategy.run(train_step, args=(x, y))))
    return step


def pipeline_step(sched: Any, stages: list, params: list, x: Any, y: Any, losses: list) -> Callable[[], None]:
    """One training step on this rank: zero grads, the schedule (inputs on the first stage's
    rank, targets on the last's), SGD."""
    import torch

    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        losses.clear()
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        opt.step()
    return step


def _data(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randn(args.batch, args.dim, generator=g), torch.randn(args.batch, args.dim, generator=g)


def _last_loss(losses: list) -> float | None:
    return sum(float(v) for v in losses) / len(losses) if losses else None


def bubble_rank(args: argparse.Namespace) -> dict:
    """Every schedule x m on this rank: idle fraction, step ms, peak saved activations, and
    the intervals of the last timed step (absolute perf_counter seconds, for the timeline)."""
    x, y = _data(args)
    rows = []
    for schedule in args.schedules:
        for m in args.microbatch_sweep:
            model = build_model(args.dim, args.layers, args.seed)
            try:
                sched, stages, params = raw_pipeline(schedule, model, m, args.rank, args.world)
            except (Unavailable, ValueError) as error:
                rows.append({"schedule": schedule, "m": m, "error": str(error).splitlines()[0]})
                continue
            timeline = tl.Timeline()
            for stage in stages:
                timeline.instrument(stage)
            losses: list = []
            step = pipeline_step(sched, stages, params, x, y, losses)
            for _ in range(args.warmup):
                step()
            idle, ms, foreign, peak = [], [], [], 0
            with tl.SavedActivations(exclude=params) as saved:
                for _ in range(args.steps):
                    timeline.clear()
                    with h.CpuWindow(siblings=True) as window:
                        t0 = time.perf_counter()
                        step()
                        t1 = time.perf_counter()
                    idle.append(1.0 - timeline.busy_s(t0, t1) / (t1 - t0))
                    ms.append(1e3 * (t1 - t0))
                    foreign.append(window.foreign_cores or 0.0)
                    peak = max(peak, saved.peak)
                    saved.reset_peak()
            rows.append({"schedule": schedule, "m": m, "idle": idle, "step_ms": ms, "foreign": foreign,
                         "saved_peak": peak, "timeline": [list(iv) for iv in timeline.intervals],
                         "loss": _last_loss(losses)})
    return {"rank": args.rank, "rows": rows}


def step_rank(args: argparse.Namespace) -> dict:
    """Step time of one configuration: single, ddp, raw:<schedule> or ours:<schedule>."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    kind, _, schedule = args.child.partition(":")
    x, y = _data(args)
    model = build_model(args.dim, args.layers, args.seed)
    losses: list = []
    if kind in ("single", "ddp"):   # the whole model on the whole batch, or DDP on this rank's rows
        if kind == "single":
            torch.set_num_threads(args.world)
            net, xr, yr = model, x, y
        else:
            net = torch.nn.parallel.DistributedDataParallel(model)
            rows = slice(args.rank * args.batch // args.world, (args.rank + 1) * args.batch // args.world)
            xr, yr = x[rows], y[rows]
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(net(xr), yr)
            loss.backward()
            opt.step()
            losses[:] = [loss.detach()]
    else:
        try:
            if kind == "raw":
                sched, stages, params = raw_pipeline(schedule, model, args.microbatches, args.rank, args.world)
                step = pipeline_step(sched, stages, params, x, y, losses)
            else:
                step = ours_pipeline(schedule, args, x, y, losses)
        except Unavailable as error:
            return {"rank": args.rank, "unavailable": str(error)}
    timing = h.timed_loop(lambda i: step(), warmup=args.warmup, steps=args.steps, max_steps=args.steps,
                          siblings=True, max_other_load=args.max_other_load)
    loss = _last_loss(losses)
    if kind == "ddp":   # the global batch's loss: the mean of the ranks' (equal) halves
        t = torch.tensor([loss])
        dist.all_reduce(t)
        loss = float(t) / args.world
    return {"rank": args.rank, "step_ms": timing["step_ms"], "contended": timing["contended"],
            "foreign": timing["foreign_cores"], "loss": loss}


def ab_rank(args: argparse.Namespace) -> dict:
    """The raw schedule and ours built side by side in the same processes, timed step by step in
    ABBA order (raw, ours, ours, raw, ...): their ratio with the machine's load shared alike."""
    schedule = args.child.partition(":")[2]
    x, y = _data(args)
    losses: dict[str, list] = {"raw": [], "ours": []}
    try:
        step = {"ours": ours_pipeline(schedule, args, x, y, losses["ours"])}
    except Unavailable as error:
        return {"rank": args.rank, "unavailable": str(error)}
    sched, stages, params = raw_pipeline(schedule, build_model(args.dim, args.layers, args.seed),
                                         args.microbatches, args.rank, args.world)
    step["raw"] = pipeline_step(sched, stages, params, x, y, losses["raw"])
    for _ in range(args.warmup):
        step["raw"]()
        step["ours"]()
    ms: dict[str, list] = {"raw": [], "ours": []}
    for k in range(args.steps):
        for name in ("raw", "ours") if k % 2 == 0 else ("ours", "raw"):
            t0 = time.perf_counter()
            step[name]()
            ms[name].append(1e3 * (time.perf_counter() - t0))
    return {"rank": args.rank, "raw_ms": ms["raw"], "ours_ms": ms["ours"],
            "raw_loss": _last_loss(losses["raw"]), "ours_loss": _last_loss(losses["ours"])}


def rank_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    if args.child != "single":
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        if not args.child.startswith("ours"):   # ours starts its own group from TF_CONFIG
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                    world_size=args.world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    result = (bubble_rank(args) if args.child == "bubble" else ab_rank(args) if args.child.startswith("ab:")
              else step_rank(args))
    if dist.is_initialized() and not args.child.startswith(("ours", "ab")):   # ours closes its group at exit
        dist.barrier()
        dist.destroy_process_group()
    return result


# ================================================================ parent

def run_ranks(args: argparse.Namespace, child: str) -> list[dict]:
    """The processes of one measurement (fresh, with a deadline); their results by rank."""
    from stratagem.testing import free_ports, local_cluster

    world = 1 if child == "single" else args.world
    cluster, port = local_cluster(world), free_ports(1)[0]
    sweep = len(args.schedules) * len(args.microbatch_sweep) if child == "bubble" else 2 if child[:3] == "ab:" else 1
    timeout = 120 + sweep * (args.warmup + args.steps) * args.step_budget_s
    argv = [sys.executable, SCRIPT, "--part", "pipeline", "--child", child, "--port", str(port),
            "--world", str(world), *args.child_argv]
    with h.Processes() as procs:
        for rank in range(world):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
            procs.start(f"rank {rank}", [*argv, "--rank", str(rank)], h.child_env(TF_CONFIG=tf_config))
        names = [f"rank {r}" for r in range(world)]
        procs.wait(names, timeout)
        return [json.loads([ln for ln in procs.output(n).splitlines() if ln.startswith("{")][-1]) for n in names]


def measure(args: argparse.Namespace, config: str) -> dict:
    ranks = run_ranks(args, config)
    if config == "bubble":
        return {"ranks": ranks}
    if "unavailable" in ranks[0]:
        return {"unavailable": ranks[0]["unavailable"]}
    if config.startswith("ab:"):
        r0 = ranks[0]
        pairs = [o / r for o, r in zip(r0["ours_ms"], r0["raw_ms"])]
        loss = {k: next((r[k] for r in ranks if r.get(k) is not None), None) for k in ("raw_loss", "ours_loss")}
        return {"raw_ms": h.median(r0["raw_ms"]), "ours_ms": h.median(r0["ours_ms"]), "ratio": h.median(pairs),
                **loss}
    loss = next((r["loss"] for r in ranks if r.get("loss") is not None), None)
    return {"median_ms": h.median(ranks[0]["step_ms"]), "contended": ranks[0]["contended"], "loss": loss}


def _table(head: list[str], rows: list[list]) -> str:
    return h.format_table(head, [row + [""] * (len(head) - len(row)) for row in rows])


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def bubble_report(args: argparse.Namespace, rounds: list[dict]) -> list[str]:
    """Tables 1 (bubble) and 2 (activation memory), and the timelines at ``--microbatches``."""
    p, lines = args.world, []
    cells: dict[tuple[str, int], dict] = {}
    for rnd in rounds:
        for rank, result in enumerate(rnd["ranks"]):
            for row in result["rows"]:
                cell = cells.setdefault((row["schedule"], row["m"]), {"error": row.get("error"), "ranks": {}})
                if "error" in row:
                    continue
                quiet = [i for i, f in enumerate(row["foreign"]) if f <= args.max_other_load] or range(len(row["idle"]))
                got = cell["ranks"].setdefault(rank, {"idle": [], "ms": [], "peak": [], "timeline": None})
                got["idle"].append(h.median([row["idle"][i] for i in quiet]))
                got["ms"].append(h.median([row["step_ms"][i] for i in quiet]))
                got["peak"].append(row["saved_peak"])
                got["timeline"] = row["timeline"]
                if row["loss"] is not None:
                    cell["loss"] = row["loss"]
    head = ["schedule", "m", "theory"] + [f"idle r{r}" for r in range(p)] + ["step ms", "loss"]
    table = []
    for (schedule, m), cell in cells.items():
        if not cell["ranks"]:
            table.append([schedule, m, "", f"n/a: {cell['error']}"])
            continue
        theory = tl.theory_bubble(p, m, CHUNKS[schedule])
        table.append([schedule, m, f"{theory:.3f}"] + [_fmt(h.median(cell["ranks"][r]["idle"])) for r in range(p)]
                     + [_fmt(h.median(cell["ranks"][0]["ms"]), ".1f"), _fmt(cell.get("loss"), ".6g")])
    lines += [f"1. Pipeline bubble, p={p}: idle fraction of each rank's schedule.step (time outside its stages' "
              "forward/backward/weight-gradient calls), median over steps and rounds", _table(head, table),
              "theory: (p-1)/(m+p-1); for interleaved and zero_bubble (2 chunks per rank) (p-1)/(2m+p-1); "
              "zero_bubble fills part of that with weight-gradient work (W); loss: the last step's (the "
              "step-time runs train as many steps: same training => same loss to ~1e-5)", ""]
    mib = 1 << 20
    head = ["schedule", "m"] + [f"MiB r{r}" for r in range(p)] + [f"/gpipe r{r}" for r in range(p)] + \
           [f"1f1b expected r{r}" for r in range(p)]
    table = []
    for (schedule, m), cell in cells.items():
        base = cells.get(("gpipe", m), {}).get("ranks", {})
        if not cell["ranks"]:
            continue
        peaks = [h.median(cell["ranks"][r]["peak"]) for r in range(p)]
        ratios = [_fmt(peaks[r] / h.median(base[r]["peak"])) if r in base and h.median(base[r]["peak"]) else ""
                  for r in range(p)]
        expected = [f"{tl.in_flight_1f1b(p, m, r) / m:.3f}" if schedule == "1f1b" else "" for r in range(p)]
        table.append([schedule, m] + [f"{v / mib:.2f}" for v in peaks] + ratios + expected)
    lines += ["2. Peak activation memory per rank: bytes of tensors autograd saved for backward, live at once "
              "(saved_tensors_hooks; each memory range once, parameters excluded)", _table(head, table),
              "expected 1F1B / GPipe: min(m, p-r) / m (micro-batches in flight on rank r)", ""]
    for (schedule, m), cell in cells.items():
        if m == args.microbatches and cell["ranks"]:
            per_rank = [cell["ranks"][r]["timeline"] for r in range(p)]
            start = min(iv[3] for r in per_rank for iv in r)
            rel = [[[k, s, c, 1e3 * (t0 - start), 1e3 * (t1 - start)] for k, s, c, t0, t1 in r] for r in per_rank]
            lines += [f"timeline, {schedule}, m={m} (one step; F forward, B backward, W weight gradients; "
                      "lower case: the rank's second chunk; . idle)"] + tl.ascii_timeline(rel) + [""]
    return lines


def step_report(args: argparse.Namespace, rounds: h.Rounds, configs: list[str]) -> list[str]:
    head = ["config", "median ms", "x single", "range", "x DDP", "range", "ours/raw", "range", "loss"]
    table = []
    for config in configs:
        rs = rounds.results[config]
        if any("unavailable" in r for r in rs):
            table.append([config, "n/a: " + next(r["unavailable"] for r in rs if "unavailable" in r)])
            continue
        if not rs:
            table.append([config, "FAILED"])
            continue
        mark = "!" if any(r["contended"] for r in rs) else ""
        vs = {b: rounds.ratio(config, b, "median_ms") for b in ("single", "ddp")}
        raw = rounds.ratio(config, "raw:" + config.partition(":")[2], "median_ms") if config.startswith("ours") else []
        table.append([config + mark, f"{h.median([r['median_ms'] for r in rs]):.1f}"]
                     + [v for b in ("single", "ddp") for v in (_fmt(h.median(vs[b]) if vs[b] else None),
                                                               h.spread(vs[b], 3))]
                     + [_fmt(h.median(raw) if raw else None), h.spread(raw, 3), _fmt(rs[-1]["loss"], ".6g")])
    return [f"3. Step time, m={args.microbatches} micro-batches (one training step: schedule + SGD); ratios are per "
            "round (paired), median over rounds, range min-max; '!' = no undisturbed step in some round",
            _table(head, table),
            f"single: one process, {args.world} intra-op threads; ddp: DistributedDataParallel on {args.world} "
            f"processes (batch / {args.world} each); raw: torch.distributed.pipelining; ours: stratagem's strategy; "
            f"loss: the last step's (same training => same to ~1e-5)"]


def ab_report(args: argparse.Namespace, rounds: h.Rounds, configs: list[str]) -> list[str]:
    table = []
    for config in configs:
        rs = rounds.results[config]
        if any("unavailable" in r for r in rs) or not rs:
            table.append([config[3:], "n/a: " + next((r["unavailable"] for r in rs if "unavailable" in r), "FAILED")])
            continue
        ratios = [r["ratio"] for r in rs]
        table.append([config[3:], f"{h.median([r['raw_ms'] for r in rs]):.1f}",
                      f"{h.median([r['ours_ms'] for r in rs]):.1f}", f"{h.median(ratios):.3f}", h.spread(ratios, 3),
                      _fmt(rs[-1]["raw_loss"], ".6g"), _fmt(rs[-1]["ours_loss"], ".6g")])
    return [f"4. Ours against the raw schedule in the same processes (m={args.microbatches}; steps alternate raw, "
            "ours, ours, raw, ...; ours/raw = median of the step pairs' ratios, median over rounds)",
            _table(["schedule", "raw ms", "ours ms", "ours/raw", "range", "raw loss", "ours loss"], table), ""]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="model_parallel.py --part pipeline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="pipeline stages = processes (default 2)")
    p.add_argument("--dim", type=int, help="layer width D (default 2048; --quick 256)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--batch", type=int, help="batch size (default 512; --quick 64)")
    p.add_argument("--microbatches", type=int, default=4, help="m for the step-time table (default 4)")
    p.add_argument("--microbatch-sweep", type=int, nargs="+", default=[1, 2, 4, 8], help="m for the bubble table")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--configs", nargs="+", help="configurations (default: bubble single ddp raw:S ours:S ab:S for "
                                                "every schedule S; 'bubble' is the bubble/memory sweep, 'ab:S' raw "
                                                "and ours in the same processes)")
    p.add_argument("--steps", type=int, help="timed steps (default 8; --quick 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2; --quick 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds, fresh processes each (default 3; --quick 1)")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="set aside steps during which other processes kept more cores busy")
    p.add_argument("--max-wait", type=float, help="seconds in all to wait for a quiet machine (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: small model, 1 round, 2 steps")
    p.add_argument("--json", metavar="PATH", help="also write every raw measurement here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = (dict(dim=256, batch=64, steps=2, warmup=1, rounds=1, max_wait=0.0) if args.quick else
                dict(dim=2048, batch=512, steps=8, warmup=2, rounds=3, max_wait=60.0))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds, args.world, args.layers) < 1 or args.warmup < 0:
        p.error("--steps, --rounds, --world, --layers must be >= 1, --warmup >= 0")
    bad = [m for m in [*args.microbatch_sweep, args.microbatches] if m < 1 or args.batch % m]
    if bad:
        p.error(f"--batch {args.batch} must divide by every micro-batch count; {bad} do not")
    args.configs = args.configs or (["bubble", "single", "ddp"] + [f"{k}:{s}" for k in ("raw", "ours", "ab")
                                                                   for s in args.schedules])
    # what every child needs to know (the parent's own options)
    args.child_argv = ["--dim", str(args.dim), "--layers", str(args.layers), "--batch", str(args.batch),
                       "--microbatches", str(args.microbatches), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--seed", str(args.seed),
                       "--max-other-load", str(args.max_other_load), "--schedules", *args.schedules,
                       "--microbatch-sweep", *map(str, args.microbatch_sweep)]
    args.step_budget_s = 30.0 * (args.dim / 2048) ** 2 * args.batch / 512 + 2.0   # generous, per step
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        h.emit(rank_main(args))
        return 0
    h.exit_cleanly_on_sigterm()
    load = h.loadavg()
    h.log(f"pipeline: p={args.world}, MLP {args.layers} x {args.dim}, batch {args.batch}, {args.rounds} round(s) of "
          f"{args.warmup} warm-up + {args.steps} steps, configs {' '.join(args.configs)}; load {load}")
    if args.world > h.usable_cores():
        h.log(f"note: {args.world} processes on {h.usable_cores()} cores: ranks share cores, so the bubble "
              "measured is not the schedule's alone")
    rounds = h.Rounds(args.configs, args.rounds, h.Quiet(args.max_wait, args.max_other_load))
    rounds.run(lambda config, rnd: measure(args, config))
    print(f"\nPipeline: p={args.world} processes x 1 intra-op thread, gloo over loopback, MLP {args.layers} x "
          f"Linear({args.dim}, {args.dim}), batch {args.batch}, float32, SGD; {args.rounds} round(s) x {args.steps} "
          f"steps (+{args.warmup} warm-up); {h.usable_cores()} cores, load average at start {load}; "
          f"commit {h.git_commit()}\n")
    if rounds.results.get("bubble"):
        print("\n".join(bubble_report(args, rounds.results["bubble"])))
    step_configs = [c for c in args.configs if c != "bubble" and not c.startswith("ab:")]
    if step_configs:
        print("\n".join(step_report(args, rounds, step_configs)) + "\n")
    ab_configs = [c for c in args.configs if c.startswith("ab:")]
    if ab_configs:
        print("\n".join(ab_report(args, rounds, ab_configs)))
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": rounds.results,
                       "errors": rounds.errors}, f, indent=1, default=str)
    return 1 if rounds.errors else 0
