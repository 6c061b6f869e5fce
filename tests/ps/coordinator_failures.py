"""Coordinator script for tests/ps/test_coordinator_*.py: run as the chief of a cluster the test starts.

Usage: coordinator_failures.py MODE WORKER_TIMEOUT [WORKER_PID...]. It prints progress lines the test waits
for ("PIDS {...}", "KILLED", ...) and, last, "RESULT {json}".

Modes:
  all-killed   join/fetch timeouts with live workers; SIGKILL every worker, the test restarts
               worker 0 and it gets the work; SIGKILL it again: UnavailableError naming them
  wrong-token  the only worker (started once closures are queued) has another cluster
               token: the closures fail, join/fetch/schedule raise within seconds
  not-worker   the only worker address is the ps's: join/fetch raise, saying it is no worker
  skewed-clock the only worker (started once closures are queued) runs with its clock 10 minutes
               ahead: join/fetch/schedule raise within seconds, saying so first
"""

import json
import os
import signal
import sys
import time

import torch
from torch import nn

import stratagem as sg


def describe(error):
    return {"type": type(error).__name__, "message": str(error), "task": getattr(error, "task", None)}


def attempt(fn):
    started = time.monotonic()
    try:
        fn()
        return {"type": None, "seconds": time.monotonic() - started}
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        return {**describe(error), "seconds": time.monotonic() - started}


def say(line):
    print(line, flush=True)


def main():
    mode, worker_timeout = sys.argv[1], float(sys.argv[2])
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy, worker_timeout=worker_timeout)
    with strategy.scope():
        model = nn.Linear(2, 1)

    def step(delay):
        time.sleep(delay)
        return model(torch.ones(1, 2)).detach(), os.getpid()

    report = {}
    if mode == "all-killed":
        slow = coordinator.schedule(step, args=(3.0,))
        report["join_timeout"] = attempt(lambda: coordinator.join(timeout=0.5))
        report["fetch_timeout"] = attempt(lambda: slow.fetch(timeout=0.5))
        report["coordinator_fetch_timeout"] = attempt(lambda: coordinator.fetch([slow], timeout=0.5))
        coordinator.join(timeout=60)
        pids = [int(pid) for pid in sys.argv[3:]]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        values = [coordinator.schedule(step, args=(0.0,)) for _ in range(4)]
        say("KILLED")                        # the test restarts worker 0 now
        report["restart_join"] = attempt(lambda: coordinator.join(timeout=60))
        report["restart_pids"] = sorted({pid for _, pid in coordinator.fetch(values, timeout=10)})
        report["killed_pids"] = sorted(pids)
        os.kill(report["restart_pids"][0], signal.SIGKILL)
        value = coordinator.schedule(step, args=(0.0,))
        report["dead_join"] = attempt(lambda: coordinator.join(timeout=120))
        report["dead_fetch"] = attempt(lambda: value.fetch(timeout=120))
    else:
        values = []   # schedule itself raises once the coordinator has seen the error
        report["schedule"] = attempt(lambda: values.extend(coordinator.schedule(step, args=(0.0,))
                                                           for _ in range(3)))
        say("SCHEDULED")                     # (wrong-token, skewed-clock) the test starts the worker now
        report["join"] = attempt(lambda: coordinator.join(timeout=60))
        if values:
            report["fetch"] = attempt(lambda: values[0].fetch(timeout=60))
            report["coordinator_fetch"] = attempt(lambda: coordinator.fetch(values, timeout=60))
        report["status"] = [v.status.value for v in values]
        report["schedule_after"] = attempt(lambda: coordinator.schedule(step, args=(0.0,)))
    say("RESULT " + json.dumps(report))
    coordinator.shutdown()


if __name__ == "__main__":
    main()
