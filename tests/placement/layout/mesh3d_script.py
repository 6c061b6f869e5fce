"""A small transformer under PipelineStrategy on a {"data", "pipe", "model"} mesh; the test compares it with
plain PyTorch (float64).

Usage (one process per task, under ``stratagem launch``, which sets TF_CONFIG and STRATAGEM_RESTART)::

    python mesh3d_script.py OUT main          # 8 processes: 2 x 2 x 2
    python mesh3d_script.py OUT restore --saved CKPT   # 2 processes: 1 x 2 x 1, then MultiWorkerMirrored

``main``: first ``sg.Model.fit`` with ``sharding="parameters"`` (a metric, BackupAndRestore every 2 steps);
in the job's first run (STRATAGEM_RESTART=0) rank 5 SIGKILLs itself before the last step of the first
epoch, the launcher restarts the job and the fit resumes from its backup (after the second step).
Then, for each ZeRO stage over the data axis (none, "optimizer", "gradients", "parameters", each
with its schedule) and SGD and Adam: :data:`STEPS` steps with ``clip_grad_norm_`` (every step
clips, the norms alternate 2 and inf), each step's reduced loss and norm, and the final parameters;
the last configuration saves an ``sg.Checkpoint`` (OUT/ckpt), which a 2 x 2 x 2 strategy with
another ZeRO stage and schedule restores and trains on. Then the refused configurations. Writes
OUT/main-rank{R}.json.

``restore``: the checkpoint restored under 1 x 2 x 1 (no plan) and under MultiWorkerMirroredStrategy,
each trained on for :data:`MORE` steps. Writes OUT/restore-rank{R}.json.
"""

import argparse
import json
import math
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.experimental.planning.memory import storage_bytes

VOCAB, WIDTH, TOKENS, CLASSES = 16, 8, 3, 4
#: module names relative to the whole model (children: 0 embedding, 1-4 blocks, 5 head)
PLAN = {"0": "rowwise", "*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise",
        "*.attn.out": "rowwise", "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}
MESH = {"data": 2, "pipe": 2, "model": 2}
#: (sharding over the data axis, schedule): each trained with SGD and with Adam
CONFIGS = ((None, "1f1b"), ("optimizer", "gpipe"), ("gradients", "1f1b"), ("parameters", "interleaved"))
if os.environ.get("MESH3D_CONFIGS"):   # (debugging: a subset, e.g. "None:1f1b")
    CONFIGS = tuple((None if s == "None" else s, c) for s, c in
                    (item.split(":") for item in os.environ["MESH3D_CONFIGS"].split(",")))
#: 9: 5 and 4 rows on the two data groups (micro-batches of 3 and 2 rows, padded to 3 under FSDP);
#: 6: 3 rows each, which 2 micro-batches do not divide
BATCHES = (8, 9, 6)
STEPS = len(BATCHES)
MAX_NORMS = (0.05, 0.02, 0.03)   # every step clips; 2-norm, inf-norm, 2-norm
MORE = 2   # steps after a restore


class Attention(nn.Module):
    """Self-attention over the tokens; under tensor parallelism each model rank holds its heads."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.q, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)   # (a bias of k moves no softmax: no gradient)
        self.head = WIDTH // heads

    def forward(self, h):
        q, k, v = (f(h).unflatten(-1, (-1, self.head)).transpose(1, 2) for f in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head), dim=-1)
        return self.out((weights @ v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Head(nn.Module):
    """Class logits from the mean over the tokens (the plan leaves it whole: replicated on the model axis)."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, h):
        return self.proj(self.norm(h)).mean(dim=1)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)   # the test builds the same plain model
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), Block(), Block(), Block(), Block(), Head())


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def make_data(batches=BATCHES, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (b, TOKENS), generator=g), torch.randint(0, CLASSES, (b,), generator=g))
            for b in batches]


def loss_fn(output, target):
    return F.cross_entropy(output, target)


def listed(state):
    return {k: v.tolist() for k, v in state.items()}


def error_of(fn):
    try:
        fn()
    except sg.errors.StratagemError as error:
        return f"{type(error).__name__}: {error}"
    return None


def train(sharding, schedule, kind, *, save=None):
    strategy = sg.experimental.PipelineStrategy(MESH, plan=PLAN, sharding=sharding, schedule=schedule,
                                                num_microbatches=2, loss_fn=loss_fn)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(kind, model.parameters())

    def step(x, y, max_norm, norm_type):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        optimizer.step()
        return loss, norm

    out = {"losses": [], "norms": [], "stages": strategy.stages_of(model), "model_rank": strategy.model_rank}
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(make_data())):
        loss, norm = strategy.run(step, args=(x, y, MAX_NORMS[i], 2.0 if i % 2 == 0 else math.inf))
        out["losses"].append(strategy.reduce("sum", loss, axis=None).item())
        out["norms"].append(norm.item())
    own = [p for p in model.parameters() if not p.is_meta]   # the last step's gradients, kept: their bytes
    out["bytes"] = {"parameters": storage_bytes(own), "gradients": storage_bytes(p.grad for p in own),
                    "tensors": len(own)}
    out["final"] = listed(model.state_dict())   # (a collective: every process)
    if save:
        out["saved"] = str(sg.Checkpoint(model=model, optimizer=optimizer).save(save))
    return out


def restore_and_train(path, strategy, make_step, data):
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer("adam", model.parameters())
    sg.Checkpoint(model=model, optimizer=optimizer).restore(path)
    step = make_step(strategy, model, optimizer)
    losses = [strategy.reduce("sum", strategy.run(step, args=batch), axis=None).item()
              for batch in strategy.experimental_distribute_dataset(data)]
    return {"losses": losses, "final": listed(model.state_dict())}


def pipeline_step(strategy, model, optimizer):
    def step(x, y):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y, loss_fn=loss_fn)
        optimizer.step()
        return loss
    return step


def mirrored_step(strategy, model, optimizer):
    def step(x, y):
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


# ------------------------------------------------------------------ fit

FIT_ROWS, FIT_BATCH = 20, 8


def fit_data():
    (x, y), = make_data((FIT_ROWS,), seed=11)
    return x, y


def compiled(model):
    model.compile(optimizer=torch.optim.Adam(model.module.parameters(), lr=0.01),
                  loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class KillAt(sg.callbacks.Callback):
    """In the job's first run, one process SIGKILLs itself before the last step of the first epoch."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        print(f"restart {os.environ['STRATAGEM_RESTART']} epoch {self.epoch} batch {batch}", flush=True)
        if os.environ["STRATAGEM_RESTART"] == "0" and self.rank == 5 and (self.epoch, batch) == (0, 2):
            os.kill(os.getpid(), signal.SIGKILL)


def fit(out_dir, rank):
    strategy = sg.experimental.PipelineStrategy(MESH, plan=PLAN, sharding="parameters", schedule="1f1b",
                                                num_microbatches=2)
    with strategy.scope():
        model = compiled(sg.Model(make_model()))
    x, y = fit_data()
    history = model.fit(x, y, batch_size=FIT_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[sg.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=2),
                                   KillAt(rank)])
    return {"history": history.history, "final": listed(model.module.state_dict()),
            "evaluate": model.evaluate(x, y, batch_size=FIT_BATCH, verbose=0, return_dict=True)}


# ------------------------------------------------------------------ refusals

class Tokens(nn.Module):
    """Not an nn.Sequential: the tracer would cut it at its first step."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = Head()

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def errors(rank):
    def make(model_fn=make_model, mesh=MESH, **options):
        strategy = sg.experimental.PipelineStrategy(mesh, **{"plan": PLAN, "num_microbatches": 2, **options})
        with strategy.scope():
            model_fn()
    def stepped(sharding, make_optimizer, again):
        strategy = sg.experimental.PipelineStrategy(MESH, plan=PLAN, sharding=sharding, num_microbatches=2,
                                                    schedule="gpipe", loss_fn=loss_fn)
        with strategy.scope():
            model = make_model()
            optimizer = make_optimizer(model.parameters())
        (x, y), = make_data((4,))

        def step(x, y):
            strategy.forward_backward(model, x, y)
            if again:   # clipped, then another forward_backward adds to the reduce-scattered sum
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                strategy.forward_backward(model, x, y)
            optimizer.step()
        (x, y), = strategy.experimental_distribute_dataset([(x, y)])
        strategy.run(step, args=(x, y))
    return {
        "again": error_of(lambda: stepped("gradients", lambda p: torch.optim.Adam(p), True)),
        "not_elementwise": error_of(lambda: stepped("optimizer", lambda p: torch.optim.LBFGS(p), False)),
        "mesh": error_of(lambda: sg.experimental.PipelineStrategy({"data": 2, "pipe": 2, "model": 3}, plan=PLAN)),
        "no_plan": error_of(lambda: sg.experimental.PipelineStrategy(MESH)),
        "absent": error_of(lambda: make(plan={**PLAN, "7.mlp.0": "colwise"})),
        "style": error_of(lambda: make(plan={**PLAN, "5.norm": "colwise"})),
        "stages": error_of(lambda: make(schedule="zero_bubble", num_stages=3)),
        "interleaved": error_of(lambda: make(schedule="interleaved", split_points=["2", "4"])),
        "traced": error_of(lambda: make(Tokens)),
        "different": error_of(lambda: sg.experimental.PipelineStrategy(
            MESH, plan=PLAN, sharding="optimizer" if rank == 3 else None)),
    }


def say(what):
    print(f"{what} ({time.monotonic() - START:.1f} s)", flush=True)


START = time.monotonic()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("phase", choices=["main", "restore"])
    parser.add_argument("--saved", help="restore: the checkpoint's path")
    parser.add_argument("--only", default="fit,train,errors", help="main: the parts to run (for debugging)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    rank = sg.cluster.resolve().worker_rank
    result = {"restart": int(os.environ.get("STRATAGEM_RESTART", "0"))}
    if args.phase == "main":
        if "fit" in args.only:
            result["fit"] = fit(args.out, rank)
            say("fit done")
        result["train"] = {}
        for sharding, schedule in CONFIGS if "train" in args.only else ():
            for kind in ("sgd", "adam"):
                save = os.path.join(args.out, "ckpt") if (sharding, kind) == ("parameters", "adam") else None
                result["train"][f"{sharding}:{kind}"] = train(sharding, schedule, kind, save=save)
                say(f"trained {sharding} {kind}")
        more = make_data((8,) * MORE, seed=9)
        if "parameters:adam" in result["train"]:
            result["restored_3d"] = restore_and_train(
                result["train"]["parameters:adam"]["saved"], sg.experimental.PipelineStrategy(
                    MESH, plan=PLAN, sharding="gradients", schedule="gpipe", num_microbatches=2), pipeline_step, more)
            say("restored")
        if "errors" in args.only:
            result["errors"] = errors(rank)
    else:
        more = make_data((8,) * MORE, seed=9)
        result["pipeline"] = restore_and_train(args.saved, sg.experimental.PipelineStrategy(
            {"data": 1, "pipe": 2, "model": 1}, schedule="1f1b", num_microbatches=2), pipeline_step, more)
        result["mirrored"] = restore_and_train(args.saved, sg.MultiWorkerMirroredStrategy(), mirrored_step, more)
    with open(os.path.join(args.out, f"{args.phase}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    say("done")


if __name__ == "__main__":
    main()
