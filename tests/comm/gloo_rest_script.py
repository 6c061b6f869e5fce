"""A job's worker whose gloo threads crawl while they hold finished collectives, which
stratagem.comm.gloo_threads.bring_to_rest must wait out.

The threads get the idlest scheduling class on a core a busy process holds (where there are two
cores); each runs an all-reduce of a tensor this thread dropped at once, so letting go of it is
theirs to do, and takes them the GIL, which this thread keeps from the moment the collectives
return (a switch interval of 1,000 s: it lets go only when it blocks) -- as a thread that runs on
into the interpreter's exit may. ``bring_to_rest`` must return only once they have let go: the
state in which an interpreter may finalize without a thread of gloo's aborting it.

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
from tests.comm.crawling_gloo import crawl  # noqa: E402


strategy = sg.MultiWorkerMirroredStrategy()
worker = strategy.cluster_resolver.task_id
hog = crawl()
try:
    tensors, works = [], []
    for i in range(2):   # one for each of gloo's threads
        tensor = torch.full((1024,), float(i))
        tensors.append(weakref.ref(tensor))
        works.append(dist.all_reduce(tensor, async_op=True))
        del tensor
    sys.setswitchinterval(1000.0)   # from here this thread keeps the GIL until it blocks
    for work in works:
        work.wait()
    del works, work   # (the works hold the tensors too)
    held = sum(ref() is not None for ref in tensors)   # (no print: it would let go of the GIL)
    started = time.monotonic()
    rested = bring_to_rest(timeout=120.0)
    took = time.monotonic() - started
    left = sum(ref() is not None for ref in tensors)
finally:
    sys.setswitchinterval(0.005)
    if hog is not None:
        hog.kill()
        hog.wait()
print(f"worker {worker}: {held} tensor(s) still held by gloo's threads when the collectives returned; "
      f"at rest: {rested} after {took:.3f} s, {left} tensor(s) still held", flush=True)
