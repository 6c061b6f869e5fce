"""nanoGPT's loop (nanogpt_loop.py) under MultiWorkerMirroredStrategy; the test compares it
with plain PyTorch. Each configuration is one line of ``CONFIGS``; every worker writes its history.

Usage (one process per task, e.g. ``stratagem launch --workers 2``):
    python nanogpt_script.py OUT_DIR
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: run as a script, or imported

import stratagem as sg  # noqa: E402
from tests.placement.data_axis import nanogpt_loop  # noqa: E402

#: name -> (local replicas, sharding, how micro-steps skip the exchange, recompute, bytes per pack,
#: the step outside strategy.run as under DistributedDataParallel, with which loss helper)
CONFIGS = {
    "one_replica": (1, None, "no_sync", False, 0, False),
    "two_replicas_attribute": (2, None, "attribute", False, 0, False),
    "every_backward_small_packs": (1, None, "none", False, 2048, False),
    "zero1_recompute": (1, "optimizer", "no_sync", True, 0, False),
    "outside_run_attribute": (1, None, "attribute", False, 0, "mean_over_replicas"),
    "outside_run_zero1_no_sync": (1, "optimizer", "no_sync", False, 0, "compute_average_loss"),
    # packs leave while a backward outside run still runs, as DDP's buckets do
    "outside_run_every_backward_small_packs": (1, None, "none", False, 2048, "mean_over_replicas"),
}


def main() -> None:
    out = Path(sys.argv[1])
    rank = None
    for name, (replicas, sharding, skip, recompute, pack, outside_run) in CONFIGS.items():
        strategy = sg.MultiWorkerMirroredStrategy(
            devices=[f"cpu:{i}" for i in range(replicas)], sharding=sharding,
            communication_options=sg.CommunicationOptions(bytes_per_pack=pack, timeout_seconds=60))
        rank = strategy.cluster_resolver.worker_rank
        history = nanogpt_loop.train(strategy, skip=skip, recompute=recompute, outside_run=outside_run)
        torch.save(history, out / f"{name}.{rank}.pt")
        print(f"worker {rank}: {name} done", flush=True)


if __name__ == "__main__":
    main()
