"""Workers that pass mismatched collectives: every worker must refuse, naming both sides.

Usage (one process per task, with TF_CONFIG): python mismatch_script.py OUT_DIR [--replicas-per-worker K]
    [--last CASE]

Runs every case in :data:`CASES` (worker 1 passes something else than worker 0), catching the error,
then an all-reduce that must still give the right sum (the workers are still in step: nothing lost,
nothing applied twice). Writes OUT_DIR/rank{R}.json: per case the error's type, message and
seconds. Then runs ``--last`` without catching it, so the process exits with its error.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import stratagem as sg


METRICS: list = []  # read by the metric cases; created in the strategy's scope


def ones(shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


def replica(fn):
    """A case that runs ``fn(ctx, worker)`` in every replica."""
    def case(strategy, worker):
        return strategy.run(lambda: fn(sg.get_replica_context(), worker))
    return case


CASES = {
    # name: (what each worker does, words both workers' errors must contain)
    "dtype": (replica(lambda ctx, w: ctx.all_reduce("sum", ones(4, torch.int32 if w else torch.float32))),
              ["worker 0", "float32[4]", "worker 1", "int32[4]"]),
    "count": (replica(lambda ctx, w: ctx.all_reduce("sum", ones(4 + w))),
              ["worker 0", "float32[4]", "worker 1", "float32[5]"]),
    "same_bytes": (replica(lambda ctx, w: ctx.all_reduce("sum", ones(2, torch.float64) if w else ones(4))),
                   ["worker 0", "float32[4]", "worker 1", "float64[2]"]),
    "structure": (replica(lambda ctx, w: ctx.all_reduce("sum", {"a": ones(4)} if w else {"a": ones(4), "b": ones(2)})),
                  ["worker 0", "2 tensors (float32[4], float32[2])", "worker 1", "float32[4]"]),
    "nested": (replica(lambda ctx, w: ctx.all_reduce("sum", (ones(3), [ones(2, torch.int64)]) if w
                                                     else (ones(3), [ones(2), ones(1)]))),
               ["worker 0", "3 tensors (float32[3], float32[2], float32[1])", "worker 1",
                "2 tensors (float32[3], int64[2])"]),
    "large": (replica(lambda ctx, w: ctx.all_reduce("sum", ones(4096, torch.int32 if w else torch.float32))),
              ["worker 0", "float32[4096]", "worker 1", "int32[4096]"]),
    "reduce": (replica(lambda ctx, w: ctx.reduce("sum", ones(3, torch.float64 if w else torch.float32))),
               ["worker 0", "float32[3]", "worker 1", "float64[3]"]),
    "all_gather": (replica(lambda ctx, w: ctx.all_gather(ones((2, 3), torch.int64 if w else torch.float32), axis=0)),
                   ["worker 0", "float32[2, 3]", "worker 1", "int64[2, 3]"]),
    "reduce_scatter": (replica(lambda ctx, w: ctx.reduce_scatter("sum", ones(4 + 2 * w))),
                       ["worker 0", "float32[4]", "worker 1", "float32[6]"]),
    "broadcast": (replica(lambda ctx, w: ctx.broadcast([ones(2)] if w else [ones(2), ones(3)])),
                  ["worker 0", "2 tensors", "worker 1", "float32[2]"]),
    "collectives": (replica(lambda ctx, w: ctx.all_gather(ones(4), axis=0) if w else ctx.all_reduce("sum", ones(4))),
                    ["worker 0 all-reduces", "worker 1 all-gathers", "different collectives"]),
    "requires_grad": (replica(lambda ctx, w: ctx.all_reduce("sum", ones(4).requires_grad_(not w))),
                      ["worker 0 all-reduces float32[4] with 'sum' (recorded for autograd)",
                       "worker 1 float32[4] with 'sum'", "require grad on some workers only"]),
    "strategy.reduce": (lambda s, w: s.reduce("sum", ones(2, torch.float64) if w else ones(2), axis=None),
                        ["strategy.reduce", "worker 0", "float32[2]", "worker 1", "float64[2]"]),
    "strategy.gather": (lambda s, w: s.gather(ones((2, 3 + w)), axis=0),
                        ["strategy.gather", "worker 0", ", 3] along axis 0", "worker 1", ", 4]"]),  # rows: 2 per replica
    "metrics": (lambda s, w: METRICS[w].result(),
                ["worker 0 calls result() of metrics 'loss'", "worker 1 calls result() of metrics 'accuracy'"]),
    "metric_or_reduce": (lambda s, w: METRICS[0].result() if w else s.reduce("sum", ones(1), axis=None),
                         ["worker 0 reduces (strategy.reduce) float32[1]", "worker 1 calls result() of metrics"]),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas-per-worker", type=int, default=1)
    parser.add_argument("--last", default="dtype")
    args = parser.parse_args()
    devices = [f"cpu:{i}" for i in range(args.replicas_per_worker)]
    # A long timeout: a refusal that waited for it would show in the seconds recorded.
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=120),
                                              devices=devices)
    with strategy.scope():
        METRICS.extend([sg.metrics.Mean(name="loss"), sg.metrics.Mean(name="accuracy")])
    for metric in METRICS:
        metric.update_state(torch.tensor([1.0]))
    worker = strategy.cluster_resolver.worker_rank
    n = strategy.num_replicas_in_sync
    print(f"worker {worker} started", flush=True)
    report = {}
    for name, (case, _) in CASES.items():
        started = time.monotonic()
        try:
            case(strategy, worker)
            outcome = {"error": None}
        except Exception as error:  # noqa: BLE001 - recorded for the test
            outcome = {"error": type(error).__name__, "message": str(error)}
        outcome["seconds"] = time.monotonic() - started
        total = strategy.run(lambda: sg.get_replica_context().all_reduce(
            "sum", torch.tensor([sg.get_replica_context().replica_id_in_sync_group + 1.0])))
        outcome["after"] = [t.item() for t in strategy.experimental_local_results(total)]
        outcome["expected_after"] = n * (n + 1) / 2
        report[name] = outcome
        print(f"worker {worker} case {name}: {outcome.get('error')}", flush=True)
    Path(args.out, f"rank{worker}.json").write_text(json.dumps(report))
    print(f"worker {worker} runs the last case {args.last}", flush=True)
    try:
        CASES[args.last][0](strategy, worker)
    except Exception as error:
        print(f"worker {worker} refused the last case: {type(error).__name__}: {error}", flush=True)
        raise
    sys.exit(3)  # not refused: the test fails on this status


if __name__ == "__main__":
    main()
