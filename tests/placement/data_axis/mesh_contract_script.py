"""Reads ``.grad`` right after ``backward()`` / ``forward_backward()`` under the mesh strategies.

Usage (four processes, with TF_CONFIG): python mesh_contract_script.py OUT_DIR

On a data axis of 2, in float64: TensorParallelStrategy ``{"data": 2, "model": 2}``, then
PipelineStrategy ``{"data": 2, "pipe": 2}`` (1F1B; zero bubble, whose weight gradients torch
accumulates by hand; ZeRO-1 and ZeRO-2 over the data axis) and ``{"data": 2, "pipe": 1, "model": 2}``
(a tensor-parallel plan inside the stage). Each case runs the same steps (:data:`STEPS`) and writes,
per step, the gradients each process holds when the last backward returns (whole tensors: a
DTensor's ``full_tensor``), a NaN check over them, the norm ``clip_grad_norm_`` returns and the
parameters after ``optimizer.step()``. A "local" pass runs under ``strategy.no_sync()`` (the
pipelines but zero bubble: DDP's ``require_backward_grad_sync = False``). OUT_DIR/rank{R}.json holds them; the test compares every
process with plain PyTorch on the whole global batches.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: run as a script, or imported
from tests.placement.layout import pp_script, tp_script  # noqa: E402

#: per step, the batches' backward passes: "sync" sums, "local" runs under no_sync; "clip": clip_grad_norm_
#: after the last (a norm below the gradients' so that it clips)
STEPS = (("sync",), ("sync", "sync"), ("local", "sync"), ("sync", "clip"))
MAX_NORM = 0.05
#: the pipeline cases: (name, mesh, options)
PIPELINES = (
    ("1f1b", {"data": 2, "pipe": 2}, {"schedule": "1f1b"}),
    ("zero_bubble", {"data": 2, "pipe": 2}, {"schedule": "zero_bubble"}),
    ("zero1", {"data": 2, "pipe": 2}, {"schedule": "gpipe", "sharding": "optimizer"}),
    ("zero2", {"data": 2, "pipe": 2}, {"schedule": "gpipe", "sharding": "gradients"}),
    ("plan", {"data": 2, "pipe": 1, "model": 2}, {"schedule": "1f1b", "plan": {"2": "colwise", "4": "rowwise"}}),
)


def batches(width_in: int, width_out: int, steps: int = len(STEPS), rows: int = 8) -> list:
    """Two global batches per step (the step's passes take them in turn)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, width_in, generator=g, dtype=torch.float64),
             torch.randn(rows, width_out, generator=g, dtype=torch.float64)) for _ in range(2 * steps)]


def whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def grads(model) -> dict:
    """name -> the whole gradient this process holds (None: none), for its own (not meta) parameters."""
    return {name: None if p.grad is None else whole(p.grad).tolist()
            for name, p in model.named_parameters() if not p.is_meta}


def nan_check(model) -> bool:
    """A user's NaN check: every gradient held here is finite."""
    return all(bool(torch.isfinite(whole(p.grad)).all()) for p in model.parameters() if p.grad is not None)


def run_steps(strategy, model, optimizer, data, backward, no_sync) -> list:
    out = []
    distributed = list(strategy.experimental_distribute_dataset(data))

    def step(passes, first, second):
        optimizer.zero_grad()
        record = {}
        for kind, batch in zip([p for p in passes if p != "clip"], (first, second)):
            if kind == "local":
                with no_sync():
                    backward(*batch)
                record["local"] = grads(model)   # this data group's own part
            else:
                backward(*batch)
        record["grads"], record["finite"] = grads(model), nan_check(model)
        if "clip" in passes:
            record["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        optimizer.step()
        record["params"] = tp_script.listed(model.state_dict())
        return record

    for s, passes in enumerate(STEPS):
        out.append(strategy.run(step, args=(passes, distributed[2 * s], distributed[2 * s + 1])))
    return out


def tensor_parallel() -> dict:
    strategy = sg.experimental.TensorParallelStrategy(mesh={"data": 2, "model": 2}, plan=tp_script.PLAN)
    with strategy.scope():
        model = tp_script.NormedMLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = tp_script.listed(model.state_dict())

    def backward(x, y):
        sg.nn.compute_average_loss(tp_script.per_example_loss(model(x), y)).backward()
    return {"initial": initial, "steps": run_steps(strategy, model, optimizer, batches(8, 8), backward,
                                                   strategy.no_sync)}


def pipeline(name: str, mesh: dict, options: dict) -> dict:
    strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=pp_script.NUM_MICROBATCHES,
                                                loss_fn=pp_script.loss_fn, **options)
    with strategy.scope():
        model = pp_script.make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = tp_script.listed(model.state_dict())

    def backward(x, y):
        strategy.forward_backward(model, x, y)

    class Unsynced:   # DistributedDataParallel's attribute, nanoGPT's accumulation idiom
        def __enter__(self):
            model.require_backward_grad_sync = False

        def __exit__(self, *exc):
            model.require_backward_grad_sync = True
    return {"initial": initial, "stages": strategy.stages_of(model),
            "steps": run_steps(strategy, model, optimizer, batches(6, 3), backward,
                               strategy.no_sync if name == "zero_bubble" else Unsynced)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    rank = sg.cluster.resolve().worker_rank
    torch.manual_seed(rank)   # every process builds other values: the chief's win
    result = {"tp": tensor_parallel()}
    for name, mesh, options in PIPELINES:
        result[name] = pipeline(name, mesh, options)
        print(f"{name} done", flush=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)


if __name__ == "__main__":
    main()
