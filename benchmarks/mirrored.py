#!/usr/bin/env python
"""MirroredStrategy on logical CPU devices against plain PyTorch, side by side.

Trains the MLP 784-1024-1024-10 (SGD, lr 0.01, momentum 0.9, cross-entropy) on ``--distinct``
synthetic global batches, cycled, with: plain PyTorch (``plain``, torch's default threads);
``sg.OneDeviceStrategy("cpu")`` (``one_device``); ``sg.MirroredStrategy(["cpu:0", "cpu:1"])``
with its default ``HierarchicalCopyAllReduce`` (``mirrored_hier``) and with
``ReductionToOneDevice`` (``mirrored_r1d``); and TensorFlow's own single-device loop and
MirroredStrategy(2) (``tf_single``, ``tf_mirrored``) when ``import tensorflow`` works.

Every measurement runs in a fresh interpreter (thread settings and allocator caches never leak
between configurations), in interleaved rounds; ``x plain`` is the median over rounds of the
ratio to plain PyTorch measured in the same round. See benchmarks/README.md.

``--paired`` measures the same steps in one process per batch size instead, as
``mirrored_paired.py`` does for a GPT: plain PyTorch and each strategy's model (built from the same
initial weights, trained on the same batches) take turns in chunks of ``--chunk`` steps, the order
rotated every pair. torch's intra-op thread count is set back to its default before each chunk
(untimed): plain PyTorch computes with torch's default threads, and ``strategy.run`` lowers the count
to one per replica thread while it runs, as it does in a process of its own. A pair's ratio
compares chunks a fraction of a second apart, so what the host does over minutes cancels, and the
pairs go on (up to ``--max-pairs``) until every target is decided: one run decides.

    python benchmarks/mirrored.py                      # 5 rounds, batch 128 and 512
    python benchmarks/mirrored.py --rounds 3 --configs plain one_device mirrored_hier mirrored_r1d
    python benchmarks/mirrored.py --quick              # smoke test: batch 128, 1 round, 4 steps
    python benchmarks/mirrored.py --profile            # torch.profiler tables, first batch size
    python benchmarks/mirrored.py --paired --configs plain mirrored_hier   # one process per batch size
    python benchmarks/mirrored.py --paired --configs plain mirrored_hier thread_floor sum_floor   # and the floors

``thread_floor`` (``--paired`` only) is what running the replicas as threads costs by itself: the
batch's halves forward and backward on two threads at once, one meeting, each thread's share of the
update; no gradient sum. ``sum_floor`` (``--paired`` only) adds the gradient sum and a second meeting:
the least that trains as plain PyTorch does (the check includes it), without the strategy.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import resource
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

CONFIGS = {"plain": "PyTorch plain", "one_device": "OneDeviceStrategy(cpu)",
           "mirrored_hier": "Mirrored(2) HierarchicalCopy*", "mirrored_r1d": "Mirrored(2) ReductionToOneDevice",
           "tf_single": "TF single device", "tf_mirrored": "TF Mirrored(2)",
           "thread_floor": "two threads, no strategy (floor)",
           "sum_floor": "two threads and the sum, no strategy"}
PAIRED_ONLY = ("thread_floor", "sum_floor")   # timing floors, written for the paired process
UNTRAINED = ("thread_floor",)   # it does not train as plain PyTorch: the check leaves it out
PROFILE_CONFIGS = ("plain", "plain_1thread", "mirrored_hier", "mirrored_r1d")
TARGETS = {("one_device", 128): 1.03, ("one_device", 512): 1.03, ("mirrored_hier", 128): 1.15,
           ("mirrored_hier", 512): 1.05, ("mirrored_r1d", 128): 1.15, ("mirrored_r1d", 512): 1.05}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ================================================================ child side

def replica_step(model: Any, optimizer: Any, batch: Any) -> Any:
    """One replica's step in ``strategy.run``: the loss as its share of the global batch's mean,
    backward (the gradients summed over the replicas when it ends), the update."""
    import torch.nn.functional as F

    import stratagem as sg

    x, y = batch
    loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def torch_child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import stratagem as sg   # every child, the memory baseline included, loads the same modules

    x_np, y_np = h.synthetic_batches(args.batch, args.distinct, seed=args.seed)
    xs = [torch.from_numpy(x) for x in x_np]
    ys = [torch.from_numpy(y) for y in y_np]
    config = args.child
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if config == "baseline":   # BLAS and the OpenMP pool loaded, no model: what others are measured against
        torch.nn.Linear(8, 8)(torch.randn(4, 8)).sum().backward()
        return {**result, "peak_rss_mib": peak_rss_mib()}
    if config == "plain_1thread":
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if config.startswith("plain"):
        model = h.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=h.LR, momentum=h.MOMENTUM)

        def one_step(i: int) -> None:
            loss = F.cross_entropy(model(xs[i % args.distinct]), ys[i % args.distinct])
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        strategy = {"one_device": lambda: sg.OneDeviceStrategy("cpu"),
                    "mirrored_hier": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
                    "mirrored_r1d": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"],
                                                                cross_device_ops=sg.ReductionToOneDevice()),
                    }[config]()
        with strategy.scope():
            model = h.mlp()
            opt = torch.optim.SGD(model.parameters(), lr=h.LR, momentum=h.MOMENTUM)

        step = functools.partial(replica_step, model, opt)

        # an endless cycle over references to the batches; next() splits one for the replicas
        iterator = iter(strategy.experimental_distribute_dataset(itertools.cycle(list(zip(xs, ys)))))

        def one_step(i: int) -> None:
            strategy.run(step, args=(next(iterator),))

    def probe() -> float:
        with torch.no_grad():   # outside run a mirrored module reads its primary copy
            return float(F.cross_entropy(model(xs[0]), ys[0]))

    if args.profile:
        for i in range(args.warmup):
            one_step(i)
        with h.Profile() as prof:
            for i in range(args.steps):
                one_step(args.warmup + i)
        return {**result, "events": prof.events, "steps": args.steps}
    result.update(h.timed_loop(one_step, warmup=args.warmup, steps=args.steps, patience_s=args.patience,
                               max_other_load=args.max_other_load, probe=probe))
    return {**result, "peak_rss_mib": peak_rss_mib()}


STRATEGIES = {"one_device": lambda sg: sg.OneDeviceStrategy("cpu"),
              "mirrored_hier": lambda sg: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
              "mirrored_r1d": lambda sg: sg.MirroredStrategy(["cpu:0", "cpu:1"],
                                                             cross_device_ops=sg.ReductionToOneDevice())}


def paired_child(args: argparse.Namespace) -> dict:
    """``--paired``: plain PyTorch and every configuration of ``args.configs`` in this process, built
    from the same initial weights, timed in chunks that take turns; pairs go on while a target is
    undecided (up to ``--max-pairs``)."""
    import time

    import torch
    import torch.nn.functional as F

    import stratagem as sg

    default_threads = torch.get_num_threads()
    x_np, y_np = h.synthetic_batches(args.batch, args.distinct, seed=args.seed)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in zip(x_np, y_np)]
    torch.manual_seed(args.seed)
    models = {"plain": h.mlp()}
    initial = {k: v.clone() for k, v in models["plain"].state_dict().items()}
    optimizers = {"plain": torch.optim.SGD(models["plain"].parameters(), lr=h.LR, momentum=h.MOMENTUM)}
    steps: dict[str, Any] = {}
    done = dict.fromkeys(args.configs, 0)

    def plain_step() -> None:
        x, y = batches[done["plain"] % args.distinct]
        loss = F.cross_entropy(models["plain"](x), y)
        optimizers["plain"].zero_grad()
        loss.backward()
        optimizers["plain"].step()
    steps["plain"] = plain_step

    for config in [c for c in args.configs[1:] if c in STRATEGIES]:
        strategy = STRATEGIES[config](sg)
        with strategy.scope():
            model = h.mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=h.LR, momentum=h.MOMENTUM)
        model.load_state_dict(initial)
        models[config], optimizers[config] = model, optimizer

        # an endless cycle over the batches; next() splits one for the replicas
        iterator = iter(strategy.experimental_distribute_dataset(itertools.cycle(batches)))
        steps[config] = lambda strategy=strategy, iterator=iterator, fn=functools.partial(
            replica_step, model, optimizer): strategy.run(fn, args=(next(iterator),))

    def chunk(config: str, count: int) -> dict:
        torch.set_num_threads(default_threads)   # (untimed: run lowers it for its replicas, then restores)
        times = []
        with h.CpuWindow() as window:
            for _ in range(count):
                t0 = time.perf_counter()
                steps[config]()
                times.append(1e3 * (time.perf_counter() - t0))
                done[config] += 1
        return {"median_ms": h.median(times), "cpu_ms": 1e3 * window.own_cores * window.seconds / count,
                "foreign": window.foreign_cores}

    for floor in [c for c in args.configs if c in PAIRED_ONLY]:
        models[floor], steps[floor] = thread_floor(initial, batches, done, summed=floor == "sum_floor")

    for config in reversed(args.configs):   # warm-up; the strategies first (their forward pre-hook in place)
        chunk(config, args.warmup)
    pairs: list[dict] = []

    def decided() -> bool:
        ratios = paired_ratios(pairs, args.max_other_load)
        return all(h.decision(ratios[c], TARGETS[(c, args.batch)]) != "undecided"
                   for c in args.configs[1:] if (c, args.batch) in TARGETS)
    while len(pairs) < args.pairs or (len(pairs) < args.max_pairs and not decided()):
        k = len(pairs) % len(args.configs)
        pairs.append({config: chunk(config, args.chunk) for config in args.configs[k:] + args.configs[:k]})

    def probe(model: Any) -> float:   # outside run a mirrored module reads its primary copy
        with torch.no_grad():
            return float(F.cross_entropy(model(batches[0][0]), batches[0][1]))

    return {"pairs": pairs, "threads": default_threads, "steps": done,
            "loss": {config: probe(model) for config, model in models.items()}}


def thread_floor(initial: dict, batches: list, done: dict, *, summed: bool = False) -> tuple[Any, Any]:
    """``thread_floor``: what any design that runs a process's replicas as threads pays before it sums
    anything. The batch's two halves go forward and backward at once on two threads (the caller's and a
    helper's, one intra-op thread each, the weights in one memory under two ``Parameter`` objects, as
    ``MirroredStrategy`` shares them on CPU); the threads meet once; then each updates its share of the
    weights (by elements) from its own half's gradient, as the strategy splits its update. No gradient
    sum and one meeting: it does not train as plain PyTorch does (the check leaves it out); it is the
    time to compare with. (An update on two intra-op threads between the halves would leave an OpenMP
    worker spinning while they run: it doubled this step's time.)

    ``summed`` (``sum_floor``): the least that trains exactly as plain PyTorch does. Each half's loss
    counts half (their gradients add up to the whole batch's mean); after the first meeting each
    thread sums its half of every gradient into both replicas' gradients, in replica order, as the
    strategy's ``HierarchicalCopyAllReduce`` does, and the threads meet again before the update. What
    ``Mirrored(2)`` costs beyond this is the strategy's own: its meetings, hooks and Python."""
    import copy
    import queue
    import threading

    import torch
    import torch.nn.functional as F

    from stratagem.comm.collective import deal_pieces

    first = h.mlp()
    first.load_state_dict(initial)
    second = copy.deepcopy(first)
    for mine, theirs in zip(first.parameters(), second.parameters()):
        theirs.data = mine.data   # one memory, two Parameters: each its own .grad
    owners = deal_pieces([p.numel() for p in first.parameters()], 2)   # as the strategy deals its update
    optimizers = [torch.optim.SGD([p for p, owner in zip(model.parameters(), owners) if owner == r],
                                  lr=h.LR, momentum=h.MOMENTUM) for r, model in enumerate((first, second))]
    meeting = threading.Barrier(2)
    # thread r sums half r of every gradient (elements lo..hi of each)
    halves = [[(0, p.numel() // 2) if r == 0 else (p.numel() // 2, p.numel()) for p in first.parameters()]
              for r in range(2)]
    name = "sum_floor" if summed else "thread_floor"
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def half(r: int, x: Any, y: Any) -> None:
        model = (first, second)[r]
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        (loss * 0.5 if summed else loss).backward()
        meeting.wait(timeout=60)
        if summed:
            with torch.no_grad():
                for (lo, hi), a, b in zip(halves[r], first.parameters(), second.parameters()):
                    primary, other = a.grad.view(-1)[lo:hi], b.grad.view(-1)[lo:hi]
                    primary.add_(other)
                    other.copy_(primary)
            meeting.wait(timeout=60)
        optimizers[r].step()

    def serve() -> None:
        torch.set_num_threads(1)
        while True:
            x, y = inbox.get()
            try:
                half(1, x, y)
                outbox.put(None)
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
                meeting.abort()
                outbox.put(error)

    threading.Thread(target=serve, daemon=True, name="thread-floor").start()

    def step() -> None:
        x, y = batches[done[name] % len(batches)]
        cut = len(x) // 2
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        inbox.put((x[cut:], y[cut:]))
        try:
            half(0, x[:cut], y[:cut])
        except BaseException:
            meeting.abort()
            raise
        finally:
            error = outbox.get()
            torch.set_num_threads(threads)
        if error is not None:
            raise error
    return first, step


def paired_ratios(pairs: list[dict], max_other_load: float) -> dict[str, list[float]]:
    """Per configuration, its chunk median over plain's in each pair that no other process
    disturbed (every pair when none was undisturbed)."""
    quiet = [p for p in pairs if all(s["foreign"] is None or s["foreign"] <= max_other_load for s in p.values())]
    return {config: [p[config]["median_ms"] / p["plain"]["median_ms"] for p in quiet or pairs]
            for config in (pairs[0] if pairs else {}) if config != "plain"}


# ================================================================ parent side

def measure(args: argparse.Namespace, config: str, batch: int, profile: bool = False) -> dict:
    argv = ["--child", config, "--batch", str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--distinct", str(args.distinct), "--seed", str(args.seed), "--patience", str(args.patience),
            "--max-other-load", str(args.max_other_load)] + (["--profile"] if profile else [])
    timeout = 120 + args.patience + (args.steps + args.warmup) * 0.5 * max(1.0, batch / 512)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tf.py") if config.startswith("tf_") \
        else os.path.abspath(__file__)
    result = h.run_json([sys.executable, script, "mirrored", *argv] if config.startswith("tf_")
                        else [sys.executable, script, *argv], timeout)
    if "skipped" in result:
        raise RuntimeError(result["skipped"])
    if "step_ms" in result:
        result["median_ms"] = h.median(result["step_ms"])
    return result


def run_tables(args: argparse.Namespace) -> tuple[list[str], list[dict], dict]:
    lines, rows, raw = [], [], {}
    headers = ["config", "batch", "median ms", "p90 ms", "samples/s", "x plain", "x plain IQR", "x plain range",
               "target", "CPU ms", "peak RSS +MiB", "steps kept"]
    table = []
    tf_missing = importlib.util.find_spec("tensorflow") is None
    for batch in args.batch_sizes:
        baseline = [measure(args, "baseline", batch)["peak_rss_mib"]]
        configs = [c for c in args.configs if not (c.startswith("tf_") and tf_missing)]
        rounds = h.Rounds(configs, args.rounds, h.Quiet(args.max_wait, args.max_other_load))

        def paired(config: str) -> list[float]:   # rounds in which neither side kept disturbed steps alone
            return rounds.ratio(config, "plain", "median_ms", clean=True) or rounds.ratio(config, "plain", "median_ms")

        def decided() -> bool:   # every target met or missed by the middle half of the rounds
            return all(h.decision(rounds.ratio(c, "plain", "median_ms", clean=True), TARGETS[(c, batch)])
                       != "undecided" for c in configs if (c, batch) in TARGETS)
        rounds.run(lambda config, rnd: measure(args, config, batch), max_rounds=args.max_rounds, decided=decided)
        raw[batch] = {"rounds": rounds.results, "errors": rounds.errors, "baseline_rss_mib": baseline}
        mem: dict[str, float] = {}
        for config in args.configs:
            if config not in configs:
                lines.append(f"batch {batch}: {CONFIGS[config]} skipped: tensorflow is not installed")
                continue
            results = [r for r in rounds.results[config] if not r["contended"]] or rounds.results[config]
            if not results:
                why = next((e.split(": ", 1)[-1] for e in rounds.errors if e.startswith(config)), "failed")
                lines.append(f"batch {batch}: {CONFIGS[config]} FAILED: {why.splitlines()[0]}")
                continue
            steps = [t for r in results for t in r["step_ms"]]
            ratios = paired(config)
            ratio = h.median(ratios) if ratios else None
            target = TARGETS.get((config, batch))
            mem[config] = h.median([r["peak_rss_mib"] for r in results]) - h.median(baseline)
            contended = all(r["contended"] for r in results)
            unpaired = not rounds.ratio(config, "plain", "median_ms", clean=True)   # no round undisturbed on both
            verdict = "" if target is None or ratio is None else \
                f"<={target:.2f} n/a (!)" if contended or unpaired else h.verdict(ratios, target)
            row = {"config": config, "batch": batch, "median_ms": h.median(steps), "ratio": ratio,
                   "ratios": ratios, "mem_mib": mem[config], "loss": h.median([r["final_loss"] for r in results])}
            rows.append(row)
            table.append([CONFIGS[config] + ("!" if contended else ""), batch, f"{row['median_ms']:.2f}",
                          f"{h.percentile(steps, 90):.2f}", f"{batch / row['median_ms'] * 1e3:,.0f}",
                          "" if ratio is None else f"{ratio:.3f}", h.quartiles(ratios), h.spread(ratios, 3), verdict,
                          f"{h.median([c for r in results for c in r['cpu_ms']]):.1f}",
                          f"{mem[config]:.1f}" if not config.startswith("tf_") else "",
                          f"{sum(r['clean_steps'] for r in results)}/"
                          f"{sum(r['clean_steps'] + r['disturbed_steps'] for r in results)}"])
        budget = 3 * h.param_count() * 4 / 2**20
        for config in ("mirrored_hier", "mirrored_r1d"):
            if config in mem and "one_device" in mem:
                extra = mem[config] - mem["one_device"]
                lines.append(f"batch {batch}: {CONFIGS[config]} uses {extra:+.1f} MiB over OneDevice for its extra "
                             f"replica (budget one model + grads + momentum = {budget:.1f} MiB)")
    out = [h.format_table(headers, table, align="lrrrrrrrlrrr"), ""] + lines
    ref = {r["batch"]: r["loss"] for r in rows if r["config"] == "plain"}
    diffs = [abs(r["loss"] - ref[r["batch"]]) / abs(ref[r["batch"]]) for r in rows
             if r["batch"] in ref and not r["config"].startswith("tf_") and r["loss"] is not None]
    if diffs:
        out.append(f"Check: loss on batch 0 after warmup+steps vs plain, max relative difference {max(diffs):.1e}: "
                   + ("same training" if max(diffs) < 1e-3 else "DIFFERENT TRAINING: numbers are not comparable"))
    out.append("* = the default cross-device op on CPU. 'x plain' = median over rounds of the ratio to plain in "
               "the same round (rounds in which neither kept only disturbed steps, when there are any); 'x plain "
               "IQR' = its interquartile range, 'x plain range' its min-max. A target is 'ok' or 'MISSED' only "
               "when the median's 95 % interval (order statistics) lies on one side of it ('undecided' otherwise: more rounds, or a quieter machine); "
               "rounds go on past --rounds, up to --max-rounds, until every target is decided. '!' = no "
               "undisturbed steps at all.")
    return out, rows, raw


def run_paired(args: argparse.Namespace) -> list[str]:
    """``--paired``: one process per batch size; the lines to print."""
    lines = []
    configs = [c for c in args.configs if c in ("plain", *STRATEGIES, *PAIRED_ONLY)]
    skipped = [c for c in args.configs if c not in configs]
    if skipped:
        lines.append(f"--paired leaves out {', '.join(skipped)} (TensorFlow runs in processes of its own)")
    for batch in args.batch_sizes:
        argv = ["--child", "paired", "--batch", str(batch), "--pairs", str(args.pairs), "--max-pairs",
                str(args.max_pairs), "--chunk", str(args.chunk), "--warmup", str(args.warmup), "--distinct",
                str(args.distinct), "--seed", str(args.seed), "--max-other-load", str(args.max_other_load),
                "--configs", *configs]
        timeout = 120 + (args.max_pairs * args.chunk + args.warmup) * len(configs) * 0.2 * max(1.0, batch / 128)
        r = h.run_json([sys.executable, os.path.abspath(__file__), *argv], timeout)
        pairs, ratios = r["pairs"], paired_ratios(r["pairs"], args.max_other_load)
        quiet = sum(all(s["foreign"] is None or s["foreign"] <= args.max_other_load for s in p.values())
                    for p in pairs)
        ms = {c: h.median([p[c]["median_ms"] for p in pairs]) for c in configs}
        cpu = {c: h.median([p[c]["cpu_ms"] for p in pairs]) for c in configs}
        lines.append(f"batch {batch}: {len(pairs)} pairs of {args.chunk}-step chunks ({quiet} undisturbed), "
                     f"{r['threads']} intra-op threads by default; " + ", ".join(
                         f"{CONFIGS[c]} {ms[c]:.2f} ms ({cpu[c]:.1f} CPU ms)" for c in configs) + " a step")
        for config in configs[1:]:
            target = TARGETS.get((config, batch))
            verdict = "n/a (no pair undisturbed)" if not quiet else h.verdict(ratios[config], target) \
                if target is not None else f"interval {h.interval_text(ratios[config])}"
            cpu_ratio = h.median([p[config]["cpu_ms"] / p["plain"]["cpu_ms"] for p in pairs])
            lines.append(f"  {CONFIGS[config]} / plain at batch {batch}: {h.median(ratios[config]):.3f}  IQR "
                         f"{h.quartiles(ratios[config]) or '-'}  range {h.spread(ratios[config], 3) or '-'}  "
                         f"target {verdict}; CPU time ratio {cpu_ratio:.3f}")
        losses = {c: loss for c, loss in r["loss"].items() if c not in UNTRAINED}
        diff = max(abs(v - losses["plain"]) / abs(losses["plain"]) for v in losses.values())
        lines.append(f"  Check: after {r['steps']['plain']} steps each, loss on batch 0 vs plain, max relative "
                     f"difference {diff:.1e}: " + ("same training" if diff < 1e-3 else
                                                   "DIFFERENT TRAINING: numbers are not comparable"))
        h.log(f"batch {batch} done")
    lines.append("A pair: one chunk of each configuration, back to back, in the same process; a ratio: the "
                 "configuration's chunk median over plain's; pairs with other processes keeping more than "
                 f"{args.max_other_load} cores busy set aside; a target is decided when the median's 95 % "
                 "interval lies on one side of it.")
    return lines


def run_profile(args: argparse.Namespace) -> dict:
    batch, raw = args.batch_sizes[0], {}
    for config in PROFILE_CONFIGS:
        result = measure(args, config, batch, profile=True)
        raw[config] = result
        print(f"\n{config} at batch {batch}: {args.steps} profiled steps after {args.warmup} warm-up "
              f"(all threads of the process)")
        print(h.profile_table(result["events"], result["steps"]))
    return raw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_timing_options(p)
    p.add_argument("--max-rounds", type=int,
                   help="rounds in all at most, run past --rounds while a target is undecided (default 12; "
                        "--quick: no more)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                   default=[c for c in CONFIGS if c not in PAIRED_ONLY],
                   help="configurations (plain is always run: it is the reference; thread_floor and sum_floor "
                        "only with --paired)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler tables instead of the timing table (default --steps 20)")
    p.add_argument("--paired", action="store_true",
                   help="plain and each strategy in one process per batch size, in alternating chunks")
    p.add_argument("--pairs", type=int, default=30, help="--paired: pairs of chunks at least (default 30)")
    p.add_argument("--max-pairs", type=int, default=120,
                   help="--paired: pairs in all at most, run past --pairs while a target is undecided")
    p.add_argument("--chunk", type=int, default=10, help="--paired: steps per chunk (default 10)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile and args.steps is None and not args.quick:
        args.steps = 20
    h.apply_timing_defaults(args, p)
    if args.max_rounds is None:
        args.max_rounds = 0 if args.quick or args.profile else 12
    args.configs = ["plain"] + [c for c in args.configs if c != "plain"]
    if not args.paired and args.child != "paired" and any(c in PAIRED_ONLY for c in args.configs):
        p.error(f"{', '.join(c for c in args.configs if c in PAIRED_ONLY)} runs only with --paired "
                "(it shares the process with plain PyTorch)")
    if args.quick:
        args.pairs, args.max_pairs, args.chunk = 2, 2, 2
    args.max_pairs = max(args.max_pairs, args.pairs)
    if min(args.pairs, args.chunk) < 1:
        p.error("--pairs and --chunk must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if h.as_child(args, lambda a: paired_child(a) if a.child == "paired" else torch_child(a)):
        return 0
    if args.paired:
        h.log(f"MirroredStrategy benchmark, paired in one process: batch sizes {args.batch_sizes}, at least "
              f"{args.pairs} pairs of {args.chunk}-step chunks, load {h.loadavg()}")
        lines = run_paired(args)
        print(f"\nMLP {'-'.join(map(str, h.MLP_LAYERS))} ({h.param_count() / 1e6:.2f} M params), SGD lr {h.LR} "
              f"momentum {h.MOMENTUM}; {h.usable_cores()} cores; commit {h.git_commit()}")
        print("\n".join(lines))
        warning = h.load_warning()
        if warning:
            print(warning)
        return 1 if any("DIFFERENT TRAINING" in line for line in lines) else 0
    if args.profile:
        raw = run_profile(args)
        errors = []
    else:
        h.log(f"MirroredStrategy benchmark: batch sizes {args.batch_sizes}, {args.rounds} round(s) "
              f"of {args.warmup} warm-up + {args.steps} timed steps, load {h.loadavg()}")
        lines, rows, raw = run_tables(args)
        print(f"\nMLP {'-'.join(map(str, h.MLP_LAYERS))} ({h.param_count() / 1e6:.2f} M params), SGD lr {h.LR} "
              f"momentum {h.MOMENTUM}; {args.rounds} round(s) x {args.steps} steps (+{args.warmup} warm-up); "
              f"{h.usable_cores()} cores; commit {h.git_commit()}")
        print("\n".join(lines))
        errors = [e for b in raw.values() for e in b["errors"]]
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": raw}, f, indent=1, default=str)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
