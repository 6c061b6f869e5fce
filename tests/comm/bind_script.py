"""Joins a MultiWorkerMirroredStrategy and holds it while a test reads the job's sockets.

Usage (one process per task, each with TF_CONFIG, e.g. under ``stratagem launch``):
    python bind_script.py DIR

Each worker writes ``DIR/task-RANK.json`` (its pid, the chief's address and the interface
gloo was given) once the group is up, then waits for ``DIR/done``; then every worker sums its
rank + 1 over the group, so the check happens while the job runs and the group still works
afterwards.
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
    info = {"pid": os.getpid(), "chief": resolver.chief_address,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")}
    path = os.path.join(directory, f"task-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(directory, "done")) and time.monotonic() < deadline:
        time.sleep(0.05)
    total = strategy.reduce("sum", float(rank + 1), axis=None)  # counted once per replica
    print(f"rank {rank} sum {total.item():g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
