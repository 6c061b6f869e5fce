"""Joins a MultiWorkerMirroredStrategy and holds it while a test reads the chief's sockets.

Usage (one process per task, each with TF_CONFIG):
    python listen_script.py DIR

The chief writes ``DIR/ready.json`` (its pid and address) once the group is up, then
waits for ``DIR/done``; then every worker sums its rank + 1 over the group, so the
check happens while the job is running and the group still works afterwards.
"""

import json
import os
import sys
import time

import stratagem as sg


def main(directory: str) -> int:
    strategy = sg.MultiWorkerMirroredStrategy(
        communication_options=sg.CommunicationOptions(timeout_seconds=60))
    resolver = strategy.cluster_resolver
    rank = resolver.worker_rank
    if rank == 0:
        with open(os.path.join(directory, "ready.json.tmp"), "w") as f:
            json.dump({"pid": os.getpid(), "address": resolver.chief_address}, f)
        os.replace(os.path.join(directory, "ready.json.tmp"), os.path.join(directory, "ready.json"))
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(directory, "done")) and time.monotonic() < deadline:
            time.sleep(0.05)
    total = strategy.reduce("sum", float(rank + 1), axis=None)  # counted once per replica
    print(f"rank {rank} sum {total.item():g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
