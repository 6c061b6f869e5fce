"""Every metric under MultiWorkerMirroredStrategy (2 logical replicas per worker): each worker
checks that result() equals the metric computed on all rows at once.

Usage (one process per task, each with TF_CONFIG): python multi_worker_script.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import stratagem as sg  # noqa: E402
from tests.metrics import oracle  # noqa: E402


def main() -> None:
    strategy = sg.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"],
                                              communication_options=sg.CommunicationOptions(timeout_seconds=60))
    rank = strategy.cluster_resolver.worker_rank
    assert strategy.num_replicas_in_sync == 4
    with strategy.scope():
        metrics = oracle.make_metrics()
        chief_only = sg.metrics.Mean(name="chief_only")
    # 23 rows in global batches of 7: the last batch of 2 leaves two of the four replicas empty
    data = oracle.make_data(23, seed=5)
    for batch in strategy.experimental_distribute_dataset(oracle.batches(data, 7)):
        strategy.run(oracle.update, args=(metrics, batch))
    oracle.check(metrics, data)
    oracle.check(metrics, data, together=True)   # one collective for all the metrics
    if rank == 0:                        # a worker that never updated a metric contributes nothing
        chief_only.update_state(torch.tensor([2.0, 4.0]))
    assert chief_only.result().item() == 3.0, chief_only.result()

    for metric in metrics.values():      # reset_state on every worker: a new evaluation
        metric.reset_state()
    fresh = oracle.make_data(9, seed=6)
    for batch in strategy.experimental_distribute_dataset(oracle.batches(fresh, 4)):
        strategy.run(oracle.update, args=(metrics, batch))
    oracle.check(metrics, fresh)
    print(f"rank {rank}: metrics ok", flush=True)


if __name__ == "__main__":
    main()
