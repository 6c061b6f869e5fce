"""BatchNorm under MultiWorkerMirroredStrategy, every configuration in one worker process; the test
(test_multi_worker_batch_norm.py) compares what each worker saved with plain PyTorch.

Usage (one process per task, e.g. ``stratagem launch --workers 2``):
    python batch_norm_script.py OUT_DIR
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: run as a script, or imported

import stratagem as sg  # noqa: E402
from tests.placement.scope import batch_norm_model  # noqa: E402

#: name -> (local replicas, sharding, SyncBatchNorm, how it trains)
CONFIGS = {
    "sync_2x1": (1, None, True, "run"),
    "sync_2x2": (2, None, True, "run"),
    "sync_fit_2x1": (1, None, True, "fit"),
    "sync_zero3": (1, "parameters", True, "run"),
    "plain_2x1": (1, None, False, "run"),
    "plain_2x2": (2, None, False, "run"),
    "plain_zero1": (1, "optimizer", False, "run"),
    "plain_zero2": (1, "gradients", False, "run"),
    "plain_zero3": (1, "parameters", False, "run"),
}


def strategy_for(replicas: int, sharding: "str | None") -> sg.MultiWorkerMirroredStrategy:
    return sg.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)], sharding=sharding,
                                          communication_options=sg.CommunicationOptions(timeout_seconds=60))


def outside_run(rank: int) -> dict:
    """SyncBatchNorm's forward and backward outside run: this worker's half of the batch, synchronized."""
    strategy = strategy_for(1, None)
    with strategy.scope():
        model = batch_norm_model.build(True)
    x, _ = batch_norm_model.data()[1]
    mine = x.tensor_split(2)[rank].clone().requires_grad_()
    out = model.bn(model.stem(mine))
    (out * out.detach().cos()).sum().backward()
    return {"out": out.detach(), "grad": mine.grad, "state": batch_norm_model.state(model)}


def main() -> None:
    out = Path(sys.argv[1])
    rank = None
    for name, (replicas, sharding, sync, how) in CONFIGS.items():
        strategy = strategy_for(replicas, sharding)
        rank = strategy.cluster_resolver.worker_rank
        if how == "fit":
            model = batch_norm_model.fit(strategy)
        else:
            model = batch_norm_model.train(strategy, sync=sync)
        result = {"state": batch_norm_model.state(model)}
        if name == "plain_2x1":   # a forward with no step after it: each worker's own statistics, then a checkpoint
            x, _ = batch_norm_model.data()[0]
            with torch.no_grad():
                model(x[rank::2] * (rank + 1))
            result["diverged"] = batch_norm_model.state(model)
            path = sg.Checkpoint(model=model).save(out / "checkpoint")
            result["after_save"] = batch_norm_model.state(model)
            if rank == 0:
                result["saved"] = {k: v.clone() for k, v in torch.load(Path(path) / "model.pt").items()}
        torch.save(result, out / f"{name}.{rank}.pt")
        print(f"worker {rank}: {name} done", flush=True)
    torch.save(outside_run(rank), out / f"outside_run.{rank}.pt")
    print(f"worker {rank}: outside_run done", flush=True)


if __name__ == "__main__":
    main()
