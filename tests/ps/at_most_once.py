"""Coordinator script for test_at_most_once.py: run as the chief of a cluster the test starts.

Usage: at_most_once.py MODE GATE_DIR [PID]. The model is one weight, 0 at first, that
every applied step raises by exactly 1 (SGD, lr 1, gradient -1): its value counts the
updates the ps applied. Prints progress lines and, last, "RESULT {json}".

Modes:
  stop-worker PID  the step on worker PID waits for a gate; the script SIGSTOPs that worker,
                   opens the gate, lets join() finish (the step runs again elsewhere), then
                   SIGCONTs it: its late push must be refused. 42 steps, weight 42.
  ps-stall PID     SIGSTOP the ps (PID) for 3 s while 42 steps run: a stall, not a loss;
                   every step completes once. Weight 42.
  ps-lost PID      ps_timeout=4: steps wait at a gate, the ps is SIGSTOPped, the gate opens
                   (pushes sit in the ps's socket), join() raises UnavailableError naming the
                   ps; after SIGCONT the ps must refuse those pushes: nothing more applied.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg

STEPS = 42


def say(line):
    print(line, flush=True)


def describe(error):
    return {"type": type(error).__name__, "message": str(error), "task": getattr(error, "task", None)}


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


def main():
    mode, gate_dir = sys.argv[1], Path(sys.argv[2])
    pid = int(sys.argv[3])
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy, ps_timeout=4.0 if mode == "ps-lost" else 10.0)
    with strategy.scope():
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ps = strategy.cluster.ps_clients[0]

    def updates():
        return sum(info["updates"] for info in ps.call("variables").values())

    def refused():
        return ps.call("stats")["ops"].get("push_refused", {}).get("calls", 0)

    def step(hold_pid, gate):
        optimizer.zero_grad()
        (-model.weight.sum()).backward()        # gradient -1: an applied step adds 1
        me = os.getpid()
        if hold_pid in (me, -1):                 # -1: every step waits at the gate
            Path(gate, f"holding-{me}-{time.monotonic_ns()}").touch()
            deadline = time.monotonic() + 120
            while not Path(gate, "open").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        outcome = "interrupted"
        try:
            optimizer.step()
            outcome = "applied"
        except Exception as error:  # noqa: BLE001 - what the late push met, for the report
            outcome = f"{type(error).__name__}: {str(error)[:300]}"
            raise
        finally:
            if hold_pid == me:   # the held step: the coordinator waits for its outcome (renamed
                name = f"outcome-{me}-{time.monotonic_ns()}"   # into place whole, never read half written)
                Path(gate, "." + name).write_text(outcome)
                os.replace(Path(gate, "." + name), Path(gate, name))
        return me

    report = {"mode": mode}
    gate = str(gate_dir)
    if mode == "stop-worker":
        values = [coordinator.schedule(step, args=(pid, gate)) for _ in range(STEPS)]
        wait_until(lambda: any(gate_dir.glob(f"holding-{pid}-*")), 60, "the step on the worker to stop")
        os.kill(pid, signal.SIGSTOP)
        (gate_dir / "open").touch()
        say("STOPPED")
        started = time.monotonic()
        coordinator.join(timeout=90)
        report["join_seconds"] = time.monotonic() - started
        report["ran_on"] = sorted({v.fetch() for v in values})
        report["updates_after_join"] = updates()
        os.kill(pid, signal.SIGCONT)
        say("CONTINUED")
        # the held step's push, sent once the worker resumed: whatever it met is written beside
        # the gate (a refusal, or an error on the way), so a failure names it at once
        wait_until(lambda: any(gate_dir.glob(f"outcome-{pid}-*")), 60, "the stopped worker's late push")
        report["late_push"] = [f.read_text() for f in sorted(gate_dir.glob(f"outcome-{pid}-*"))]
        report["refused"] = refused()
        report["updates"] = updates()
        more = coordinator.schedule(step, args=(0, gate))      # the resumed worker still works
        coordinator.join(timeout=60)
        report["after"] = more.fetch() is not None
        report["weight"] = model.weight.item()
        report["run_on_lane"] = ["run" in (w.client._lane.methods or {}) for w in coordinator._workers]
    elif mode == "ps-stall":
        values = [coordinator.schedule(step, args=(0, gate)) for _ in range(STEPS)]
        wait_until(lambda: sum(v.status.value == "READY" for v in values) >= 5, 60, "some steps")
        os.kill(pid, signal.SIGSTOP)
        say("PS STOPPED")
        time.sleep(3.0)                           # the fault: a 3 s stall of the ps
        os.kill(pid, signal.SIGCONT)
        say("PS CONTINUED")
        try:
            coordinator.join(timeout=90)
            report["join"] = None
        except Exception as error:  # noqa: BLE001 - the test reads it
            report["join"] = describe(error)
        report["statuses"] = sorted({v.status.value for v in values})
        report["updates"] = updates()
        report["weight"] = model.weight.item()
    elif mode == "ps-lost":
        values = [coordinator.schedule(step, args=(-1, gate)) for _ in range(10)]
        wait_until(lambda: len(list(gate_dir.glob("holding-*"))) >= 2, 60, "two steps at the gate")
        report["updates_before"] = updates()
        os.kill(pid, signal.SIGSTOP)
        (gate_dir / "open").touch()                # the two pushes now sit in the ps's socket
        say("PS STOPPED")
        started = time.monotonic()
        try:
            coordinator.join(timeout=90)
            report["join"] = None
        except Exception as error:  # noqa: BLE001
            report["join"] = describe(error)
        report["join_seconds"] = time.monotonic() - started
        try:
            coordinator.schedule(step, args=(0, gate))
            report["schedule_after"] = None
        except Exception as error:  # noqa: BLE001
            report["schedule_after"] = describe(error)
        os.kill(pid, signal.SIGCONT)
        say("PS CONTINUED")
        wait_until(lambda: refused() >= 2, 60, "the ps to refuse the pushes it held")
        report["refused"] = refused()
        report["updates_after"] = updates()
        # the running steps' dispatchers notice the loss within a heartbeat or two
        wait_until(lambda: all(v.status.value != "PENDING" for v in values), 30, "every step to settle")
        report["statuses"] = sorted({v.status.value for v in values})
    say("RESULT " + json.dumps(report))
    coordinator.shutdown()


if __name__ == "__main__":
    main()
