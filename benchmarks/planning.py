"""``sg.experimental.plan``, swept exhaustively: is the measured winner among the cheapest predicted layouts
within 10% of the best of all layouts, and is the predicted memory within 5% of the measured bytes?

For each model, one plan measures **every** layout the processes allow (``num_measured=None``): the same
processes train each layout for ``--steps`` steps after a warm-up, one after the other. From those
measurements, taken under the same conditions:

- *the plan's pick*: the fastest measured of the probes (each mesh's plainest layout, which
  calibrate the predictions) and of the ``--measured`` (default 3) others predicted cheapest after
  calibration -- what ``sg.experimental.plan`` with its defaults would have chosen from these numbers;
- *the exhaustive best*: the fastest of all; their ratio is the claim (<= 1.10);
- memory: for every layout, the model states (parameters, gradients, optimizer state) counted on each
  process against the prediction (the fullest process), as a ratio.

Models: an MLP (784 -> 512 -> 512 -> 10, float32) and a small GPT (``_harness.gpt``: D=64, 4 blocks,
vocab 256, 32 tokens; attention and MLP split over a model axis by the plan), Adam.

    python benchmarks/planning.py [--processes 2] [--model mlp|transformer|both] [--steps 5] [--rounds 1]
    python benchmarks/planning.py --memory-bound   # the MLP under memory limits (the plan's own table)

On a shared 2-core machine the step times of different layouts move with the machine's load; rounds
repeat the whole sweep (read their spread), and the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _harness import gpt, load_warning, loadavg, mlp  # noqa: E402

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
    batch = 64 if kind == "mlp" else 16
    spec = request(kind, batch)
    plan = sg.experimental.plan(spec.pop("model_fn"), spec.pop("sample_batch"), args.processes, global_batch=batch,
                                num_measured=None, time_budget_s=3600, steps=args.steps, verbose=False, **spec)
    print(plan, flush=True)
    ran = [r for r in plan.rows if r.measured_seconds is not None]
    others = sorted((r for r in ran if not r.probe), key=lambda r: r.calibrated_seconds)[:args.measured]
    pick = min([r for r in ran if r.probe] + others, key=lambda r: r.measured_seconds)
    best = min(ran, key=lambda r: r.measured_seconds)
    memory = [r.measured_model_states / r.prediction.model_states for r in ran]
    ranks = _rank_agreement(ran)
    print(f"\n{kind}: the plan's pick (fastest of the probes and the {args.measured} cheapest calibrated) "
          f"{pick.layout.describe()} "
          f"{pick.measured_seconds * 1e3:.2f} ms; exhaustive best {best.layout.describe()} "
          f"{best.measured_seconds * 1e3:.2f} ms; ratio {pick.measured_seconds / best.measured_seconds:.3f} "
          f"(claim <= 1.10)")
    print(f"{kind}: measured / predicted model states over {len(ran)} layouts: {min(memory):.4f}-{max(memory):.4f} "
          f"(claim within 0.95-1.05); calibrated prediction vs measured time, rank agreement (Kendall tau) {ranks:.2f}\n",
          flush=True)
    return {"ratio": pick.measured_seconds / best.measured_seconds, "memory": (min(memory), max(memory))}


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


def _rank_agreement(rows) -> float:
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]]
    if not pairs:
        return 1.0
    agree = sum(1 if (a.calibrated_seconds - b.calibrated_seconds) * (a.measured_seconds - b.measured_seconds) > 0
                else -1 for a, b in pairs)
    return agree / len(pairs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--model", choices=("mlp", "transformer", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (the fastest counts)")
    parser.add_argument("--measured", type=int, default=3, help="how many of the cheapest predicted the plan measures")
    parser.add_argument("--rounds", type=int, default=1, help="repeat each sweep")
    parser.add_argument("--memory-bound", action="store_true",
                        help="instead: the MLP under a memory limit below data parallelism's, and under 1 MiB")
    args = parser.parse_args(argv)
    if args.memory_bound:
        memory_bound(args)
        return 0
    print(f"torch {torch.__version__}, {args.processes} processes, load average {loadavg()}")
    results: dict[str, list[dict]] = {}
    for kind in (("mlp", "transformer") if args.model == "both" else (args.model,)):
        for _ in range(args.rounds):
            results.setdefault(kind, []).append(sweep(kind, args))
    for kind, rounds in results.items():
        ratios = [r["ratio"] for r in rounds]
        print(f"{kind}: pick / exhaustive best over {len(rounds)} round(s): median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f}")
    warning = load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
