"""nanoGPT's training loop in miniature, under a strategy or as plain PyTorch.

What real loops do between ``backward()`` and ``step()`` (nanoGPT's ``train.py``): a tiny GPT
with tied embeddings, AdamW with weight-decay groups, the learning rate written into
``param_groups`` every step, micro-batches accumulated (``loss / k``), the exchange skipped on
all but the last (``no_sync`` or DDP's ``require_backward_grad_sync``), ``clip_grad_norm_``
that really clips, ``zero_grad(set_to_none=True)``. ``train(strategy=None)`` is plain
single-device PyTorch on the whole global batch: the oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import stratagem as sg
from stratagem.data.sharding import split_sizes

VOCAB, BLOCK, EMBED = 32, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBED), nn.Embedding(BLOCK, EMBED)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)
        self.head.weight = self.wte.weight   # weight tying, as nanoGPT
        self.recompute = recompute

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(self.ln_f(x))


def build(recompute: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(recompute).double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))


def learning_rate(step: int) -> float:
    return 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / 6)))


def batches(steps: int, micro: int, rows: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (steps, micro, rows, BLOCK + 1), generator=g)
    return [[(data[s, m, :, :-1], data[s, m, :, 1:]) for m in range(micro)] for s in range(steps)]


def per_sequence_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(y.shape).mean(1)


def train(strategy=None, *, steps: int = 4, micro: int = 2, rows: int = 6, clip: float = 0.5,
          skip: str = "no_sync", recompute: bool = False, outside_run: str | None = None) -> dict:
    """The loop; returns every step's gradient norm (as clip returned it), the gradients seen
    after the last backward of the step, and the parameters after the step.

    ``skip``: how micro-steps before the last avoid the exchange: ``"no_sync"``
    (``strategy.no_sync()``), ``"attribute"`` (``model.require_backward_grad_sync``), or
    ``"none"`` (every backward exchanges). ``outside_run``: DistributedDataParallel's shape, for a
    strategy with one replica per process: no ``strategy.run``, the step called in the scope on
    this process's rows, the loss scaled by ``"mean_over_replicas"`` (of a per-replica mean; the
    scope entered by ``sg.experimental_set_strategy``, as a ported DDP script does) or
    ``"compute_average_loss"`` (each step in ``with strategy.scope():``).
    """
    set_strategy = outside_run == "mean_over_replicas"
    if strategy is None:
        model = build(recompute)
        optimizer = make_optimizer(model)
    elif set_strategy:
        sg.experimental_set_strategy(strategy)
        model = build(recompute)
        optimizer = make_optimizer(model)
    else:
        with strategy.scope():
            model = build(recompute)
            optimizer = make_optimizer(model)
    history = {"norms": [], "grads": [], "params": []}

    def step(number: int, micro_batches):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(number)
        for k, (x, y) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if strategy is None:
                loss = per_sequence_loss(model, x, y).mean() / len(micro_batches)
            elif outside_run == "mean_over_replicas":
                loss = sg.nn.mean_over_replicas(per_sequence_loss(model, x, y).mean()) / len(micro_batches)
            else:
                loss = sg.nn.compute_average_loss(per_sequence_loss(model, x, y)) / len(micro_batches)
            if skip == "attribute":
                model.require_backward_grad_sync = last
                loss.backward()
            elif skip == "no_sync" and strategy is not None and not last:
                with strategy.no_sync():
                    loss.backward()
            else:
                loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, grads

    for number, micro_batches in enumerate(batches(steps, micro, rows)):
        if strategy is None:
            norm, grads = step(number, micro_batches)
            norms = [norm]
            all_grads = [grads]
        elif outside_run:
            mine = [_rows(strategy.outside_replica_context(), x, y) for x, y in micro_batches]
            if set_strategy:   # DDP's shape: no run, no `with`
                norm, grads = step(number, mine)
            else:
                with strategy.scope():
                    norm, grads = step(number, mine)
            norms, all_grads = [norm], [grads]
        else:
            mine = strategy.experimental_distribute_values_from_function(
                lambda ctx, micro_batches=micro_batches: [_rows(ctx, x, y) for x, y in micro_batches])
            result = strategy.run(step, args=(number, mine))
            norms = _components(result[0])
            per_parameter = [_components(g) for g in result[1]]
            all_grads = [list(replica) for replica in zip(*per_parameter)]
        history["norms"].append([float(n) for n in norms])
        history["grads"].append(all_grads)
        history["params"].append([p.detach().clone() for p in model.parameters()])
    if set_strategy:
        sg.experimental_set_strategy(None)
    return history


def _rows(ctx, x, y):
    """Replica ``ctx``'s rows of one global micro-batch (earlier replicas take one more)."""
    sizes = split_sizes(x.shape[0], ctx.num_replicas_in_sync)
    start = sum(sizes[:ctx.replica_id_in_sync_group])
    end = start + sizes[ctx.replica_id_in_sync_group]
    return x[start:end], y[start:end]


def _components(value):
    return list(value.values) if isinstance(value, sg.PerReplica) else [value]
