"""Train a small language model on three axes at once: data x pipe x model (docs/pipeline.md).

The model is an nn.Sequential: a token embedding, transformer blocks, and a head that gives
logits over the vocabulary for every token. PipelineStrategy cuts it into stages over the
"pipe" axis, splits the layers the plan names over the "model" axis (the embedding's rows, the
attention's heads, the MLP's hidden units), and shards parameters, gradients and optimizer
state over the "data" axis with sharding="parameters" (FSDP2). The loss is per token:
cross-entropy of (batch * tokens, vocab) logits against (batch * tokens) targets.

Eight processes, 2 x 2 x 2 (the default mesh):
    stratagem launch --workers 8 examples/pipeline_3d.py
Four processes, one axis of size 1:
    stratagem launch --workers 4 examples/pipeline_3d.py --data 1
    stratagem launch --workers 4 examples/pipeline_3d.py --pipe 1
One process (every axis 1, for debugging):
    python examples/pipeline_3d.py --data 1 --pipe 1 --model 1
"""

import argparse
import math

import torch
from torch import nn

import stratagem as sg

VOCAB, WIDTH, HEAD_DIM, TOKENS = 32, 32, 8, 16


class Attention(nn.Module):
    """Causal self-attention. A colwise q, k, v gives each process of the model axis its share of
    the heads, so the heads are counted with -1; the rowwise ``out`` sums the shares."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, h):
        q, k, v = (f(h).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Head(nn.Module):
    """Logits over the vocabulary for every token (left whole by the plan: the loss needs them whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, h):
        return self.proj(self.norm(h))


def loss_fn(logits, target):
    """The mean loss over the micro-batch's tokens: (batch * tokens, vocab) logits, (batch * tokens) targets."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(num_steps: int, batch_size: int, seed: int) -> list:
    """Token sequences and the task: a fixed map of each token to its target."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_steps, batch_size, TOKENS), generator=g)
    targets = (5 * tokens + 3) % VOCAB
    return list(zip(tokens, targets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=int, default=2, help="data-parallel pipelines")
    parser.add_argument("--pipe", type=int, default=2, help="pipeline stages")
    parser.add_argument("--model", type=int, default=2, help="processes each named layer is split over")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    strategy = sg.experimental.PipelineStrategy(
        mesh={"data": args.data, "pipe": args.pipe, "model": args.model},
        plan={"0": "rowwise",                      # the embedding's rows (it takes the token ids whole)
              "*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.out": "rowwise",
              "*.mlp.0": "colwise", "*.mlp.2": "rowwise"},
        sharding="parameters",                     # ZeRO-3 over the data axis (or None, "optimizer", "gradients")
        num_microbatches=4, schedule="1f1b", loss_fn=loss_fn)
    with strategy.scope():
        model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[Block() for _ in range(8)], Head())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(tokens, targets):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, tokens, targets)   # every micro-batch, pipelined
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)    # the whole model's norm
        optimizer.step()
        return loss

    dataset = strategy.experimental_distribute_dataset(batches(args.steps, args.batch_size, seed=1))
    for number, (tokens, targets) in enumerate(dataset, start=1):
        loss = strategy.reduce("sum", strategy.run(step, args=(tokens, targets)), axis=None)
        if number % 10 == 0 or number == 1:
            print(f"step {number} loss {loss.item():.4f} (mesh {args.data} x {args.pipe} x {args.model}, stages "
                  f"{strategy.stages_of(model)}, model rank {strategy.model_rank})", flush=True)

    # evaluation: logits for every token of new sequences, on every process
    (tokens, targets), = batches(1, 64, seed=2)
    model.eval()
    held_out = loss_fn(strategy.predict(model, tokens), targets).item()
    print(f"held-out loss {held_out:.4f} (uniform guessing: {math.log(VOCAB):.4f})", flush=True)


if __name__ == "__main__":
    main()
