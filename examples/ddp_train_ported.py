"""nanoGPT's training script in miniature: a DistributedDataParallel script and its stratagem port.

examples/ddp_train.py is written as nanoGPT's ``train.py`` is: torchrun's variables decide
whether it is distributed, the model is wrapped in DistributedDataParallel, micro-batches are
accumulated with ``require_backward_grad_sync``, the loss goes through a GradScaler and autocast,
gradients are clipped, AdamW has weight-decay groups and a cosine learning rate, and
``--compile`` compiles the model. examples/ddp_train_ported.py is the same file ported to
stratagem with six changed lines, none re-indented; docs/from_ddp.md walks through the diff.
Both train a tiny GPT on a synthetic token stream, on CPU, and print the same losses and
gradient norms.

One process:
    python examples/ddp_train.py
Two processes on this host, DistributedDataParallel:
    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py
The port, under torchrun or stratagem's launcher:
    torchrun --standalone --nproc-per-node 2 examples/ddp_train_ported.py
    stratagem launch --workers 2 examples/ddp_train_ported.py
Options: --dtype float64 (the default: exact), float32, bfloat16 or float16 (autocast; float16
enables the GradScaler), --compile, --max-iters N, --out-dir DIR (rank 0 saves ckpt.pt there).
"""

import argparse
import inspect
import math
import os
from contextlib import nullcontext

import stratagem as sg
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"])
parser.add_argument("--compile", action="store_true", help="torch.compile the model")
parser.add_argument("--max-iters", type=int, default=6)
parser.add_argument("--out-dir", default="", help="where rank 0 saves ckpt.pt at the end (default: no checkpoint)")
args = parser.parse_args()

# the configuration: nanoGPT's names, a model small enough for a CPU
batch_size, block_size = 4, 16
n_layer, n_head, n_embd, vocab_size = 2, 2, 32, 64
gradient_accumulation_steps = 4   # over every process: each does 4 / WORLD_SIZE
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 2, args.max_iters
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 0.25
eval_iters = 2
device, backend = "cpu", "gloo"

# torchrun's variables say whether this is a distributed run
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    strategy = sg.MultiWorkerMirroredStrategy(); sg.experimental_set_strategy(strategy)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0   # this process logs and saves the checkpoint
    seed_offset = ddp_rank           # each process gets a different seed, hence different batches
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
torch.manual_seed(1337 + seed_offset)
param_dtype = torch.float64 if args.dtype == "float64" else torch.float32
autocast = args.dtype in ("bfloat16", "float16")
ctx = torch.autocast(device_type=device, dtype=getattr(torch, args.dtype)) if autocast else nullcontext()

# the data: a synthetic token stream (each token is the previous one plus -2 to 2), split 9:1
steps = torch.randint(-2, 3, (20_000,), generator=torch.Generator().manual_seed(0))
tokens = torch.cumsum(steps, 0) % vocab_size
train_data, val_data = tokens[:18_000], tokens[18_000:]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=False), nn.LayerNorm(n_embd, bias=False)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # every matrix and embedding decays; norms and biases do not
        params = [p for p in self.parameters() if p.requires_grad]
        optim_groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, fused=use_fused)


# each process draws other initial values (its seed differs); training starts from rank 0's
model = GPT().to(device=device, dtype=param_dtype)
scaler = torch.amp.GradScaler(device, enabled=(args.dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device)
if args.compile:
    model = torch.compile(model)
raw_model = model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters, dtype=torch.float64)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    # linear warmup, then cosine decay down to min_lr
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


X, Y = get_batch("train")
iter_num = 0
while iter_num < args.max_iters:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # DDP exchanges gradients at the last micro-step only
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps   # the micro-steps' gradients add up
        X, Y = get_batch("train")   # the next batch, while backward runs (on a GPU)
        scaler.scale(sg.nn.mean_over_replicas(loss)).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.12f}, grad norm {norm.item():.12f}, lr {lr:.3e}")
    iter_num += 1

losses = estimate_loss()
if master_process:
    print(f"step {iter_num}: train loss {losses['train']:.12f}, val loss {losses['val']:.12f}")
    if args.out_dir:
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                      "scaler": scaler.state_dict(), "iter_num": iter_num}
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
if ddp:
    sg.experimental_set_strategy(None)
