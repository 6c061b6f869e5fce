"""A pipeline peer lost in the middle of a step: the other process must get a clear error in bounded time.

Usage (2 processes, TF_CONFIG): python pp_fault_script.py OUT_DIR kill|stop

Both train a 1F1B pipeline; at step 3, worker 1 SIGKILLs (``kill``) or SIGSTOPs (``stop``)
itself inside the schedule (in its stage's forward of the second micro-batch, after the first
went through), after printing ``losing at step 3``. Worker 0 writes
OUT_DIR/rank0.json: the error of its step 3, how long the step took to fail, and whether its
stage's parameters after the failure are those of step 2 (the failed step applied nothing).
Under ``stop`` worker 0 then SIGKILLs worker 1 (its pid is in OUT_DIR/pid1), so nothing is left.
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

TIMEOUT = 8   # seconds: how long a process waits for a silent peer (a healthy step takes milliseconds)


def main() -> None:
    out, how = Path(sys.argv[1]), sys.argv[2]
    options = sg.CommunicationOptions(timeout_seconds=TIMEOUT)
    strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="1f1b", loss_fn=nn.functional.mse_loss,
                                                communication_options=options)
    rank = strategy.pipe_rank
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own = [p for p in model.parameters() if not p.is_meta]

    def step(x, y):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, x, y)
        optimizer.step()
        return loss

    forwards = []

    def lose_at_step_3(module, args):
        forwards.append(1)
        if len(forwards) == 2 * 2 + 2:   # steps 1 and 2 ran 2 micro-batches each; step 3's second
            print("losing at step 3", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    if rank == 1:
        model[2].register_forward_pre_hook(lose_at_step_3)   # the last layer: this process's stage
    g = torch.Generator().manual_seed(1)
    for i in range(1, 5):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        before = [p.detach().clone() for p in own]
        started = time.monotonic()
        try:
            strategy.run(step, args=(x, y))
        except Exception as error:   # noqa: BLE001 - reported to the test
            result = {"step": i, "type": type(error).__name__, "error": str(error),
                      "seconds": time.monotonic() - started,
                      "unchanged": all(torch.equal(a, p) for a, p in zip(before, own))}
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            if how == "stop":
                os.kill(int((out / "pid1").read_text()), signal.SIGKILL)
            print("failed as expected", flush=True)
            os._exit(3)   # the process group is broken: leave without its teardown
        print(f"step {i} done", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
