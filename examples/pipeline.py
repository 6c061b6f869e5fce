"""Train a deep MLP cut into pipeline stages over processes (pipeline parallelism).

The model is an nn.Sequential of residual blocks; PipelineStrategy cuts it into stages (one per
process, or two with the interleaved and zero-bubble schedules), and every step runs the chosen
schedule over micro-batches: process 0 computes the first blocks of micro-batch 1 while process 1
computes the last blocks of micro-batch 0, and so on.

Two processes, the model in two stages (1F1B):
    stratagem launch --workers 2 examples/pipeline.py
Other schedules:
    stratagem launch --workers 2 examples/pipeline.py --schedule zero_bubble
Four processes, two data-parallel pipelines of two stages (mesh 2 x 2):
    stratagem launch --workers 4 examples/pipeline.py --data 2
One process (a one-stage pipeline, for debugging):
    python examples/pipeline.py
"""

import argparse

import torch
from torch import nn

import stratagem as sg


class Residual(nn.Module):
    """x + MLP(LayerNorm(x)): one pipeline-friendly block (one tensor in, one out)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=int, default=1, help="data-parallel pipelines (the rest are stages)")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zero_bubble, ...")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    strategy = sg.experimental.PipelineStrategy(
        mesh={"data": args.data}, num_microbatches=args.microbatches, schedule=args.schedule,
        loss_fn=nn.functional.mse_loss)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(16, 64), *[Residual(64) for _ in range(6)], nn.Linear(64, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # the task: a smooth function of the inputs
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(args.steps, args.batch_size, 16, generator=g)
    ys = torch.sin(xs[..., :4].sum(dim=-1, keepdim=True)) + 0.1 * xs[..., 4:5]
    dataset = strategy.experimental_distribute_dataset(list(zip(xs, ys)))

    def step(x, y):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y)   # forward and backward of every micro-batch
        optimizer.step()
        return loss

    for number, (x, y) in enumerate(dataset, start=1):
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        if number % 10 == 0 or number == 1:
            print(f"step {number} loss {loss.item():.4f} (stages {strategy.stages_of(model)} of pipe rank "
                  f"{strategy.pipe_rank}, {strategy.num_replicas_in_sync} data-parallel replicas)", flush=True)

    # evaluation: the output of the whole model on every process (stages one after the other)
    x = torch.randn(100, 16, generator=g)
    y = torch.sin(x[:, :4].sum(dim=-1, keepdim=True)) + 0.1 * x[:, 4:5]
    model.eval()
    print(f"held-out loss {nn.functional.mse_loss(strategy.predict(model, x), y).item():.4f}", flush=True)


if __name__ == "__main__":
    main()
