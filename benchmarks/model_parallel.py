"""Model parallelism: memory per worker of ZeRO sharding against its analytic value.

Runs MultiWorkerMirroredStrategy with sharding=None, "optimizer" and "gradients" on 2 local
worker processes (gloo), trains the benchmark MLP (784-1024-1024-10, float32, Adam) for two
steps and counts, on each worker, the bytes it holds between steps (after
``zero_grad(set_to_none=True)``): parameters, summed-gradient buffers, optimizer state (tensors
counted by their storages, not by the process's RSS). Prints them against the float32
analytic values (Ψ parameters, N workers):

    None         4Ψ + 4Ψ + 8Ψ         = 16Ψ
    "optimizer"  4Ψ + 4Ψ + 8Ψ/N       (stage 1)
    "gradients"  4Ψ + 4Ψ/N + 8Ψ/N     (stage 2; the summed gradient exists only as each
                                       worker's range, during the step)

The local gradients of backward (4Ψ, whole under every stage here) are reported apart.

    python benchmarks/model_parallel.py [--workers 2]

The pipeline part (bubble per rank against (p-1)/(m+p-1), activation memory of 1F1B against
GPipe, step time against one process, DDP and the raw torch schedules) is in ``_pipeline.py``;
``--part`` picks the parts to run, and what follows it goes to the pipeline part:

    python benchmarks/model_parallel.py --part pipeline [--quick] [--help]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pipeline  # noqa: E402

STAGES = (None, "optimizer", "gradients")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def worker(out: str, stage: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import stratagem as sg

    strategy = sg.MultiWorkerMirroredStrategy(sharding=None if stage == "none" else stage)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    local_grads = 0

    def step():
        nonlocal local_grads
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        local_grads = _storage_bytes([p.grad for p in params])
        optimizer.step()

    for _ in range(2):
        strategy.run(step)
    optimizer.zero_grad(set_to_none=True)
    packs = [pack.buffer for packs in strategy.collective._packs.values() for pack in packs.packs]
    state = (strategy.placement.state_bytes(optimizer) if stage != "none" else
             sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0))
    result = {"psi": sum(p.numel() for p in params), "params": _storage_bytes(params),
              "summed_grads": _storage_bytes(packs), "state": state, "local_grads": local_grads,
              "workers": strategy.num_replicas_in_sync}
    rank = strategy.cluster_resolver.worker_rank
    Path(out, f"{stage}-{rank}.json").write_text(json.dumps(result))


def analytic(stage: str | None, psi: int, n: int) -> tuple[float, float, float]:
    grads = 4 * psi if stage in (None, "optimizer") else 0   # stage 2: the sum lives only during the step
    state = 8 * psi if stage is None else 8 * psi / n
    return 4 * psi, grads, state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="show this help (--part pipeline: its options)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "STAGE"), help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("all", "zero", "pipeline"), default="all",
                        help="zero: ZeRO memory; pipeline: the pipeline part (its options: --part pipeline --help)")
    args, pipeline_argv = parser.parse_known_args(argv)
    if args.part == "pipeline":
        return _pipeline.main(pipeline_argv + (["--help"] if args.help else []))
    if args.help:
        parser.print_help()
        return 0
    if pipeline_argv and args.part == "zero":
        parser.error(f"unrecognized arguments: {' '.join(pipeline_argv)}")
    if args.part == "all" and not args.worker:
        _pipeline.parse_args(pipeline_argv)   # a wrong pipeline option fails before the ZeRO part runs
    if args.worker:
        worker(*args.worker)
        return 0
    from stratagem.testing import run_local_cluster

    mib = 1 << 20
    print(f"ZeRO sharding, memory held per worker between steps, {args.workers} workers, "
          f"MLP 784-1024-1024-10 float32, Adam (MiB)")
    print(f"{'sharding':<12}{'params':>9}{'sum grads':>11}{'opt state':>11}{'total':>9}"
          f"{'analytic':>10}{'ratio':>8}{'local grads':>13}")
    failed = False
    with tempfile.TemporaryDirectory() as out:
        for stage in STAGES:
            name = "none" if stage is None else stage
            results = run_local_cluster(Path(__file__), args.workers, args=["--worker", out, name], timeout=300)
            if any(r.returncode != 0 for r in results):
                failed = True
                print(f"{name}: failed\n" + "\n".join(r.output[-2000:] for r in results), file=sys.stderr)
                continue
            for rank in range(args.workers):
                got = json.loads(Path(out, f"{name}-{rank}.json").read_text())
                p, g, s = analytic(stage, got["psi"], args.workers)
                total = got["params"] + got["summed_grads"] + got["state"]
                print(f"{str(stage) + ' r' + str(rank):<12}{got['params'] / mib:>9.2f}{got['summed_grads'] / mib:>11.2f}"
                      f"{got['state'] / mib:>11.2f}{total / mib:>9.2f}{(p + g + s) / mib:>10.2f}"
                      f"{total / (p + g + s):>8.3f}{got['local_grads'] / mib:>13.2f}")
    if args.part == "all":
        print()
        failed = _pipeline.main(pipeline_argv) != 0 or failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
