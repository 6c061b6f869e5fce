"""Coordinator script for test_takeover.py: one of several coordinators, one after the other,
against the same `stratagem server` processes the test started.

Usage: takeover.py MODE GATE_DIR [options]. The model is a Linear(1, --width) whose weight
(on ps 0) and bias (on ps 1), 0 at first, every applied step raises by exactly 1 (SGD, lr 1,
gradient -1): their values count the updates each ps applied since this coordinator created
them. Prints
progress lines and, last, "RESULT {json}".

Modes:
  train     train --steps steps; with --restore DIR restore the newest checkpoint there
            first, with --save DIR save one after
  hold      train 5 steps, then schedule one step that computes its gradient and waits for
            GATE_DIR/open before pushing it; print HOLDING once it waits, then wait for
            GATE_DIR/go and report what join() and schedule() raise
  takeover  schedule --steps steps (one of them queues behind the held step on its worker);
            once all the others are done, open the gate: the held step's push (of the
            coordinator taken over) must be refused, and the weight be exactly --steps
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg


def say(line):
    print(line, flush=True)


def describe(error):
    return {"type": type(error).__name__, "message": str(error)}


def read(model):
    return torch.cat([model.weight.flatten(), model.bias.flatten()]).tolist()


def wait_until(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "hold", "takeover"])
    parser.add_argument("gate")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--restore")
    parser.add_argument("--save")
    parser.add_argument("--wait-for", help="start up, then wait for this file before claiming the servers")
    args = parser.parse_args()
    gate = Path(args.gate)

    sg.ParameterServerStrategy, sg.ClusterCoordinator   # (imported on first use: gRPC takes seconds)
    if args.wait_for:
        say("READY")
        wait_until(lambda: Path(args.wait_for).exists(), 120, args.wait_for)
    started = time.monotonic()
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    report = {"mode": args.mode, "pid": os.getpid(), "claim_seconds": time.monotonic() - started,
              "claimed_at": time.time(),
              "took_over": strategy.cluster.tenure.took_over}
    coordinator = sg.ClusterCoordinator(strategy)
    with strategy.scope():
        model = nn.Linear(1, args.width)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    report["created"] = read(model)
    stats = [client for client in strategy.cluster.ps_clients]

    def fenced():
        return sum(c.call("stats")["ops"].get("push_fenced", {}).get("calls", 0) for c in stats)

    def step(hold):
        optimizer.zero_grad()
        (-model.weight.sum() - model.bias.sum()).backward()   # gradient -1: an applied step adds 1
        if hold:
            Path(hold, f"holding-{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while not Path(hold, "open").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        optimizer.step()
        return os.getpid()

    if args.mode == "train":
        if args.restore:
            manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), args.restore)
            report["restored"] = manager.restore_or_initialize()
            report["after_restore"] = read(model)
        for _ in range(args.steps):
            coordinator.schedule(step, args=(None,))
        coordinator.join(timeout=60)
        if args.save:
            sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), args.save).save()
    elif args.mode == "hold":
        for _ in range(5):
            coordinator.schedule(step, args=(None,))
        coordinator.join(timeout=60)
        report["before_hold"] = read(model)
        held = coordinator.schedule(step, args=(str(gate),))
        wait_until(lambda: any(gate.glob("holding-*")), 60, "the held step")
        say("HOLDING")
        wait_until(lambda: (gate / "go").exists(), 120, "the test's go")
        for name, call in (("join", lambda: coordinator.join(timeout=60)),
                           ("fetch", lambda: held.fetch(timeout=60)),
                           ("schedule", lambda: coordinator.schedule(step, args=(None,)))):
            try:
                call()
                report[name] = None
            except Exception as error:  # noqa: BLE001 - the test reads it
                report[name] = describe(error)
    else:
        values = [coordinator.schedule(step, args=(None,)) for _ in range(args.steps)]
        wait_until(lambda: sum(v.status.value == "READY" for v in values) >= args.steps - 1, 60,
                   "every step but the one behind the held step")
        report["fenced_before"] = fenced()
        report["weight_before_open"] = read(model)
        (gate / "open").touch()
        say("OPENED")
        wait_until(lambda: fenced() > report["fenced_before"], 60, "the held push to be refused")
        coordinator.join(timeout=60)
        report["fenced_after"] = fenced()
    report["weight"] = read(model)
    report["owner"] = [client.call("owner")["owner"]["pid"] for client in stats]
    say("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
