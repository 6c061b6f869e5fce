"""Train a small transformer block split Megatron-style over processes (tensor parallelism).

The attention's query/key/value projections are split by columns (each process computes its
own heads) and the output projection by rows; the MLP's fc1 by columns and fc2 by rows: one
all-reduce per block half in the forward pass, one in the backward.

Two processes, one model split in two (mesh 1 data x 2 model):
    stratagem launch --workers 2 examples/tensor_parallel.py
Four processes, two data-parallel groups of two (mesh 2 x 2):
    stratagem launch --workers 4 examples/tensor_parallel.py --data 2
One process (a 1 x 1 mesh, for debugging):
    python examples/tensor_parallel.py
"""

import argparse

import torch
from torch import nn

import stratagem as sg


class Block(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, _ = x.shape
        h = self.norm1(x)
        # split by columns, each process holds its own heads: -1 is the local number of heads
        q, k, v = (proj(h).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "out": "rowwise", "fc1": "colwise", "fc2": "rowwise"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=int, default=1, help="data-parallel groups (the rest split the model)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    strategy = sg.experimental.TensorParallelStrategy(mesh={"data": args.data}, plan=PLAN)
    with strategy.scope():
        block = Block()
        head = nn.Linear(32, 1)
        optimizer = torch.optim.Adam([*block.parameters(), *head.parameters()], lr=3e-3)

    # the task: predict, at each position, the running mean of the first feature so far
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(args.steps, args.batch_size, 8, 32, generator=g)
    targets = xs[..., :1].cumsum(dim=2) / torch.arange(1, 9).view(1, 1, 8, 1)
    dataset = strategy.experimental_distribute_dataset(list(zip(xs, targets)))

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        per_example = ((head(block(x)) - y) ** 2).mean(dim=(1, 2))
        loss = sg.nn.compute_average_loss(per_example)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for number, batch in enumerate(dataset, start=1):
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        if number % 10 == 0 or number == 1:
            print(f"step {number} loss {loss.item():.4f} ({strategy.num_replicas_in_sync} data-parallel "
                  f"replicas, model rank {strategy.model_rank})", flush=True)


if __name__ == "__main__":
    main()
