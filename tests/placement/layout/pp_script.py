"""Trains an MLP under PipelineStrategy with several schedules; the test compares each with plain PyTorch.

Usage (one process per task, with TF_CONFIG):
python pp_script.py OUT_DIR --mesh D,P --cases NAME,... [--fit] [--clip NAME,...]

Each case is ``schedule:optimizer`` (e.g. ``gpipe:sgd``, ``zero_bubble:adam``) or ``split:...`` for the
split-points variant. Writes OUT_DIR/rank{R}.json: per case the initial parameters, the reduced loss
and the whole model's state_dict after every step, the stages held and the optimizer's parameter
count; then the errors of the misuse cases. ``--fit``: also sg.Model.fit (sample weights, a metric,
validation, a BackupAndRestore backup in the middle of an epoch, the job stopped there and resumed, a
ModelCheckpoint), evaluate and predict, under the strategy (see :func:`fit`). ``--clip``: for each case
(``schedule:optimizer``), a fresh model's steps with gradient clipping (clips.py: norms and parameters).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: run as a script, or imported
from tests._support import clips  # noqa: E402
from tests.placement.layout.tp_script import error_of, listed  # noqa: E402

#: batch sizes of the steps: divisible by 4, not divisible, then a smaller last batch
BATCHES = (8, 10, 8, 5)
NUM_MICROBATCHES = 4


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class Tokens(nn.Module):
    """Transformer-like, not an nn.Sequential: each row's 6 features are 3 tokens of 2."""

    def __init__(self, blocks: int = 4, width: int = 8, outputs: int = 1):
        super().__init__()
        self.embed = nn.Linear(2, width)
        self.position = nn.Parameter(torch.randn(3, width) / 4)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, outputs)
        self.register_buffer("gain", torch.full((width,), 0.5))

    def forward(self, x):
        h = self.embed(x.unflatten(1, (3, 2))) + self.position
        for block in self.blocks:
            h = block(h) * self.gain + h * 0.5
        return self.head(h).squeeze(-1)


def model_for(case: str) -> nn.Module:
    return Tokens() if case.startswith("traced") else make_model()


def make_data(batches=BATCHES):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(b, 6, generator=g, dtype=torch.float64),
             torch.randn(b, 3, generator=g, dtype=torch.float64)) for b in batches]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def train(case: str, mesh: dict) -> dict:
    schedule, kind = case.split(":")
    options = {}
    if schedule == "split":   # uneven stages at named children, loop placement (pipe size 2)
        schedule, options = "interleaved", {"split_points": ["3", "4", "7"]}
    if schedule == "traced-gpipe":   # a model with its own forward, cut by the tracer at named modules
        schedule, options = "gpipe", {"split_points": ["blocks.3"]}
    schedule = schedule.replace("traced-", "")   # otherwise even over model.blocks
    strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, schedule=schedule,
                                                loss_fn=loss_fn, **options)
    with strategy.scope():
        model = model_for(case)
        optimizer = make_optimizer(kind, model.parameters())
    out = {"initial": listed(model.state_dict()), "stages": strategy.stages_of(model),
           "num_replicas": strategy.num_replicas_in_sync, "history": []}

    def step(x, y):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y)
        optimizer.step()
        return loss

    for x, y in strategy.experimental_distribute_dataset(make_data()):
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        out["history"].append({"loss": loss.item(), "params": listed(model.state_dict())})
    out["held_params"] = sum(p.numel() for p in model.parameters() if not p.is_meta)   # (traced: at step 1)
    out["predict"] = strategy.predict(model, make_data((7,))[0][0]).tolist()   # every process: the output
    # the optimizer's state (its memory) exists for this process's parameters only
    out["optimizer_params"] = sum(p.numel() for p in optimizer.state if not p.is_meta)
    out["optimizer_meta_state"] = sum(1 for p in optimizer.state if p.is_meta)
    model.load_state_dict(model.state_dict())   # whole model in; each process keeps its stages
    optimizer.load_state_dict(optimizer.state_dict())
    out["after_round_trip"] = listed(model.state_dict())
    out["optimizer_state"] = optimizer_state(optimizer)
    out["direct_call"] = error_of(lambda: model(torch.randn(2, 6)))
    # one logical checkpoint, restored into another layout (other stages on other processes)
    directory = os.path.join(args.out, f"ckpt-{case.replace(':', '-')}")
    path = sg.Checkpoint(model=model, optimizer=optimizer).save(directory)
    other = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn,
                                             schedule="gpipe" if schedule == "zero_bubble" else "zero_bubble")
    with other.scope():
        restored = model_for(case)
        restored_optimizer = make_optimizer(kind, restored.parameters())
    sg.Checkpoint(model=restored, optimizer=restored_optimizer).restore(path)
    out["restored"] = listed(restored.state_dict())
    out["restored_optimizer"] = optimizer_state(restored_optimizer)
    out["restored_stages"] = other.stages_of(restored)
    return out


def clipping(case: str, mesh: dict) -> dict:
    """clips.STEPS on a fresh model: its initial parameters, each step's norm (or error) and parameters."""
    schedule, kind = case.split(":")
    strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, schedule=schedule)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(kind, model.parameters())
    out = {"initial": listed(model.state_dict()), "steps": []}

    def step(how, x, y):
        return clips.train_step(how, lambda scale: strategy.forward_backward(
            model, x, y, loss_fn=lambda output, target: scale * loss_fn(output, target)), model, optimizer)
    for how, (x, y) in zip(clips.STEPS, strategy.experimental_distribute_dataset(clip_data())):
        out["steps"].append({**strategy.run(step, args=(how, x, y)), "params": listed(model.state_dict())})
    return out


def clip_data():
    return make_data((8,) * len(clips.STEPS))


def optimizer_state(optimizer):
    return {str(k): {n: v.tolist() for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()}


#: sg.Model.fit's data: 34 rows in global batches of 10 (the last one 4), with sample weights
FIT_ROWS, FIT_BATCH = 34, 10


def fit_data():
    g = torch.Generator().manual_seed(11)
    return (torch.randn(FIT_ROWS, 6, generator=g, dtype=torch.float64),
            torch.randn(FIT_ROWS, 3, generator=g, dtype=torch.float64),
            torch.rand(FIT_ROWS, generator=g, dtype=torch.float64))


def compiled(model, metrics):
    model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9), loss="mse",
                  metrics=metrics)
    return model


class StopAt(sg.callbacks.Callback):
    """Stops training after the third step of the first epoch (reads the step's logs: a metric read each step)."""

    def on_train_batch_end(self, batch, logs=None):
        self.seen = dict(logs)
        if batch == 2:
            self.model.stop_training = True


def fit(mesh: dict, directory: str) -> dict:
    """A job stopped after 3 steps (backups every 2, the loss tracker only), a new job resumed from the
    backup to the end of 2 epochs (a metric, validation, ModelCheckpoint), then evaluate and predict."""
    x, y, w = fit_data()

    def build(metrics):
        strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, schedule="1f1b")
        with strategy.scope():
            return compiled(sg.Model(make_model()), metrics)
    model = build(None)
    out = {"initial": listed(model.module.state_dict())}
    backup = os.path.join(directory, "backup")
    stop = StopAt()
    model.fit(x, y, batch_size=FIT_BATCH, epochs=2, shuffle=False, verbose=2, sample_weight=w,
              callbacks=[sg.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False), stop])
    out["stopped_logs"] = stop.seen
    model = build(["mae"])   # a fresh job
    saver = sg.callbacks.ModelCheckpoint(os.path.join(directory, "saved-{epoch}"))
    history = model.fit(x, y, batch_size=FIT_BATCH, epochs=2, shuffle=False, verbose=2, sample_weight=w,
                        validation_data=(x[:12], y[:12]), callbacks=[sg.callbacks.BackupAndRestore(backup), saver])
    out["history"] = history.history
    out["final"] = listed(model.module.state_dict())
    out["saved"] = str(saver.last_saved)
    out["evaluate"] = model.evaluate(x, y, batch_size=FIT_BATCH, verbose=0, return_dict=True, sample_weight=w)
    out["predict"] = model.predict(x, batch_size=FIT_BATCH).tolist()
    return out


class Branches(Tokens):
    """A Python branch on a tensor's value: torch.export cannot trace it."""

    def forward(self, x):
        return super().forward(x) if x.sum() > 0 else -super().forward(x)


class Tied(Tokens):
    """The embedding's weight also in the head (stage 0 and the last stage)."""

    def __init__(self):
        super().__init__(width=2, outputs=2)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return super().forward(x).sum(-1)


def errors(mesh: dict, world: int) -> dict:
    def make(model_fn=make_model, **options):
        strategy = sg.experimental.PipelineStrategy(mesh, **{"num_microbatches": 4, **options})
        with strategy.scope():
            model_fn()
    def uneven():
        strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=4, loss_fn=loss_fn)
        with strategy.scope():
            model = make_model()
        rows = 6 + sg.cluster.resolve().worker_rank % mesh["pipe"]   # differ inside each pipeline
        strategy.forward_backward(model, torch.randn(rows, 6), torch.randn(rows, 3))
    def traced_step(model_fn):   # every process raises (none waits for the others)
        strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=4, loss_fn=loss_fn)
        with strategy.scope():
            model = model_fn()
        strategy.forward_backward(model, torch.randn(8, 6), torch.randn(8, 3))
    return {
        "different_batches": error_of(uneven),
        "missing": error_of(lambda: make(split_points=["fc9"])),
        "too_many_stages": error_of(lambda: make(num_stages=9)),
        "traced_missing": error_of(lambda: make(Tokens, split_points=["blocks.9"])),
        "traced_too_many": error_of(lambda: make(lambda: Tokens(blocks=1))),
        "data_dependent": error_of(lambda: traced_step(Branches)),
        "tied": error_of(lambda: traced_step(Tied)),
        "mesh": error_of(lambda: sg.experimental.PipelineStrategy({"data": 3, "pipe": world})),
        "schedule": error_of(lambda: sg.experimental.PipelineStrategy(mesh, schedule="pipedream")),
        "interleaved_stages": error_of(lambda: make(schedule="interleaved", num_stages=mesh["pipe"] + 1)),
        "zero_bubble_stages": error_of(lambda: make(schedule="zero_bubble", num_stages=mesh["pipe"])),
        "different": error_of(lambda: sg.experimental.PipelineStrategy(
            mesh, num_microbatches=4 + sg.cluster.resolve().worker_rank)),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", default="1,2")
    parser.add_argument("--cases", default="gpipe:sgd")
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--clip", default="")
    args = parser.parse_args()
    d, p = (int(v) for v in args.mesh.split(","))
    torch.set_default_dtype(torch.float64)
    rank = sg.cluster.resolve().worker_rank
    torch.manual_seed(rank)   # processes differ: the chief's initial values must win
    result = {case: train(case, {"data": d, "pipe": p}) for case in args.cases.split(",")}
    if args.fit:
        result["fit"] = fit({"data": d, "pipe": p}, os.path.join(args.out, "fit"))
    result["clipping"] = {case: clipping(case, {"data": d, "pipe": p}) for case in args.clip.split(",") if case}
    result["errors"] = errors({"data": d, "pipe": p}, d * p)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)
