"""Trains an MLP under PipelineStrategy with several schedules; the test compares each with plain PyTorch.

Usage (one process per task, with TF_CONFIG): python pp_script.py OUT_DIR --mesh D,P --cases NAME,...

Each case is ``schedule:optimizer`` (e.g. ``gpipe:sgd``, ``zero_bubble:adam``) or ``split:...`` for the
split-points variant. Writes OUT_DIR/rank{R}.json: per case the initial parameters, the reduced loss
and the whole model's state_dict after every step, the stages held and the optimizer's parameter
count; then the errors of the misuse cases.
"""

import argparse
import json
import os

import torch
from torch import nn

import stratagem as sg

#: batch sizes of the steps: divisible by 4, not divisible, then a smaller last batch
BATCHES = (8, 10, 8, 5)
NUM_MICROBATCHES = 4


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


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


def listed(state):
    return {k: v.tolist() for k, v in state.items()}


def error_of(fn):
    try:
        fn()
    except sg.errors.StratagemError as error:
        return f"{type(error).__name__}: {error}"
    return None


def train(case: str, mesh: dict) -> dict:
    schedule, kind = case.split(":")
    options = {}
    if schedule == "split":   # uneven stages at named children, loop placement (pipe size 2)
        schedule, options = "interleaved", {"split_points": ["3", "4", "7"]}
    strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, schedule=schedule,
                                                loss_fn=loss_fn, **options)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(kind, model.parameters())
    out = {"initial": listed(model.state_dict()), "stages": strategy.stages_of(model),
           "optimizer_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
           "held_params": sum(p.numel() for p in model.parameters() if not p.is_meta),
           "num_replicas": strategy.num_replicas_in_sync, "history": []}

    def step(x, y):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y)
        optimizer.step()
        return loss

    for x, y in strategy.experimental_distribute_dataset(make_data()):
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        out["history"].append({"loss": loss.item(), "params": listed(model.state_dict())})
    model.load_state_dict(model.state_dict())   # whole model in; each process keeps its stages
    out["after_round_trip"] = listed(model.state_dict())
    out["checkpoint"] = error_of(lambda: sg.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(args.out, "ckpt")))
    return out


def errors(mesh: dict, world: int) -> dict:
    def make(model_fn=make_model, **options):
        strategy = sg.experimental.PipelineStrategy(mesh, **{"num_microbatches": 4, **options})
        with strategy.scope():
            model_fn()
    return {
        "missing": error_of(lambda: make(split_points=["fc9"])),
        "too_many_stages": error_of(lambda: make(num_stages=9)),
        "not_sequential": error_of(lambda: make(lambda: nn.Transformer(8, 2, 1, 1, 16))),
        "mesh": error_of(lambda: sg.experimental.PipelineStrategy({"data": 3, "pipe": world})),
        "schedule": error_of(lambda: sg.experimental.PipelineStrategy(mesh, schedule="pipedream")),
        "interleaved_stages": error_of(lambda: make(schedule="interleaved", num_stages=mesh["pipe"] * 2 + 1)),
        "zero_bubble_stages": error_of(lambda: make(schedule="zero_bubble", num_stages=mesh["pipe"])),
        "different": error_of(lambda: sg.experimental.PipelineStrategy(
            mesh, num_microbatches=4 + sg.cluster.resolve().worker_rank)),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", default="1,2")
    parser.add_argument("--cases", default="gpipe:sgd")
    args = parser.parse_args()
    d, p = (int(v) for v in args.mesh.split(","))
    torch.set_default_dtype(torch.float64)
    rank = sg.cluster.resolve().worker_rank
    torch.manual_seed(rank)   # processes differ: the chief's initial values must win
    result = {case: train(case, {"data": d, "pipe": p}) for case in args.cases.split(",")}
    result["errors"] = errors({"data": d, "pipe": p}, d * p)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)
