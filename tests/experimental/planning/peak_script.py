"""Some layouts of the tests' transformer, each predicted and measured as the plan's trial does it:
``python peak_script.py OUT WORLD LAYOUT...`` in each of the ``WORLD`` processes of a cluster
(``LAYOUT`` as ``Layout.describe`` names it). Rank 0 writes each layout's predicted memory and its
measured peak (the fullest process's) to ``OUT`` (JSON)."""

import json
import sys
import time

import torch
import torch.distributed as dist

import models
from stratagem.experimental.planning import trial
from stratagem.experimental.planning.cost import Network
from stratagem.experimental.planning.layouts import Layout

out, world, wanted = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
spec = {"world": world, "model_fn": models.transformer, "sample": models.token_batch(8), "loss_fn": models.token_loss,
        "optimizer": "adam", "tensor_plan": models.TRANSFORMER_PLAN, "global_batch": 8, "memory_limit": None,
        "num_measured": None, "time_budget_s": 600, "steps": 1}
base = Layout(world, 1, 1).strategy(loss_fn=models.token_loss)   # (starts the process group)
device = torch.device("cpu")
chosen: list = [None]
if dist.get_rank() == 0:   # the trial's own prediction (the network's numbers only move the seconds)
    result: dict = {}
    trial._choose(spec, Network(alpha=1e-4, beta=1e9), device, [None] * world, result)
    rows = {row["layout"].describe(): row for row in result["rows"] if "prediction" in row}
    chosen[0] = [(rows[name]["layout"], rows[name]["prediction"].memory) for name in wanted]
dist.broadcast_object_list(chosen, src=0)
del base
measured = trial._measure_all(spec, [layout for layout, _ in chosen[0]], device, world, time.monotonic())
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({layout.describe(): {"predicted": memory, "peak": measured[layout]["peak"],
                                       "parts": [e["parts"] for e in measured[layout]["per_process"]]}
                   for layout, memory in chosen[0]}, f)
print("measured", flush=True)
