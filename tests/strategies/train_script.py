"""Trains a small model under MultiWorkerMirroredStrategy; the test compares it with plain PyTorch.

Usage (one process per task, each with TF_CONFIG or torchrun variables):
    python train_script.py OUT_DIR [--optimizer sgd|adam] [--bytes-per-pack N]
                           [--replicas-per-worker K] [--batches 12,12,7] [--input loader|list]
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg


class Net(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, classes)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def make_data(batch_sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 4, (b,), generator=g)) for b in batch_sizes]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--bytes-per-pack", type=int, default=0)
    parser.add_argument("--replicas-per-worker", type=int, default=1)
    parser.add_argument("--batches", default="12,12,7,12")
    parser.add_argument("--input", default="list", choices=["list", "loader"])
    parser.add_argument("--wrong-shape-on-rank", type=int, default=-1)
    parser.add_argument("--die-on-rank", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="pass over the batches this many times")
    parser.add_argument("--sharding", default=None, choices=[None, "optimizer", "gradients"])
    args = parser.parse_args(argv)

    options = sg.CommunicationOptions(bytes_per_pack=args.bytes_per_pack, timeout_seconds=args.timeout)
    devices = [f"cpu:{i}" for i in range(args.replicas_per_worker)]
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options, devices=devices,
                                              sharding=args.sharding)
    rank = strategy.cluster_resolver.worker_rank
    torch.manual_seed(100 + rank)  # different on every worker: the chief's values must win
    with strategy.scope():
        model = Net(classes=5 if rank == args.wrong_shape_on_rank else 4)
        optimizer = make_optimizer(args.optimizer, model.parameters())
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    batch_sizes = [int(b) for b in args.batches.split(",")]
    data = make_data(batch_sizes) * args.repeat
    if args.input == "loader":
        xs = torch.cat([x for x, _ in data])
        ys = torch.cat([y for _, y in data])
        dataset = torch.utils.data.TensorDataset(xs, ys)
        assert len(set(batch_sizes[:-1])) <= 1, "a DataLoader has one batch size"
        source = torch.utils.data.DataLoader(dataset, batch_size=batch_sizes[0], shuffle=False)
    else:
        source = data

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    history = []
    for i, batch in enumerate(strategy.experimental_distribute_dataset(source)):
        if i == 1 and rank == args.die_on_rank:
            os._exit(17)
        if i == 1:
            print(f"rank {rank} reached step 1", flush=True)
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        if i < 100:
            history.append({"loss": loss.item(),
                            "params": {k: v.tolist() for k, v in model.state_dict().items()}})
    replicas_equal = all(torch.equal(c, strategy.experimental_local_results(p)[0])
                         for p in model.parameters() for c in strategy.experimental_local_results(p))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"initial": {k: v.tolist() for k, v in initial.items()}, "history": history,
                   "num_replicas": strategy.num_replicas_in_sync, "replicas_equal": replicas_equal}, f)
    print(f"rank {rank} done: {len(history)} steps, loss {history[-1]['loss']:.5f}")


if __name__ == "__main__":
    sys.exit(main())
