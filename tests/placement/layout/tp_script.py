"""Trains the Megatron MLP block under TensorParallelStrategy; the test compares it with plain PyTorch.

Usage (one process per task, with TF_CONFIG): python tp_script.py OUT_DIR --mesh D,T --optimizer sgd|adam

Writes OUT_DIR/rank{R}.json: the initial and per-step full parameters (state_dict), the reduced
losses, the optimizer's state after a state-dict round trip, a fresh model's steps with gradient
clipping (clips.py: norms and parameters), and the errors of the misuse cases.
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


class MegatronMLP(nn.Module):
    """The book's MLP block: fc1 split by columns, fc2 by rows (one all-reduce per forward)."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class NormedMLP(MegatronMLP):
    """The block and a LayerNorm the plan leaves whole (its parameters replicated on the model axis)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(super().forward(x))


PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def make_data(steps: int = 3, batch: int = 8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 8, generator=g, dtype=torch.float64),
             torch.randn(batch, 8, generator=g, dtype=torch.float64)) for _ in range(steps)]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def per_example_loss(out, y):
    return ((out - y) ** 2).mean(dim=1)


def listed(state):
    return {k: v.tolist() for k, v in state.items()}


def error_of(fn):
    try:
        fn()
    except sg.errors.StratagemError as error:
        return f"{type(error).__name__}: {error}"
    return None


def clipping(strategy, kind: str) -> dict:
    """clips.STEPS on a fresh model: its initial parameters, each step's norm (or error) and parameters."""
    with strategy.scope():
        model = NormedMLP()
        optimizer = make_optimizer(kind, model.parameters())
    out = {"initial": listed(model.state_dict()), "steps": []}

    def step(how, batch):
        x, y = batch
        return clips.train_step(how, lambda scale: (scale * sg.nn.compute_average_loss(
            per_example_loss(model(x), y))).backward(), model, optimizer)
    for how, batch in zip(clips.STEPS, strategy.experimental_distribute_dataset(make_data(len(clips.STEPS)))):
        out["steps"].append({**strategy.run(step, args=(how, batch)), "params": listed(model.state_dict())})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", default="1,2")
    parser.add_argument("--optimizer", default="sgd")
    args = parser.parse_args()
    d, t = (int(v) for v in args.mesh.split(","))
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(int(os.environ.get("SEED_OFFSET", "0")) + sg.cluster.resolve().worker_rank)  # differ: chief's win
    strategy = sg.experimental.TensorParallelStrategy(mesh={"data": d, "model": t}, plan=PLAN)
    with strategy.scope():
        model = MegatronMLP()
        optimizer = make_optimizer(args.optimizer, model.parameters())
    result = {"num_replicas": strategy.num_replicas_in_sync, "model_rank": strategy.model_rank,
              "initial": listed(model.state_dict()), "sharded": type(model.fc1.weight).__name__,
              "local_rows": model.fc1.weight.to_local().shape[0], "history": []}

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(per_example_loss(model(x), y))
        loss.backward()
        optimizer.step()
        return loss.detach()

    for batch in strategy.experimental_distribute_dataset(make_data()):
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        result["history"].append({"loss": loss.item(), "params": listed(model.state_dict())})

    state = optimizer.state_dict()   # full tensors; loading them back keeps each process's shard
    optimizer.load_state_dict(state)
    model.load_state_dict(model.state_dict())
    result["optimizer_state"] = {str(k): listed({n: v for n, v in s.items() if v.dim()})
                                 for k, s in optimizer.state_dict()["state"].items()}
    result["after_round_trip"] = listed(model.state_dict())

    result["clipping"] = clipping(strategy, args.optimizer)

    def make(plan, width=8, hidden=16):
        other = sg.experimental.TensorParallelStrategy(mesh={"data": d, "model": t}, plan=plan)
        with other.scope():
            MegatronMLP(width, hidden)
    result["errors"] = {
        "missing": error_of(lambda: make({"fc3": "colwise"})),
        "style": error_of(lambda: make({"fc1": "diagonal"})),
        "mesh": error_of(lambda: sg.experimental.TensorParallelStrategy(mesh={"data": d + 1, "model": t},
                                                                        plan=PLAN)),
        "indivisible": error_of(lambda: make(PLAN, width=8, hidden=15)) if t > 1 else "skipped",
    }
    rank = sg.cluster.resolve().worker_rank
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
