"""Coordinator of `stratagem launch --workers 1 --ps N ps_script.py OUT FROM_CKPT NAME`.

Under ParameterServerStrategy (each variable split in N shards over the N ps): restores the
checkpoint FROM_CKPT (saved under another strategy or layout), records the restored state,
trains one step on a worker, records the state again, and saves its own checkpoint to
OUT/NAME (every ps writes its shards). Then trains one more step and restores OUT/NAME again:
the same layout, so every ps loads its own files (counted in its stats); and a copy of it
with one ps file corrupted, which must fail and change nothing. Last, OUT/race/NAME (a copy)
is swapped on disk with another checkpoint after every ps verified its files and before they
load them: the ps must refuse the other checkpoint's files, and nothing may change. Writes
OUT/NAME.json.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.ps import checkpointing

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

    coordinator.schedule(step, args=(x, y))   # moves on, then back to the saved state
    coordinator.join()
    ckpt.step += 1
    clients = strategy.cluster.ps_clients

    def loads() -> list[int]:
        return [c.call("stats")["ops"].get("load_shards", {}).get("calls", 0) for c in clients]

    before = loads()
    ckpt.restore(report["saved"])
    report["ps_loads"] = [after - b for after, b in zip(loads(), before)]
    report["step_again"] = ckpt.step
    report["restored_again"] = {"model": as_lists(model.state_dict()),
                                "optimizer": as_lists(optimizer.state_dict()["state"])}

    broken = out / "broken" / name   # (a copy under its own name, in another folder)
    shutil.copytree(report["saved"], broken)
    data = bytearray((broken / "optimizer.ps1.pt").read_bytes())
    data[len(data) // 2] ^= 0x10
    (broken / "optimizer.ps1.pt").write_bytes(bytes(data))
    ckpt.step = 0
    try:
        ckpt.restore(broken)
        report["broken"] = "restored without an error"
    except sg.errors.CheckpointError as err:
        report["broken"] = str(err)
    report["step_after_broken"] = ckpt.step
    report["after_broken"] = {"model": as_lists(model.state_dict()),
                              "optimizer": as_lists(optimizer.state_dict()["state"])}
    race(ckpt, out, name, report, lambda: (coordinator.schedule(step, args=(x, y)), coordinator.join()))
    (out / f"{name}.json").write_text(json.dumps(report))


def race(ckpt, out: Path, name: str, report: dict, train_one_step) -> None:
    """OUT/race/NAME swapped with OUT/race/other between the ps' verification and their loading."""
    ckpt.restore(report["saved"])
    shutil.copytree(report["saved"], out / "race" / name)
    train_one_step()
    ckpt.save(out / "race" / "other")
    before = {"model": as_lists(ckpt.model.state_dict()), "step": ckpt.step}
    verified_then_load = checkpointing.ShardRestore.apply

    def swapped_then_load(self):
        os.rename(out / "race" / name, out / "race" / "swap")
        os.rename(out / "race" / "other", out / "race" / name)
        os.rename(out / "race" / "swap", out / "race" / "other")
        checkpointing.ShardRestore.apply = verified_then_load
        return verified_then_load(self)

    checkpointing.ShardRestore.apply = swapped_then_load
    try:
        ckpt.restore(out / "race" / name)
        report["race"] = "restored without an error"
    except sg.errors.CheckpointError as err:
        report["race"] = str(err)
    report["race_unchanged"] = before == {"model": as_lists(ckpt.model.state_dict()), "step": ckpt.step}


if __name__ == "__main__":
    main()
