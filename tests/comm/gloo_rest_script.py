"""A job's worker whose gloo thread still holds a collective, which
stratagem.comm.gloo_threads.bring_to_rest must wait out.

Worker 0 starts an all-reduce of a tensor it drops at once, with its work, sees the tensor still
held, tells worker 1 (through the rendezvous store) and asks for gloo's threads at rest; worker 1
joins that all-reduce only 0.5 s after it is told. Until then a gloo thread of worker 0 holds the
collective (and with it the last reference to the tensor), so ``bring_to_rest`` must not return
before worker 1 has joined, and once it has returned the tensor must be gone: the state in which an interpreter may finalize without a thread of gloo's aborting
it. Worker 0 prints how long it waited, whether the tensor was still held before and after, and the
sum the peer's value made.

Usage: stratagem launch --workers 2 gloo_rest_script.py
"""

import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.comm.gloo_threads import bring_to_rest  # noqa: E402

strategy = sg.MultiWorkerMirroredStrategy()
worker = strategy.cluster_resolver.task_id
store = dist.distributed_c10d._get_default_store()
if worker == 1:
    store.wait(["gloo_rest/held"])
    time.sleep(0.5)   # (worker 0 is waiting in bring_to_rest by then; were it not, the test would still pass)
    dist.all_reduce(torch.full((4,), 2.0))
    print("worker 1: joined the all-reduce", flush=True)
else:
    result = {}
    tensor = torch.full((4,), 1.0)
    watch = weakref.ref(tensor)
    work = dist.all_reduce(tensor, async_op=True)
    summed = work.get_future().then(lambda future: result.setdefault("sum", future.value()[0][0].item()))
    del tensor, work
    held_before = watch() is not None   # (worker 1 has not joined yet: it waits for the line below)
    store.set("gloo_rest/held", "1")
    started = time.monotonic()
    rested = bring_to_rest(timeout=60.0)
    waited = time.monotonic() - started
    held_after = watch() is not None
    print(f"worker 0: held before: {held_before}; at rest: {rested} after {waited:.2f} s; held after: "
          f"{held_after}; sum {result.get('sum')}", flush=True)
