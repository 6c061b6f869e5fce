"""3-D parallelism (data x pipe x model) on 8 processes: memory per rank against its analytic value, and
the step time of 2 x 2 x 2 against every 1-D and 2-D layout of the same processes.

Every configuration runs ``sg.experimental.PipelineStrategy(mesh={"data": d, "pipe": p, "model": t},
plan=PLAN, sharding=..., schedule="1f1b")`` in the same 8 processes (gloo over loopback, 1 intra-op
thread each), one configuration after the other. Model: ``nn.Sequential(Embedding(V, D), L x Block,
Head)``, each block a LayerNorm, self-attention (q, k, v split by columns, the output projection by
rows over the model axis) and an MLP (D -> 4D by columns, 4D -> D by rows); the head (LayerNorm,
Linear(D, V)) is left whole. float32, Adam, cross-entropy over the next token. The analytic model is
the library's (``stratagem.experimental.planning.memory``, which ``sg.experimental.plan`` uses).

1. **Memory per rank** (bytes of the tensors' storages, not RSS), for each layout x ``sharding``:
   parameters and optimizer state between steps (after ``zero_grad(set_to_none=True)``), and the
   gradients right after ``forward_backward``. Analytic, from the stage layout: rank r holds
   Ψ_r = Σ over its stages (Ψ_split / t + Ψ_whole) parameters (Ψ_split: the plan's weights, and the
   biases of its colwise layers; a rowwise layer's bias is added once, whole),
   so in float32

       sharding      parameters   gradients   Adam state
       None          4Ψ_r         4Ψ_r        8Ψ_r
       "optimizer"   4Ψ_r         4Ψ_r        8Ψ_r / d
       "gradients"   4Ψ_r         4Ψ_r        8Ψ_r / d   (a pipeline accumulates every micro-batch's
                                                          gradient before the step: whole until then,
                                                          counted in no_sync, which leaves it in .grad)
       "parameters"  4Ψ_r / d     4Ψ_r / d    8Ψ_r / d   (FSDP2; padding to d rows counted)

   (with a model axis and a data axis under None or "optimizer" each split gradient is a DTensor
   over its slot of the pack that sums it over the data axis: held once, as a plain one).

2. **Step time** (sharding=None, ms per step, median of the timed steps of rank 0; the collectives
   keep the ranks in step) of every layout of the 8 processes, and 2 x 2 x 2 against the best
   layout with at most two axes above 1.

    python benchmarks/mesh3d.py [--quick] [--steps 5] [--dim 256] [--layers 8]

A machine with 2 cores runs 8 processes four to a core: the step times then say how the layouts
share an oversubscribed CPU, not how they scale; the memory table does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import gpt as build  # noqa: E402

from stratagem.experimental.planning.memory import (block_parameters, model_states, rank_parameters,  # noqa: E402
                                                    storage_bytes)

WORLD = 8
SHARDINGS = (None, "optimizer", "gradients", "parameters")
MEMORY_LAYOUTS = ((8, 1, 1), (2, 4, 1), (2, 1, 4), (2, 2, 2), (1, 2, 4))
TIME_LAYOUTS = ((8, 1, 1), (1, 1, 8), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 1, 4), (1, 2, 4), (1, 4, 2), (2, 2, 2))
PLAN = {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.out": "rowwise",
        "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}


def analytic_params(model, strategy, layout) -> tuple[float, float]:
    """Ψ_r: this rank's parameters by the stage layout and the plan (before ZeRO); and of them, the split ones."""
    split = strategy.placement.split_of(model)
    bounds = [split.layout.bounds[s] for s in split.stages]
    split_only = block_parameters(model, PLAN, layout[2], split_only=True)
    return sum(rank_parameters(model, bounds, PLAN, layout[2])), sum(sum(split_only[a:b]) for a, b in bounds)


def worker(out: str, spec: str) -> None:
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    options = json.loads(spec)
    rank = sg.cluster.resolve().worker_rank
    results = []
    g = torch.Generator().manual_seed(1)
    batch, tokens, vocab = options["batch"], options["tokens"], options["vocab"]
    x = torch.randint(0, vocab, (batch, tokens), generator=g)
    y = torch.randint(0, vocab, (batch, tokens), generator=g)

    def loss_fn(output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    for kind, layout, sharding in options["runs"]:
        d, p, t = layout
        strategy = sg.experimental.PipelineStrategy({"data": d, "pipe": p, "model": t}, plan=PLAN,
                                                    sharding=sharding, schedule="1f1b",
                                                    num_microbatches=options["microbatches"], loss_fn=loss_fn)
        with strategy.scope():
            model = build(options["dim"], options["layers"], vocab, options["heads"])
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        (xs, ys), = list(strategy.experimental_distribute_dataset([(x, y)]))
        entry = {"kind": kind, "layout": layout, "sharding": sharding}

        def step(xb, yb, measure=False):
            optimizer.zero_grad(set_to_none=True)
            if measure and sharding == "gradients":   # the whole local gradient, held until the reduce-scatter
                with strategy.no_sync():
                    strategy.forward_backward(model, xb, yb)
                entry["grads"] = storage_bytes(q.grad for q in model.parameters())
                optimizer.zero_grad(set_to_none=True)
            strategy.forward_backward(model, xb, yb)
            if measure and sharding != "gradients":
                entry["grads"] = storage_bytes(q.grad for q in model.parameters())
            optimizer.step()
        if kind == "memory":
            for _ in range(2):
                strategy.run(step, args=(xs, ys, True))
            optimizer.zero_grad(set_to_none=True)
            entry.update(params=storage_bytes(model.parameters()), state=strategy.placement.state_bytes(optimizer),
                         psi_r=analytic_params(model, strategy, layout)[0],
                         psi_split=analytic_params(model, strategy, layout)[1],
                         psi=sum(q.numel() for q in build(options["dim"], options["layers"], vocab,
                                                          options["heads"]).parameters()))
        else:
            times = []
            for i in range(options["warmup"] + options["steps"]):
                start = time.perf_counter()
                strategy.run(step, args=(xs, ys))
                if i >= options["warmup"]:
                    times.append(time.perf_counter() - start)
            entry["step_s"] = statistics.median(times)
        results.append(entry)
        print(f"rank {rank}: {kind} {layout} {sharding} done", flush=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def analytic(sharding, psi_r: float, d: int, t: int = 1, psi_split: float = 0.0) -> tuple[float, float, float]:
    # (a split layer's gradient views its pack of sums as a plain one does: no second copy; t, psi_split unused)
    return model_states(psi_r, data=d, sharding=sharding, element_size=4, state_per_parameter=8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a small model, 2 timed steps, fewer layouts")
    parser.add_argument("--dim", type=int, help="model width D (default 256; --quick 64)")
    parser.add_argument("--layers", type=int, help="blocks L (default 8; --quick 4)")
    parser.add_argument("--steps", type=int, help="timed steps per layout (default 5; --quick 2)")
    parser.add_argument("--part", choices=("all", "memory", "time"), default="all")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    quick = args.quick
    options = {"dim": args.dim or (64 if quick else 256), "layers": args.layers or (4 if quick else 8),
               "heads": 8, "vocab": 64 if quick else 512, "tokens": 16 if quick else 32, "batch": 16 if quick else 32,
               "microbatches": 4, "steps": args.steps or (2 if quick else 5), "warmup": 1}
    runs = []
    if args.part in ("all", "memory"):
        layouts = ((2, 2, 2), (2, 1, 4)) if quick else MEMORY_LAYOUTS
        runs += [("memory", layout, sharding) for layout in layouts for sharding in SHARDINGS]
    if args.part in ("all", "time"):
        layouts = ((8, 1, 1), (4, 2, 1), (2, 1, 4), (2, 2, 2)) if quick else TIME_LAYOUTS
        runs += [("time", layout, None) for layout in layouts]
    options["runs"] = runs
    from stratagem.testing import run_local_cluster

    with tempfile.TemporaryDirectory() as out:
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)}
        results = run_local_cluster(Path(__file__), WORLD, args=["--worker", out, json.dumps(options)],
                                    timeout=3000, env=env)
        if any(r.returncode != 0 for r in results):
            print("failed:\n" + "\n".join(f"{r.task}: {r.output[-3000:]}" for r in results if r.returncode),
                  file=sys.stderr)
            return 1
        got = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(f"model: D={options['dim']}, {options['layers']} blocks, vocab {options['vocab']}, {options['tokens']} "
          f"tokens, global batch {options['batch']}, {options['microbatches']} micro-batches, 1F1B, Adam, float32; "
          f"{WORLD} processes, gloo")
    _print_memory(got)
    _print_times(got)
    return 0


def _print_memory(got) -> None:
    entries = [i for i, e in enumerate(got[0]) if e["kind"] == "memory"]
    if not entries:
        return
    mib = 1 << 20
    print(f"\n1. memory per rank (MiB; measured / analytic), Ψ = {got[0][entries[0]]['psi'] / 1e6:.2f} M parameters")
    print(f"{'d x p x t':<10}{'sharding':<12}{'rank':>5}{'params':>18}{'grads':>18}{'Adam state':>18}"
          f"{'total ratio':>13}")
    for i in entries:
        for rank in (0, WORLD - 1):
            e = got[rank][i]
            d, p, t = e["layout"]
            want = analytic(e["sharding"], e["psi_r"], d, t, e.get("psi_split", 0.0))
            have = (e["params"], e["grads"], e["state"])
            cells = "".join(f"{h / mib:>9.3f} /{w / mib:>7.3f}" for h, w in zip(have, want))
            print(f"{f'{d}x{p}x{t}':<10}{str(e['sharding']):<12}{rank:>5}{cells}{sum(have) / sum(want):>13.3f}")


def _print_times(got) -> None:
    entries = [i for i, e in enumerate(got[0]) if e["kind"] == "time"]
    if not entries:
        return
    print("\n2. step time (sharding=None; ms per step, rank 0, median of the timed steps)")
    times = {}
    for i in entries:
        d, p, t = got[0][i]["layout"]
        times[(d, p, t)] = got[0][i]["step_s"]
        print(f"{f'{d}x{p}x{t}':<10}{times[(d, p, t)] * 1e3:>10.1f}")
    if (2, 2, 2) in times:
        flat = {k: v for k, v in times.items() if sum(s > 1 for s in k) <= 2}
        best = min(flat, key=flat.get)
        print(f"2x2x2 / best layout with at most two axes ({'x'.join(map(str, best))}): "
              f"{times[(2, 2, 2)] / flat[best]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
