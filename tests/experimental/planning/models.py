"""The planner tests' models (float64), importable by the plan's and the training cluster's processes.

- :func:`mlp`: ``Linear(16, 64) - ReLU - Linear(64, 64) - ReLU - Linear(64, 4)``, :data:`MLP_PLAN`
  splits its first two layers over a model axis;
- :func:`transformer`: ``nn.Sequential(Embedding, 2 x Block, Head)``, each block pre-norm causal
  attention (``q``, ``k``, ``v``, ``out``) and an MLP, :data:`TRANSFORMER_PLAN` the Megatron split;
  :func:`token_loss` its cross-entropy over the next token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DTYPE = torch.float64
VOCAB, LENGTH, WIDTH, HEADS = 16, 8, 16, 2
MLP_PLAN = {"0": "colwise", "2": "rowwise"}
TRANSFORMER_PLAN = {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.out": "rowwise",
                    "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64, dtype=DTYPE), nn.ReLU(), nn.Linear(64, 64, dtype=DTYPE), nn.ReLU(),
                         nn.Linear(64, 4, dtype=DTYPE))


def mlp_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g, dtype=DTYPE), torch.randn(rows, 4, generator=g, dtype=DTYPE)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v, self.out = (nn.Linear(WIDTH, WIDTH, dtype=DTYPE) for _ in range(3))
        # no key bias: its gradient is zero up to rounding (softmax ignores it), which Adam would blow up
        self.k = nn.Linear(WIDTH, WIDTH, bias=False, dtype=DTYPE)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # -1 heads: under tensor parallelism a colwise layer gives this process's share of them
        q, k, v = (f(h).unflatten(-1, (-1, WIDTH // HEADS)).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH, dtype=DTYPE), nn.LayerNorm(WIDTH, dtype=DTYPE)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH, dtype=DTYPE), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH, dtype=DTYPE))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH, dtype=DTYPE), nn.Linear(WIDTH, VOCAB, dtype=DTYPE)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h))


def transformer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH, dtype=DTYPE), Block(), Block(), Head())


def token_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, LENGTH), generator=g), torch.randint(0, VOCAB, (rows, LENGTH), generator=g)


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
