"""Every collective across workers (and local replicas): results, gradcheck, torch's own autograd.

Usage (one process per task, with TF_CONFIG): python collectives_script.py OUT_DIR [--replicas-per-worker K]
Writes OUT_DIR/rank{R}.json with what failed on this worker (an empty list: everything held).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: the shared cases beside this script
from tests.comm.collective_cases import OPS, check_all_collectives, gradcheck_all  # noqa: E402


def against_torch_autograd(n: int) -> list[str]:
    """One replica per worker: our differentiable collectives give torch.distributed.nn's gradients."""
    ctx = sg.get_replica_context()
    r = ctx.replica_id_in_sync_group
    failures = []
    cases = {
        "all_reduce": (lambda x: ctx.all_reduce("sum", x), lambda x: dist_nn.all_reduce(x)),
        "all_gather": (lambda x: ctx.all_gather(x, axis=0), lambda x: torch.cat(dist_nn.all_gather(x))),
        "reduce_scatter": (lambda x: ctx.reduce_scatter("sum", x, axis=0),
                           lambda x: dist_nn.reduce_scatter(torch.empty(x.shape[0] // n, 3, dtype=x.dtype),
                                                             list(x.chunk(n)))),
        "all_to_all": (lambda x: torch.cat(ctx.all_to_all(list(x.chunk(n)))),
                       lambda x: torch.cat(dist_nn.all_to_all([torch.empty_like(c) for c in x.chunk(n)],
                                                              list(x.chunk(n))))),
        "broadcast": (lambda x: ctx.broadcast(x, source_replica=n - 1), lambda x: dist_nn.broadcast(x, src=n - 1)),
    }
    for name, (ours, theirs) in cases.items():
        grads, values = [], []
        for fn in (ours, theirs):
            x = (torch.arange(2.0 * n * 3, dtype=torch.float64).reshape(2 * n, 3) + r).requires_grad_()
            y = fn(x)
            weight = torch.linspace(1, 2, y.numel(), dtype=torch.float64).reshape(y.shape) * (r + 1)
            (y * weight).sum().backward()
            grads.append(x.grad)
            values.append(y.detach())
        try:
            torch.testing.assert_close(values[0], values[1])
            torch.testing.assert_close(grads[0], grads[1])
        except AssertionError as error:
            failures.append(f"worker {r}: {name} differs from torch.distributed.nn: {error}")
    return failures


def errors_are_refused_together() -> list[str]:
    ctx = sg.get_replica_context()
    r = ctx.replica_id_in_sync_group
    failures: list[str] = []
    for name, call in {"all_gather of different widths": lambda: ctx.all_gather(torch.ones(2, 2 + r), axis=0),
                       "reduce_scatter of different shapes": lambda: ctx.reduce_scatter("sum", torch.ones(4 + r))}.items():
        try:
            call()
            failures.append(f"replica {r}: {name} was not refused")
        except InvalidArgumentError:
            pass
    return failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas-per-worker", type=int, default=1)
    args = parser.parse_args()
    devices = [f"cpu:{i}" for i in range(args.replicas_per_worker)]
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=60),
                                              devices=devices)
    n = strategy.num_replicas_in_sync
    failures = []
    for result in strategy.experimental_local_results(strategy.run(check_all_collectives)):
        failures += result
    for result in strategy.experimental_local_results(strategy.run(gradcheck_all, args=(n,))):
        failures += [f"gradcheck of {op} failed" for op in OPS if not result.get(op)]
    if args.replicas_per_worker == 1:  # torch's autograd collectives know one rank per process
        failures += strategy.run(against_torch_autograd, args=(n,))
    for result in strategy.experimental_local_results(strategy.run(errors_are_refused_together)):
        failures += result
    # cross-replica context on PerReplica values
    value = strategy.experimental_distribute_values_from_function(
        lambda c: torch.full((2,), float(c.replica_id_in_sync_group)))
    for t in strategy.experimental_local_results(strategy.collectives.all_reduce("sum", value)):
        if t.tolist() != [n * (n - 1) / 2] * 2:
            failures.append(f"strategy.collectives.all_reduce gave {t.tolist()}")
    rank = strategy.cluster_resolver.worker_rank
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(failures))
    print("done", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
