"""Model parallelism: memory per worker of ZeRO sharding against its analytic value, and step time.

Runs MultiWorkerMirroredStrategy with sharding=None, "optimizer", "gradients" and "parameters" on
2 local worker processes (gloo), trains the benchmark MLP (784-1024-1024-10, float32, Adam) for two
steps and counts, on each worker, the bytes it holds between steps (after
``zero_grad(set_to_none=True)``): parameters, summed-gradient buffers, optimizer state (tensors
counted by their storages, not by the process's RSS). Prints them against the float32
analytic values (Ψ parameters, N workers; the float32 equivalent of the mixed-precision
accounting):

    None          4Ψ + 4Ψ + 8Ψ         = 16Ψ
    "optimizer"   4Ψ + 4Ψ + 8Ψ/N       (stage 1)
    "gradients"   4Ψ + 4Ψ/N + 8Ψ/N     (stage 2; the summed gradient exists only as each
                                        worker's range, during the step)
    "parameters"  4Ψ/N + 4Ψ/N + 8Ψ/N   = 16Ψ/N (stage 3, FSDP2; the summed gradient shard,
                                        which param.grad keeps until zero_grad, is counted)

The local gradients of backward (4Ψ, whole without sharding and under stage 1) are reported
apart; for stage 2, the gradient buffers held at once during a step (its packs).

Then the step time of each stage against torch's DistributedDataParallel on the same model
(same optimizer and batch), as ratios, over ``--rounds`` rounds: each round launches DDP and
every stage in turn, so a slow moment of a shared machine shows in one round.

    python benchmarks/model_parallel.py [--workers 2] [--rounds 3] [--steps 20]

The pipeline part (bubble per rank against (p-1)/(m+p-1), activation memory of 1F1B against
GPipe, step time against one process, DDP and the raw torch schedules) is in ``_pipeline.py``.
``--part`` picks the parts to run (default: both, the pipeline part with its defaults); after
``--part pipeline`` every option is the pipeline part's:

    python benchmarks/model_parallel.py --part pipeline [--quick] [--help]

PipelineStrategy's options (``_pipeline_options.py``, run only when named): balanced stages
(``split_points="auto"`` against the even split on blocks whose costs differ 4x) and activation
recomputation (memory saved and time paid against the textbook values):

    python benchmarks/model_parallel.py --part balance [--quick] [--help]
    python benchmarks/model_parallel.py --part recompute [--quick] [--help]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pipeline  # noqa: E402
import _pipeline_options  # noqa: E402

STAGES = (None, "optimizer", "gradients", "parameters")
PARTS = ("all", "zero", "pipeline", "balance", "recompute")
BATCH = 256


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def worker(out: str, stage: str, steps: str = "0") -> None:
    import time

    import torch
    import torch.nn.functional as F
    from torch import nn

    import stratagem as sg
    from stratagem._record import record

    small = stage == "gradients-small"   # stage 2 with 1 MiB packs
    options = sg.CommunicationOptions(bytes_per_pack=1 << 20 if small else 0)
    stage = "gradients" if small else stage
    strategy = sg.MultiWorkerMirroredStrategy(sharding=None if stage in ("none", "ddp") else stage,
                                              communication_options=options)
    with (strategy.scope() if stage != "ddp" else contextlib.nullcontext()):
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        if stage == "ddp":   # torch's DistributedDataParallel on the strategy's process group
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    local_grads = 0

    def step():
        nonlocal local_grads
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if stage != "ddp":   # DDP averages the workers' gradients; stratagem sums them
            loss = sg.nn.mean_over_replicas(loss)
        loss.backward()
        local_grads = _storage_bytes([_local(p.grad) for p in params])
        optimizer.step()

    run = step if stage == "ddp" else (lambda: strategy.run(step))
    for _ in range(2):
        run()
    optimizer.zero_grad(set_to_none=True)
    result: dict = {"workers": strategy.num_replicas_in_sync}
    if stage != "ddp":
        packs = [pack.buffer for packs in strategy.collective._packs.values() for pack in packs.packs]
        if stage == "parameters":   # p.grad is the summed shard, kept from backward until zero_grad
            packs = []
        state = (strategy.placement.state_bytes(optimizer) if stage != "none" else
                 sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0))
        result.update({"psi": sum(_full_numel(p) for p in params), "params": _storage_bytes(map(_local, params)),
                       "summed_grads": local_grads if stage == "parameters" else _storage_bytes(packs),
                       "state": state, "local_grads": 0 if stage == "parameters" else local_grads})
        if stage == "gradients":   # the gradient buffers held at once during the last step
            result["grad_peak"] = record(optimizer).zero.scattered.peak_bytes
    if int(steps):
        start = time.perf_counter()
        for _ in range(int(steps)):
            run()
        result["step_s"] = (time.perf_counter() - start) / int(steps)
    rank = strategy.cluster_resolver.worker_rank
    Path(out, f"{'gradients-small' if small else stage}-{rank}.json").write_text(json.dumps(result))


def _local(t):
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _full_numel(t) -> int:
    return t.numel()   # a DTensor's numel is the whole parameter's


def analytic(stage: str | None, psi: int, n: int) -> tuple[float, float, float]:
    if stage == "parameters":   # stage 3: 16Ψ/N, the summed gradient shard counted (kept until zero_grad)
        return 4 * psi / n, 4 * psi / n, 8 * psi / n
    grads = 4 * psi if stage in (None, "optimizer") else 0   # stage 2: the sum lives only during the step
    state = 8 * psi if stage is None else 8 * psi / n
    return 4 * psi, grads, state


def _part(argv) -> tuple[str, list[str]]:
    """``--part`` (all, zero, pipeline) and the other arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--part", choices=PARTS, default="all")
    args, rest = parser.parse_known_args(argv)
    return args.part, rest


def main(argv=None) -> int:
    part, rest = _part(argv)
    if part == "pipeline":
        return _pipeline.main(rest)
    if part in _pipeline_options.CONFIGS:
        return _pipeline_options.main(rest, part)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker", nargs="+", metavar="OUT STAGE [STEPS]", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (each launches every stage and DDP)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    parser.add_argument("--part", choices=PARTS, default="all",
                        help="zero: this ZeRO part; pipeline: the pipeline part (its options: --part pipeline --help); "
                             "balance, recompute: PipelineStrategy's options (--part balance --help)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from stratagem.testing import run_local_cluster

    mib = 1 << 20
    print(f"ZeRO sharding, memory held per worker between steps, {args.workers} workers, "
          f"MLP 784-1024-1024-10 float32, Adam (MiB)")
    print(f"{'sharding':<14}{'params':>9}{'sum grads':>11}{'opt state':>11}{'total':>9}"
          f"{'analytic':>10}{'ratio':>8}{'local grads':>13}")
    failed = False
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(max(args.rounds, 1)):
            for stage in ("ddp",) + STAGES:
                name = "none" if stage is None else str(stage)
                results = run_local_cluster(Path(__file__), args.workers, timeout=300,
                                            args=["--worker", out, name, str(args.steps)])
                if any(r.returncode != 0 for r in results):
                    failed = True
                    print(f"{name}: failed\n" + "\n".join(r.output[-2000:] for r in results), file=sys.stderr)
                    continue
                got = [json.loads(Path(out, f"{name}-{rank}.json").read_text()) for rank in range(args.workers)]
                if args.steps:
                    times.setdefault(name, []).append(max(g["step_s"] for g in got))
                if round_ or stage == "ddp":
                    continue
                for rank, g in enumerate(got):
                    p, gr, st = analytic(stage, g["psi"], args.workers)
                    total = g["params"] + g["summed_grads"] + g["state"]
                    print(f"{str(stage) + ' r' + str(rank):<14}{g['params'] / mib:>9.2f}{g['summed_grads'] / mib:>11.2f}"
                          f"{g['state'] / mib:>11.2f}{total / mib:>9.2f}{(p + gr + st) / mib:>10.2f}"
                          f"{total / (p + gr + st):>8.3f}{g['local_grads'] / mib:>13.2f}")
        _print_stage2_peaks(out, args, failed)
    if times.get("ddp"):
        _print_times(times, args)
    if args.part == "all":
        print()
        failed = _pipeline.main([]) != 0 or failed
    return 1 if failed else 0


def _print_stage2_peaks(out: str, args: argparse.Namespace, failed: bool) -> None:
    """Stage 2's gradient buffers at their peak during a step, with the default packs and 1 MiB packs,
    against what one reduce-scatter after backward held (whole local gradients, a flat copy, the range)."""
    from stratagem.testing import run_local_cluster

    results = run_local_cluster(Path(__file__), args.workers, timeout=300, args=["--worker", out, "gradients-small"])
    if any(r.returncode != 0 for r in results):
        print("gradients-small: failed\n" + "\n".join(r.output[-2000:] for r in results), file=sys.stderr)
        return
    mib = 1 << 20
    default = json.loads(Path(out, "gradients-0.json").read_text())
    small = json.loads(Path(out, "gradients-small-0.json").read_text())
    psi = default["psi"]
    print(f"stage 2, gradient buffers at their peak during a step (worker 0): {default['grad_peak'] / mib:.2f} MiB "
          f"(default packs), {small['grad_peak'] / mib:.2f} MiB (1 MiB packs); one reduce-scatter after backward "
          f"held {(8 * psi + 4 * psi / args.workers) / mib:.2f} MiB (local gradients 4Ψ, a flat copy 4Ψ, the range 4Ψ/N)")


def _print_times(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Step time of each stage against DDP, per round (the rounds launch in turn: a noisy machine
    slows one round, not one stage) and the median of the rounds."""
    print(f"\nstep time against torch's DistributedDataParallel (same model, Adam, global batch "
          f"{BATCH * args.workers}, {args.steps} steps per launch, {args.workers} workers)")
    print(f"{'sharding':<12}{'ms/step (median)':>18}{'ratio to DDP per round':>36}{'median':>8}")
    ddp = times["ddp"]
    for name, values in times.items():
        ratios = [v / d for v, d in zip(values, ddp)]
        print(f"{name:<12}{statistics.median(values) * 1e3:>18.1f}{' '.join(f'{r:.2f}' for r in ratios):>36}"
              f"{statistics.median(ratios):>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
