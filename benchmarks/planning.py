"""``sg.experimental.plan``, swept exhaustively: is the measured winner among the cheapest predicted layouts
within 10% of the best of all layouts, and is the predicted memory within 5% of the measured peak?

A round is one plan that measures **every** layout the processes allow (``num_measured=None``): the
same processes train each layout for ``--steps`` steps after a warm-up (its time: the slowest
process's fastest step), one layout after the other. ``--rounds`` rounds (default 7) interleave the
layouts in time, so a busy minute of the machine touches one measurement of each, not all of one;
every verdict reads the per-layout medians over the rounds:

- *the exhaustive best*: the layout of the smallest median;
- *the plan's pick*, per round: the fastest measured in that round of the probes (each mesh's
  plainest layout, which calibrate the predictions) and of the ``--measured`` (default 3) others
  predicted cheapest after calibration -- what ``sg.experimental.plan`` with its defaults would have
  chosen from that round's numbers;
- the claim: each round's pick's median over the best's median, <= 1.10; decided on the 95 %
  interval of the rounds' median ratio (``_harness.verdict``: ``ok``, ``MISSED``, or ``undecided``
  while the interval straddles 1.10 -- fewer than 6 rounds decide nothing), printed beside the
  ratios' range and each layout's spread over the rounds ((max - min) / median), which says how far
  single measurements can be trusted;
- memory: every layout's measured peak (:mod:`stratagem.experimental.planning.peak`, the fullest
  process) over its predicted memory, the range over all layouts and rounds (claim: 0.95-1.05).

Models: an MLP (784 -> 512 -> 512 -> 10, float32) and a small GPT (``_harness.gpt``: D=64, 4 blocks,
vocab 256, 32 tokens; attention and MLP split over a model axis by the plan), Adam.

    python benchmarks/planning.py [--processes 2] [--model mlp|transformer|both] [--steps 5] [--rounds 7]
    python benchmarks/planning.py --memory-bound   # the MLP under memory limits (the plan's own table)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _harness import gpt, load_warning, loadavg, mlp, verdict  # noqa: E402

import stratagem as sg  # noqa: E402

GPT = {"dim": 64, "layers": 4, "vocab": 256, "heads": 4, "tokens": 32}
GPT_PLAN = {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.out": "rowwise",
            "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def mlp_model():
    torch.manual_seed(0)
    return mlp((784, 512, 512, 10))


def gpt_model():
    return gpt(GPT["dim"], GPT["layers"], GPT["vocab"], GPT["heads"])


def token_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def request(kind: str, batch: int) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return {"model_fn": mlp_model, "sample_batch": (torch.randn(batch, 784, generator=g),
                                                        torch.randn(batch, 10, generator=g)),
                "tensor_plan": MLP_PLAN, "loss_fn": F.mse_loss}
    tokens = (batch, GPT["tokens"])
    return {"model_fn": gpt_model, "sample_batch": (torch.randint(0, GPT["vocab"], tokens, generator=g),
                                                    torch.randint(0, GPT["vocab"], tokens, generator=g)),
            "tensor_plan": GPT_PLAN, "loss_fn": token_loss}


def sweep(kind: str, args: argparse.Namespace) -> dict:
    """``args.rounds`` exhaustive plans of ``kind``: every layout measured once per round (interleaved in time)."""
    batch = 64 if kind == "mlp" else 16
    rounds = []
    for r in range(args.rounds):
        spec = request(kind, batch)
        plan = sg.experimental.plan(spec.pop("model_fn"), spec.pop("sample_batch"), args.processes,
                                    global_batch=batch, num_measured=None, time_budget_s=3600, steps=args.steps,
                                    verbose=False, **spec)
        if r == 0:
            print(plan, flush=True)
        rounds.append({row.layout: row for row in plan.rows if row.measured_seconds is not None})
        print(f"{kind}: round {r + 1} of {args.rounds} done (load average {loadavg()})", flush=True)
    layouts = [layout for layout in rounds[0] if all(layout in got for got in rounds)]
    times = {layout: [got[layout].measured_seconds for got in rounds] for layout in layouts}
    median = {layout: statistics.median(seconds) for layout, seconds in times.items()}
    best = min(layouts, key=median.__getitem__)
    picks = [_pick(got, args.measured) for got in rounds]   # what the plan would have chosen in each round
    ratios = [median[pick] / median[best] for pick in picks]
    print(f"\n{kind}: per layout over {args.rounds} rounds (each the fastest of {args.steps} steps):")
    print(f"  {'layout':<28}{'median ms':>10}{'min-max ms':>18}{'spread':>8}{'calibrated ms':>15}{'peak/predicted':>16}")
    for layout in sorted(layouts, key=median.__getitem__):
        seconds = times[layout]
        calibrated = statistics.median(got[layout].calibrated_seconds for got in rounds)
        memory = [got[layout].measured_peak / got[layout].prediction.memory for got in rounds]
        print(f"  {layout.describe():<28}{median[layout] * 1e3:>10.2f}"
              f"{f'{min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}':>18}"
              f"{(max(seconds) - min(seconds)) / median[layout]:>8.0%}{calibrated * 1e3:>15.2f}"
              f"{f'{min(memory):.3f}-{max(memory):.3f}':>16}")
    spread = (max(times[best]) - min(times[best])) / median[best]
    memory = [got[l].measured_peak / got[l].prediction.memory for got in rounds for l in layouts]
    print(f"{kind}: exhaustive best {best.describe()} {median[best] * 1e3:.2f} ms (median; its rounds spread "
          f"{spread:.0%}); the plan's pick per round {[p.describe() for p in picks]}")
    print(f"{kind}: pick / best (medians) per round {min(ratios):.3f}-{max(ratios):.3f}: {verdict(ratios, 1.10)}")
    print(f"{kind}: measured peak / predicted memory over {len(layouts)} layouts x {args.rounds} rounds: "
          f"{min(memory):.4f}-{max(memory):.4f} (claim within 0.95-1.05); calibrated prediction vs median "
          f"measured time, rank agreement (Kendall tau) {_rank_agreement(layouts, rounds, median):.2f}\n", flush=True)
    return {"ratios": ratios, "memory": (min(memory), max(memory))}


def _pick(rows: dict, measured: int):
    """The plan's choice from one round's numbers: the fastest of the probes and the ``measured`` others
    cheapest by calibrated prediction (what ``sg.experimental.plan``'s defaults measure)."""
    others = sorted((r for r in rows.values() if not r.probe), key=lambda r: r.calibrated_seconds)[:measured]
    return min([r for r in rows.values() if r.probe] + others, key=lambda r: r.measured_seconds).layout


def memory_bound(args: argparse.Namespace) -> None:
    """The MLP under a memory limit below data parallelism's needs, then under one nothing fits."""
    spec = request("mlp", 64)
    model_fn, sample = spec.pop("model_fn"), spec.pop("sample_batch")
    states = 16 * sum(q.numel() for q in model_fn().parameters())   # float32 parameters, gradients, Adam
    limit = 0.85 * states
    print(f"\nmemory-bound: memory_limit = 0.85 x data parallelism's model states = {limit / 2**20:.3f} MiB", flush=True)
    sg.experimental.plan(model_fn, sample, args.processes, global_batch=64, memory_limit=limit, steps=args.steps,
                         **spec)
    try:
        sg.experimental.plan(model_fn, sample, args.processes, global_batch=64, memory_limit=2**20, verbose=False,
                             **spec)
    except sg.errors.InvalidArgumentError as e:
        print(f"\nmemory_limit = 1 MiB: InvalidArgumentError: {e}", flush=True)


def _rank_agreement(layouts, rounds, median) -> float:
    predicted = {l: statistics.median(got[l].calibrated_seconds for got in rounds) for l in layouts}
    pairs = [(a, b) for i, a in enumerate(layouts) for b in layouts[i + 1:]]
    if not pairs:
        return 1.0
    agree = sum(1 if (predicted[a] - predicted[b]) * (median[a] - median[b]) > 0 else -1 for a, b in pairs)
    return agree / len(pairs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--model", choices=("mlp", "transformer", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (the fastest counts)")
    parser.add_argument("--measured", type=int, default=3, help="how many of the cheapest predicted the plan measures")
    parser.add_argument("--rounds", type=int, default=7,
                        help="exhaustive sweeps, each measuring every layout once; the verdict reads their medians")
    parser.add_argument("--memory-bound", action="store_true",
                        help="instead: the MLP under a memory limit below data parallelism's, and under 1 MiB")
    args = parser.parse_args(argv)
    if args.memory_bound:
        memory_bound(args)
        return 0
    print(f"torch {torch.__version__}, {args.processes} processes, load average {loadavg()}")
    for kind in (("mlp", "transformer") if args.model == "both" else (args.model,)):
        sweep(kind, args)
    warning = load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
