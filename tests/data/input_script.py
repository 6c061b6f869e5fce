"""Checks multi-worker input from inside each worker; writes what it saw to OUT/rankN.json."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import stratagem as sg


class Recording(Dataset):
    """A map-style dataset that remembers which rows this process loaded."""

    def __init__(self, n):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor([float(i)])


def local_rows(strategy, value):
    return [t.reshape(-1).tolist() for t in strategy.experimental_local_results(value)]


def main(out):
    strategy = sg.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"],
                                              communication_options=sg.CommunicationOptions(timeout_seconds=30))
    rank = strategy.cluster_resolver.worker_rank
    report = {}

    # AUTO over a list: each worker keeps its replicas' slices; 9 rows over 4 replicas = 3,2,2,2
    batch = next(iter(strategy.experimental_distribute_dataset([torch.arange(9)])))
    report["auto"] = (local_rows(strategy, batch), batch._global_batch_size)
    off = sg.InputOptions(auto_shard_policy=sg.AutoShardPolicy.OFF)
    batch = next(iter(strategy.experimental_distribute_dataset([torch.arange(9)], options=off)))
    report["off"] = (local_rows(strategy, batch), batch._global_batch_size)

    # a DataLoader over a map-style dataset: only this worker's rows are loaded, shuffling agrees
    dataset = Recording(10)
    torch.manual_seed(rank)  # different global RNG per worker: the chief's seed must win
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    seen = []
    for batch in strategy.experimental_distribute_dataset(loader):
        seen.append((local_rows(strategy, batch), batch._global_batch_size))
    report["loader"] = {"seen": seen, "loaded": sorted(dataset.loaded)}

    # generators of different lengths: everyone stops together, no batch lost
    steps = 3 if rank == 0 else 5
    gen = (torch.full((4,), float(10 * rank + i)) for i in range(steps))

    class Once:
        def __iter__(self):
            return gen

    totals = []
    for batch in strategy.experimental_distribute_dataset(Once()):
        got = strategy.run(lambda x: sg.nn.compute_average_loss(x), args=(batch,))
        totals.append((local_rows(strategy, batch), strategy.reduce("sum", got, axis=None).item()))
    report["uneven"] = totals

    # one pipeline per worker: per-replica batches, global size known exactly
    def dataset_fn(ctx):
        n = ctx.get_per_replica_batch_size(8)
        rows = 3 if ctx.input_pipeline_id == 0 else 2
        return [torch.full((n,), float(ctx.input_pipeline_id)) for _ in range(rows)]

    report["from_function"] = [(local_rows(strategy, b), b._global_batch_size)
                               for b in strategy.distribute_datasets_from_function(dataset_fn)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
