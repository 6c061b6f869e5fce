"""Coordinator of `stratagem launch --workers 1 --ps N ps_script.py OUT FROM_CKPT NAME`.

Under ParameterServerStrategy (each variable split in N shards over the N ps): restores the
checkpoint FROM_CKPT (saved under another strategy or layout), records the restored state,
trains one step on a worker, records the state again, and saves its own checkpoint to
OUT/NAME (every ps writes its shards). Writes OUT/NAME.json.
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
    out, source, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    num_ps = len(sg.cluster.TFConfigClusterResolver().cluster_spec().as_dict()["ps"])
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(num_ps))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(21)
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
    ckpt.restore(source)
    report = {"shards": model.fc1.weight.num_shards if isinstance(model.fc1.weight, sg.ShardedVariable) else 1,
              "step": ckpt.step,
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
    report["saved"] = ckpt.save(out / name)
    (out / f"{name}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
