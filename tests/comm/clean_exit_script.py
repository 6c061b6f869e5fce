"""A job's worker that trains one step under MultiWorkerMirroredStrategy and ends, as the Slurm
guide's script does: it must exit 0 with none of gloo's threads left once the strategy has closed,
or with ``sharding="parameters"`` (whose model holds the group, so its threads live on) with every
one of them at rest -- although they crawl for 3 s from the last collective on (tests/comm/crawling_gloo.py).

The check is an ``atexit`` handler registered before the strategy exists, so it runs after the
strategy's own (which leave the process group). A gloo thread that is not at rest then can be
releasing a finished collective's tensors when the interpreter finalizes, which aborts the process
("terminate called without an active exception") after a successful run, a few runs in a hundred on
a busy machine; the handler makes that visible every time: exit 3, naming the threads.

Usage: stratagem launch --workers 2 clean_exit_script.py [sharding]
"""

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


SHARDING = sys.argv[1] if len(sys.argv) > 1 else None
hog = None   # the busy process that makes gloo's threads crawl (sharding="parameters")


def _check() -> None:
    from stratagem.comm.gloo_threads import _busy_threads, thread_names   # (imported by now: the strategy's)
    left = [name for name in thread_names().values() if "gloo" in name]
    if SHARDING == "parameters":   # FSDP's mesh and DTensor parameters hold the group: at rest is the bar
        busy = _busy_threads()
        if hog is not None:
            hog.kill()
            hog.wait()
        if busy or busy is None or not left:
            print(f"gloo threads {left}, busy at exit: {busy}", flush=True)
            os._exit(3)
        print(f"{len(left)} gloo threads, at rest at exit", flush=True)
        return
    if left:
        print(f"gloo threads still running at exit: {left}", flush=True)
        os._exit(3)
    print("no gloo threads at exit", flush=True)


atexit.register(_check)   # before the strategy's handlers: runs after them

import torch  # noqa: E402

import stratagem as sg  # noqa: E402

strategy = sg.MultiWorkerMirroredStrategy(sharding=SHARDING)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x):
    loss = sg.nn.compute_average_loss(model(x).pow(2).sum(dim=1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


losses = strategy.run(step, args=(torch.ones(2, 4),))
if SHARDING == "parameters":
    from tests.comm.crawling_gloo import crawl
    hog = crawl()
loss = strategy.reduce("sum", losses, axis=None)
print(f"worker {strategy.cluster_resolver.task_id} done, loss {loss.item():.4f}", flush=True)
