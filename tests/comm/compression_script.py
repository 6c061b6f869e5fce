"""Trains a small regression under MultiWorkerMirroredStrategy with gradient compression.

Usage (one process per worker, with TF_CONFIG): ``python compression_script.py OUT COMPRESSION STEPS
[STRATEGY [START]]`` (COMPRESSION: none, bf16, fp16, powersgd; STRATEGY: mirrored, the default, "zero1"
for ``sharding="optimizer"``, or "tensor_parallel" for the data axis of a ``{"data": 2, "model":
1}`` mesh; START: ``powersgd_start_step``, or a comma-separated one per worker, to start workers
that disagree). Writes ``OUT/rank{r}.pt``: this worker's gradient of
the first batch alone (under ``no_sync``), the summed gradient of the same batch (and how many
frames of stratagem's were above each ``torch.distributed.all_reduce`` of that sum), the global
loss at every step and the final parameters. Packs are small (512 B: two packs) so that one
leaves while backward runs.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.test_frames import depth  # noqa: E402

GLOBAL_BATCH = 128


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return x, torch.tanh(x @ teacher) + 0.05 * torch.randn(GLOBAL_BATCH, 4, generator=g)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor as a plain tensor (one model rank: its local shard is all of it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    out, compression, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "mirrored"
    start = None
    if len(sys.argv) > 5:   # (this worker's: its index in TF_CONFIG picks it)
        starts = sys.argv[5].split(",")
        start = int(starts[json.loads(os.environ["TF_CONFIG"])["task"]["index"] % len(starts)])
    options = sg.CommunicationOptions(compression=None if compression == "none" else compression,
                                      bytes_per_pack=512, powersgd_start_step=start)
    if kind == "tensor_parallel":
        strategy = sg.experimental.TensorParallelStrategy({"data": 2, "model": 1}, {"0": "colwise", "2": "rowwise"},
                                                          communication_options=options)
    else:
        strategy = sg.MultiWorkerMirroredStrategy(communication_options=options,
                                                  sharding="optimizer" if kind == "zero1" else None)
    rank, workers = strategy.cluster_resolver.worker_rank or 0, strategy.num_replicas_in_sync
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data()
    x, y = x[rank::workers], y[rank::workers]

    def loss():
        per_example = F.mse_loss(model(x), y, reduction="none").mean(dim=1)
        return sg.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

    def gradients(sync: bool):
        optimizer.zero_grad()
        if sync:
            loss().backward()
        else:
            with strategy.no_sync():
                loss().backward()
        return [whole(p.grad).clone() for p in model.parameters()]

    local = strategy.run(gradients, args=(False,))
    depths, all_reduce = [], dist.all_reduce

    def counted(*args, **kwargs):   # stratagem's frames above each all-reduce of the gradient sum
        depths.append(depth(sys._getframe(1)))
        return all_reduce(*args, **kwargs)
    dist.all_reduce = counted
    try:
        summed = strategy.run(gradients, args=(True,))
    finally:
        dist.all_reduce = all_reduce

    def step():
        optimizer.zero_grad()
        value = loss()
        value.backward()
        optimizer.step()
        return value.detach()

    losses = [strategy.reduce("sum", strategy.run(step), axis=None).item() for _ in range(steps)]
    torch.save({"local": local, "summed": summed, "losses": losses, "depths": depths,
                "params": [whole(p.detach()).clone() for p in model.parameters()]}, f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    main()
