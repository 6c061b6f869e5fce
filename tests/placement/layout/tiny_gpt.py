"""A small GPT (float64) and the plain-PyTorch training that the recompute and compile tests
compare against: token and position embeddings, two pre-norm blocks (causal
``F.scaled_dot_product_attention`` and an MLP), a final layer norm and a head tied to the
token embedding; AdamW with nanoGPT's two parameter groups.

``recompute="reentrant"`` / ``"nonreentrant"`` wraps each block in ``torch.utils.checkpoint``
(``use_reentrant=True`` / ``False``); ``shared_blocks=True`` applies one block twice, so that
under reentrant checkpointing its parameters receive gradients from two nested backward passes.
Imported by ``tests/placement/layout/test_recompute_compile.py`` and by ``recompute_script.py`` (as ``tiny_gpt``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, LENGTH, WIDTH, HEADS = 13, 8, 16, 2
DTYPE = torch.float64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH, dtype=DTYPE)
        # no bias: a key bias gets a gradient that is zero up to rounding (softmax ignores it), and
        # Adam would blow that noise up into updates of size lr
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False, dtype=DTYPE)
        self.proj = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)
        self.ln2 = nn.LayerNorm(WIDTH, dtype=DTYPE)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH, dtype=DTYPE)
        self.out = nn.Linear(4 * WIDTH, WIDTH, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(WIDTH, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, *, recompute: str | None = None, shared_blocks: bool = False) -> None:
        super().__init__()
        assert recompute in (None, "reentrant", "nonreentrant"), recompute
        self.recompute = recompute
        self.tok = nn.Embedding(VOCAB, WIDTH, dtype=DTYPE)
        self.pos = nn.Embedding(LENGTH, WIDTH, dtype=DTYPE)
        first = Block()
        self.blocks = nn.ModuleList([first, first if shared_blocks else Block()])
        self.ln = nn.LayerNorm(WIDTH, dtype=DTYPE)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=DTYPE)
        self.head.weight = self.tok.weight   # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.recompute is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.recompute == "reentrant")
        return self.head(self.ln(x))


def make_model(seed: int = 0, **options) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**options)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only (nanoGPT's groups)."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=0.01, betas=(0.9, 0.95))


def make_batches(batch_sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (b, LENGTH), generator=g), torch.randint(0, VOCAB, (b, LENGTH), generator=g))
            for b in batch_sizes]


def per_example_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token cross-entropy: one entry per example."""
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return losses.view(targets.shape).mean(dim=1)


def bigram_logits(model: TinyGPT, idx: torch.Tensor) -> torch.Tensor:
    """The model without position embedding and blocks: a second loss that reaches only some parameters."""
    return model.head(model.ln(model.tok(idx)))


def plain_history(model: nn.Module, batches, *, clip: float | None = None, twice: bool = False) -> list[dict]:
    """Plain single-device PyTorch on each whole batch: loss and parameters after every step
    (``twice``: a second backward, of the bigram loss, accumulates before the step)."""
    optimizer = make_optimizer(model)
    history = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = per_example_loss(model(x), y).mean()
        loss.backward()
        if twice:
            per_example_loss(bigram_logits(model, x), y).mean().backward()
        norm = None if clip is None else torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        optimizer.step()
        history.append({**snapshot(model, loss), "norm": norm})
    return history


def snapshot(model: nn.Module, loss: torch.Tensor) -> dict:
    return {"loss": loss.item(), "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
