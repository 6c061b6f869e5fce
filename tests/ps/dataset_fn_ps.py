"""Coordinator script: TensorFlow's tutorial pattern, ``strategy.distribute_datasets_from_function``
called inside the function given to ``coordinator.create_per_worker_dataset``.

Run as the chief of `stratagem launch --workers 2 --ps 1 dataset_fn_ps.py OUT`.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg


def main():
    out = sys.argv[1]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])

    def dataset_fn(ctx):
        g = torch.Generator().manual_seed(ctx.input_pipeline_id)
        seen = (ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.num_replicas_in_sync)

        def batches():
            while True:
                x = torch.randn(16, 4, generator=g)
                yield x, x @ true_w.T, seen
        return batches()

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    def step(iterator):
        x, y, seen = next(iterator)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach(), seen

    results = [coordinator.schedule(step, args=(per_worker_iterator,)) for _ in range(150)]
    coordinator.join()
    fetched = [r.fetch() for r in results]
    losses = [loss.item() for loss, _ in fetched]
    seen = {tuple(s) for _, s in fetched}
    for _ in range(100):   # a worker that started late (a busy machine) takes some of the next ones
        if len(seen) == 2:
            break
        more = [coordinator.schedule(step, args=(per_worker_iterator,)) for _ in range(20)]
        coordinator.join()
        seen.update(tuple(r.fetch()[1]) for r in more)

    # experimental_distribute_dataset on a worker gives the dataset back as is
    plain = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.experimental_distribute_dataset([torch.tensor([7.0]), torch.tensor([8.0])])))
    plain_first = coordinator.schedule(lambda it: next(it), args=(plain,)).fetch().tolist()

    # the strategy's coordinator-only methods say so on a worker
    def misuse():
        with strategy.scope():
            return 0
    try:
        coordinator.schedule(misuse).fetch()
        misuse_error = None
    except Exception as e:   # noqa: BLE001 -- reported back to the test
        misuse_error = str(e)

    report = {"first_loss": sum(losses[:10]) / 10, "last_loss": sum(losses[-10:]) / 10,
              "seen": sorted(seen), "plain_first": plain_first,
              "misuse_error": misuse_error}
    print(json.dumps(report))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
