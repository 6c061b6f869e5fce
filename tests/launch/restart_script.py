"""A small MultiWorkerMirroredStrategy job that resumes from its own checkpoint, for restart tests.

Usage (under ``stratagem launch``, which sets TF_CONFIG and STRATAGEM_RESTART)::

    python restart_script.py OUT --steps 12 [--save-every 1] [--timeout 20]
                             [--event RESTART:RANK:K:ACTION ...] [--watch] [--step-seconds T]

Every step's global batch is made from the step number, so a job that resumes from the
checkpoint of step ``s`` trains exactly the steps an uninterrupted job trains. The chief
saves ``OUT/checkpoint.pt`` (model, optimizer, next step) with plain ``torch.save`` every
``--save-every`` steps (0: never) and, with ``--watch``, when the workers agree to stop
for preemption; at the end it writes ``OUT/final.pt``. Every worker loads the checkpoint
at start-up if there is one.

``--event 0:1:2:kill`` makes rank 1, in the group's first run (STRATAGEM_RESTART=0), do
ACTION just before its 3rd step of that run (K counts from 0): ``kill`` (SIGKILL itself),
``stop`` (SIGSTOP itself: a hung worker) or ``term`` (SIGTERM itself: a preemption
notice). Each step prints ``restart R rank N step S``.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import stratagem as sg


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)


def save(path, state):
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a checkpoint is whole or absent, never half-written


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--event", action="append", default=[])
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep in every step")
    args = parser.parse_args()

    restart = int(os.environ["STRATAGEM_RESTART"])
    options = sg.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.worker_rank
    events = {}
    for event in args.event:
        at_restart, at_rank, k, action = event.split(":")
        if int(at_restart) == restart and int(at_rank) == rank:
            events[int(k)] = action

    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    start = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"restart {restart} rank {rank} resumes at step {start}", flush=True)
    watcher = sg.PreemptionWatcher(strategy) if args.watch else None

    def train_step(inputs):
        x, y = inputs
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def state(next_step):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": next_step}

    data = strategy.experimental_distribute_dataset([batch(s) for s in range(start, args.steps)])
    try:
        for k, (step, inputs) in enumerate(zip(range(start, args.steps), data)):
            print(f"restart {restart} rank {rank} step {step}", flush=True)
            action = events.get(k)
            if action and args.save_every == 1 and step > 0:
                # the chief saves step - 1 after the collective both workers took part in:
                # wait for it, so that the test knows where the next run resumes
                while torch.load(checkpoint, weights_only=True)["step"] < step:
                    time.sleep(0.01)
            if action:
                print(f"rank {rank} sends itself SIG{action.upper()} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP,
                                      "term": signal.SIGTERM}[action])
            strategy.run(train_step, args=(inputs,))
            time.sleep(args.step_seconds)
            if strategy.is_chief and args.save_every and (step + 1) % args.save_every == 0:
                save(checkpoint, state(step + 1))
            if watcher is not None and watcher.should_stop():
                print(f"rank {rank} stops for preemption after step {step}", flush=True)
                if strategy.is_chief:
                    save(checkpoint, state(step + 1))
                watcher.exit()
    except sg.errors.UnavailableError:
        print(f"rank {rank} raised UnavailableError at {time.time():.3f}", flush=True)
        raise
    if strategy.is_chief:
        save(os.path.join(args.out, "final.pt"), model.state_dict())
    print(f"restart {restart} rank {rank} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
