"""Trains tiny_gpt.TinyGPT under MultiWorkerMirroredStrategy once per mode, one after another with
the same strategy; the test compares each history with plain PyTorch.

Modes: ``reentrant`` / ``nonreentrant`` (every block checkpointed), ``shared`` (one block applied
twice, checkpointed reentrantly: two nested backward passes reach its parameters), ``compile``
(``torch.compile(model)``), ``twice`` (no recomputation; a second backward, of a loss that reaches
only some parameters, accumulates before the step); a mode ending in ``+clip`` clips the gradients to norm CLIP between
backward and step (``clip_grad_norm_``, whose norm is recorded). Writes OUT_DIR/rankR.json: for each mode the chief's initial values
(every worker starts from a different seed: the chief's must win), the loss and parameters after
every step, and for ``compile`` the number of graphs dynamo compiled after each step.

Usage (one process per task, each with TF_CONFIG or torchrun variables):
    python recompute_script.py OUT_DIR --modes reentrant,compile+clip [--replicas-per-worker K]
                               [--batches 8,8,6]
"""

import argparse
import json
import os
import sys

import torch
from torch._dynamo.utils import counters

import stratagem as sg
import tiny_gpt

CLIP = 2.0   # the gradient norm is about 5: clipping always acts


def as_lists(state: dict) -> dict:
    return {k: v.tolist() for k, v in state.items()}


def train(strategy: sg.Strategy, mode: str, batch_sizes: list[int], rank: int) -> dict:
    kind, _, clip = mode.partition("+")
    options = {"reentrant": {"recompute": "reentrant"}, "nonreentrant": {"recompute": "nonreentrant"},
               "shared": {"recompute": "reentrant", "shared_blocks": True}, "compile": {}, "twice": {}}[kind]
    with strategy.scope():
        model = tiny_gpt.make_model(100 + rank, **options)
        optimizer = tiny_gpt.make_optimizer(model)
    initial = as_lists(model.state_dict())
    forward = torch.compile(model) if kind == "compile" else model

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(tiny_gpt.per_example_loss(forward(x), y))
        optimizer.zero_grad()
        loss.backward()
        if kind == "twice":
            sg.nn.compute_average_loss(tiny_gpt.per_example_loss(tiny_gpt.bigram_logits(model, x), y)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) if clip else torch.zeros(())
        optimizer.step()
        return loss.detach(), norm

    history, graphs = [], []
    for batch in strategy.experimental_distribute_dataset(tiny_gpt.make_batches(batch_sizes)):
        losses, norms = strategy.run(step, args=(batch,))
        loss = strategy.reduce("sum", losses, axis=None)
        history.append({"loss": loss.item(), "params": as_lists(model.state_dict()),
                        "norms": [n.item() for n in strategy.experimental_local_results(norms)] if clip else None})
        graphs.append(counters["stats"]["unique_graphs"])
    return {"initial": initial, "history": history, "graphs": graphs}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--modes", required=True)
    parser.add_argument("--replicas-per-worker", type=int, default=1)
    parser.add_argument("--batches", default="8,8,6")
    args = parser.parse_args(argv)

    strategy = sg.MultiWorkerMirroredStrategy(
        devices=[f"cpu:{i}" for i in range(args.replicas_per_worker)],
        # the default timeout (180 s): the first compiled step's compilation, on a busy 2-core
        # machine, may keep one worker from the collective much longer than a step takes
        communication_options=sg.CommunicationOptions())
    rank = strategy.cluster_resolver.worker_rank
    batch_sizes = [int(b) for b in args.batches.split(",")]
    results = {mode: train(strategy, mode, batch_sizes, rank) for mode in args.modes.split(",")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"num_replicas": strategy.num_replicas_in_sync, "modes": results}, f)
    print(f"rank {rank} done: {', '.join(results)}")


if __name__ == "__main__":
    sys.exit(main())
