"""Coordinator of `stratagem launch --workers 1 --ps 2 ps_script.py OUT FROM_CKPT`.

Under ParameterServerStrategy (each variable split in 2 shards over the 2 ps): restores the
checkpoint FROM_CKPT (saved under another strategy), records the restored state, trains one
step on a worker, records the state again, and saves its own checkpoint to OUT/ps-ckpt. Writes
OUT/ps.json.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.checkpoint.common import Net, batches  # noqa: E402


def as_lists(state: dict) -> dict:
    return {str(k): (v.tolist() if isinstance(v, torch.Tensor) else as_lists(v) if isinstance(v, dict) else v)
            for k, v in state.items()}


def main() -> None:
    out, source = Path(sys.argv[1]), sys.argv[2]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(2))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(21)
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
    ckpt.restore(source)
    report = {"sharded": isinstance(model.fc1.weight, sg.ShardedVariable), "step": ckpt.step,
              "restored": {"model": as_lists(model.state_dict()),
                           "optimizer": as_lists(optimizer.state_dict()["state"])}}
    x, y = batches(3)[2]

    def step(x, y):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    coordinator.schedule(step, args=(x, y))
    coordinator.join()
    ckpt.step += 1
    report["trained"] = {"model": as_lists(model.state_dict()), "optimizer": as_lists(optimizer.state_dict()["state"])}
    report["saved"] = ckpt.save(out / "ps-ckpt")
    (out / "ps.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
