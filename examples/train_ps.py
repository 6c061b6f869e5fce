"""Parameter-server training of a digits classifier: this script is the coordinator.

A local cluster (2 workers, 2 parameter servers, this script as the chief), started by
stratagem's launcher, which also restarts a task that dies (up to 3 times)::

    stratagem launch --workers 2 --ps 2 --max-restarts 3 examples/train_ps.py --dir /tmp/ps_run

On real hosts, run `stratagem server` on each worker and ps host and this script on the
chief's host, each with the same TF_CONFIG cluster (its own "task") and the same secret
STRATAGEM_CLUSTER_TOKEN (e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`).
On Kubernetes, examples/kubernetes/tfjob-ps.yaml and jobset-ps.yaml run it (docs/kubernetes.md).

The variables live on the parameter servers (the first layer's weight split over both by
the partitioner); each worker reads its own shard of the data (dataset_fn runs there) and
the coordinator schedules steps onto whichever worker is free.

With ``--dir`` it saves a checkpoint every ``--save-every`` steps and survives losing any
task (docs/fault_tolerance.md):

- ``kill -KILL <pid of a worker>``: its steps run on the other worker; the restarted one
  gets work again.
- ``kill -KILL <pid of a ps>``: ``join()`` raises ``UnavailableError`` naming it; the
  launcher restarts it, empty, and the script restores every variable from the last
  checkpoint and goes on from there.
- ``kill -KILL <pid of the chief>``: the launcher restarts it; the new coordinator takes the
  parameter servers over (the old one's variables there are dropped), restores the last
  checkpoint and goes on.
- run the same command again after it finished: it finds its work done.

Without ``--dir`` nothing is saved, and a restarted chief starts training over.
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
    parser.add_argument("--dir", help="checkpoint folder (shared with the parameter servers, which write "
                                      "their shards into it); none: no checkpoints")
    parser.add_argument("--save-every", type=int, default=100)
    args = parser.parse_args()

    # the cluster from the environment: TF_CONFIG (stratagem launch, a TFJob) or a JobSet's pod
    strategy = sg.ParameterServerStrategy(variable_partitioner=sg.FixedShardsPartitioner(2))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
    manager = sg.CheckpointManager(ckpt, args.dir, max_to_keep=2) if args.dir else None
    if manager is not None:
        restored = manager.restore_or_initialize()
        if restored:
            print(f"restored {restored} at step {ckpt.step}", flush=True)
        else:
            manager.save()   # step 0: a lost ps can always be restored

    def step(it):   # runs on a worker: pulls the variables, pushes the gradients
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    while ckpt.step < args.steps:
        count = min(args.save_every, args.steps - ckpt.step)
        try:
            losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(count)]
            coordinator.join()
        except sg.errors.UnavailableError as error:
            if manager is None or not str(error.task).startswith("ps"):
                raise
            print(f"{error.task} was lost; restoring {manager.latest_checkpoint}", flush=True)
            manager.restore_or_initialize()   # writes every variable back, on the restarted ps too
            continue
        ckpt.step += count
        mean = sum(value.fetch().item() for value in losses) / count
        print(f"steps {ckpt.step - count + 1}-{ckpt.step}: mean loss {mean:.4f}", flush=True)
        if manager is not None:
            manager.save()
            print(f"saved a checkpoint at step {ckpt.step}", flush=True)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    with torch.no_grad():   # the coordinator reads the model as one plain model
        accuracy = (model(x).argmax(1) == torch.tensor(digits.target)).float().mean().item()
    print(f"training accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
