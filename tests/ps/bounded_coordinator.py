"""Coordinator script for tests/ps/test_coordinator_bounded.py: run as the chief of a 1 ps, 1 worker cluster.

Usage: bounded_coordinator.py MODE GATE_FILE [PS_PID]. Steps wait until GATE_FILE exists (the
script creates it), so the queue fills without fixed sleeps. Prints "RESULT {json}" last.

Modes:
  bound    max_queued=2: schedule blocks while 2 are unfinished and goes on when they finish;
           300 fresh lambdas leave the worker's closure cache at its size (the worker runs with
           STRATAGEM_WORKER_CLOSURE_CACHE=8) and an evicted one still runs; dropped per-worker
           iterators are released; shutdown wakes a blocked schedule
  ps-lost  a schedule blocked on a full queue raises UnavailableError when the ps is killed
"""

import gc
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import stratagem as sg


def wait_for_gate(path):
    while not os.path.exists(path):
        time.sleep(0.02)
    return 1


def blocked_schedule(coordinator, fn, args=()):
    """Start schedule(fn) in a thread; its outcome lands in the returned dict."""
    outcome = {}

    def body():
        started = time.monotonic()
        try:
            coordinator.schedule(fn, args=args)
            outcome["type"] = None
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome.update(type=type(error).__name__, message=str(error))
        outcome["returned"] = time.monotonic()
        outcome["seconds"] = outcome["returned"] - started

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def main():
    mode, gate = sys.argv[1], sys.argv[2]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy, max_queued=2, worker_timeout=30)
    with strategy.scope():
        model = nn.Linear(2, 1)
    stats = lambda: coordinator._workers[0].client.call("ping", None, timeout=10)  # noqa: E731
    report = {}
    if mode == "bound":
        for _ in range(2):
            coordinator.schedule(wait_for_gate, args=(gate,))
        thread, outcome = blocked_schedule(coordinator, wait_for_gate, (gate,))
        thread.join(1.0)
        report["blocked_while_full"] = thread.is_alive()
        report["unfinished_while_full"] = coordinator._queue.unfinished
        opened = time.monotonic()
        open(gate, "w").close()
        thread.join(30)
        report["after_gate"] = {**outcome, "seconds": outcome.get("returned", opened + 99) - opened}
        coordinator.join(timeout=30)

        kept = lambda: 1000  # noqa: E731 - sent first, evicted by the 300 below
        first = coordinator.schedule(kept)
        peak = 0
        values = []
        for i in range(300):
            values.append(coordinator.schedule(lambda i=i: i + model(torch.ones(1, 2)).detach() * 0))
            peak = max(peak, coordinator._queue.unfinished)
        coordinator.join(timeout=60)
        report["peak_unfinished"] = peak
        report["lambda_values_ok"] = all(float(v.fetch()) == i for i, v in enumerate(values))
        report["cache_after_300"] = stats()["closures"]
        report["first"] = first.fetch()
        report["evicted_rerun"] = coordinator.schedule(kept).fetch(timeout=30)

        for _ in range(50):
            iterator = iter(coordinator.create_per_worker_dataset(lambda: iter(range(10))))
            coordinator.schedule(lambda it: next(it), args=(iterator,)).fetch(timeout=30)
        del iterator
        gc.collect()
        coordinator.schedule(kept).fetch(timeout=30)   # carries the releases
        after = stats()
        report["datasets_after"], report["iterators_after"] = after["datasets"], after["iterators"]
        report["coordinator_datasets"] = len(coordinator._datasets)

        os.remove(gate)
        for _ in range(2):
            coordinator.schedule(wait_for_gate, args=(gate,))
        thread, outcome = blocked_schedule(coordinator, wait_for_gate, (gate,))
        thread.join(0.5)
        stopped = time.monotonic()
        threading.Thread(target=coordinator.shutdown, daemon=True).start()
        thread.join(10)
        report["on_shutdown"] = {**outcome, "seconds": outcome.get("returned", stopped + 99) - stopped}
        open(gate, "w").close()
    else:
        for _ in range(2):
            coordinator.schedule(wait_for_gate, args=(gate,))
        thread, outcome = blocked_schedule(coordinator, wait_for_gate, (gate,))
        thread.join(0.5)
        killed = time.monotonic()
        os.kill(int(sys.argv[3]), signal.SIGKILL)
        thread.join(30)
        report["on_ps_lost"] = {**outcome, "seconds": outcome.get("returned", killed + 99) - killed}
        open(gate, "w").close()
    print("RESULT " + json.dumps(report), flush=True)
    coordinator.shutdown()


if __name__ == "__main__":
    main()
