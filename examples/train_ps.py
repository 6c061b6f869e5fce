"""Parameter-server training of a digits classifier: this script is the coordinator.

A local cluster (2 workers, 2 parameter servers, this script as the chief), started by
stratagem's launcher, which also restarts a task that dies (up to 3 times):
    stratagem launch --workers 2 --ps 2 --max-restarts 3 examples/train_ps.py
On real hosts, run `stratagem server` on each worker and ps host and this script on the
chief's host, each with the same TF_CONFIG cluster (its own "task") and the same secret
STRATAGEM_CLUSTER_TOKEN (e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`).

The variables live on the parameter servers (the first layer's weight split over both by
the partitioner); each worker reads its own shard of the data (dataset_fn runs there) and
the coordinator schedules steps onto whichever worker is free.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg


def dataset_fn(input_context):
    """Runs on each worker: that worker's shard of the digits, shuffled, repeated forever."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    shard = slice(input_context.input_pipeline_id, None, input_context.num_input_pipelines)
    dataset = torch.utils.data.TensorDataset(x[shard], y[shard])
    generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        yield from torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()

    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(2))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):   # runs on a worker: pulls the variables, pushes the gradients
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(args.steps)]
    coordinator.join()
    for start in range(0, args.steps, args.steps // 3):
        chunk = [value.fetch().item() for value in losses[start:start + args.steps // 3]]
        print(f"steps {start + 1}-{start + len(chunk)}: mean loss {sum(chunk) / len(chunk):.4f}", flush=True)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    with torch.no_grad():   # the coordinator reads the model as one plain model
        accuracy = (model(x).argmax(1) == torch.tensor(digits.target)).float().mean().item()
    print(f"training accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
