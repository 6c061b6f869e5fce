"""Coordinator script for test_lost_then_restored.py: run as the chief of a cluster the test starts.

Usage: lost_then_restored.py MODE GATE_DIR PS_PID. The model is one weight, 0 at first,
that every applied step raises by exactly 1 (SGD, lr 1, gradient -1). Three steps run,
the weight (3) is saved, then steps are dispatched and held at a gate while the ps is
SIGSTOPped until it is declared lost (ps_timeout=4); join() raises, the ps is SIGCONTed,
the saved weight is restored (``model.load_state_dict``: 3 again) and only then does the
gate open. The held steps were dispatched before the loss, so they must fail with it and
apply nothing: the weight stays 3, and two more steps make it 5.

Modes:
  held     one step, held by its dispatcher while the worker creates a per-worker dataset
           whose function waits at the gate: the step has not started when the ps is lost.
  running  one step per worker, each inside its function on the worker, waiting at the gate
           before ``optimizer.step()``: it pushes after the restore.
Prints progress lines and, last, "RESULT {json}".
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


def wait_at(gate, name):
    """On a worker: say so with a file, then wait for the gate to open (bounded)."""
    Path(gate, f"holding-{name}-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + 120
    while not Path(gate, "open").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def outcome(value):
    try:
        return {"value": value.fetch(timeout=5)}
    except Exception as error:  # noqa: BLE001 - the test reads it
        return describe(error)


def main():
    mode, gate_dir, pid = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    gate = str(gate_dir)
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy, ps_timeout=4.0)
    num_workers = len(strategy.cluster.worker_addresses)
    with strategy.scope():
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ps = strategy.cluster.ps_clients[0]

    def refused():
        return ps.call("stats")["ops"].get("push_refused", {}).get("calls", 0)

    def step(hold):
        optimizer.zero_grad()
        (-model.weight.sum()).backward()        # gradient -1: an applied step adds 1
        if hold:
            wait_at(gate, "step")
        try:
            optimizer.step()
            pushed = "applied"
        except Exception as error:  # noqa: BLE001 - said in a file, then raised
            pushed = f"{type(error).__name__}: {error}"
            raise
        finally:
            if hold:
                Path(gate, f"pushed-{os.getpid()}-{time.monotonic_ns()}").write_text(pushed)
        return os.getpid()

    def slow_dataset():
        wait_at(gate, "dataset")
        return range(10)

    report = {"mode": mode}
    for _ in range(3):
        coordinator.schedule(step, args=(False,))
    coordinator.join(timeout=60)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    report["saved"] = saved["weight"].item()

    datasets = []    # (a dataset the program drops is released on the workers)
    if mode == "held":
        datasets.append(coordinator.create_per_worker_dataset(slow_dataset))
        held = [coordinator.schedule(step, args=(False,))]
    else:
        held = [coordinator.schedule(step, args=(True,)) for _ in range(num_workers)]
    wait_until(lambda: len(list(gate_dir.glob("holding-*"))) >= len(held), 60, "the held steps at the gate")
    os.kill(pid, signal.SIGSTOP)
    say("PS STOPPED")
    started = time.monotonic()
    try:
        coordinator.join(timeout=60)
        report["join"] = None
    except Exception as error:  # noqa: BLE001
        report["join"] = describe(error)
    report["join_seconds"] = time.monotonic() - started
    report["held_when_lost"] = [v.status.value for v in held]
    os.kill(pid, signal.SIGCONT)
    say("PS CONTINUED")
    refused_before = refused()
    model.load_state_dict(saved)                   # the restore after the loss
    say("RESTORED")
    (gate_dir / "open").touch()
    wait_until(lambda: all(v.status.value != "PENDING" for v in held), 60, "the held steps to settle")
    report["held"] = [outcome(v) for v in held]
    if mode == "running":    # the steps' functions went on after their dispatchers gave up
        wait_until(lambda: len(list(gate_dir.glob("pushed-*"))) >= len(held), 60, "the held steps' pushes")
        report["pushes"] = sorted(path.read_text()[:300] for path in gate_dir.glob("pushed-*"))
    try:
        coordinator.join(timeout=60)
        report["join_after"] = None
    except Exception as error:  # noqa: BLE001
        report["join_after"] = describe(error)
    report["weight_after_held"] = model.weight.item()
    report["refused_after_restore"] = refused() - refused_before
    for _ in range(2):
        coordinator.schedule(step, args=(False,))
    try:
        coordinator.join(timeout=60)
        report["join_more"] = None
    except Exception as error:  # noqa: BLE001
        report["join_more"] = describe(error)
    report["weight"] = model.weight.item()
    report["datasets"] = len(datasets)
    say("RESULT " + json.dumps(report))
    coordinator.shutdown()


if __name__ == "__main__":
    main()
