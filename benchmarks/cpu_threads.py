#!/usr/bin/env python
"""What two replica threads can get from the cores, against torch's own intra-op threads.

``MirroredStrategy`` on logical CPU devices runs each replica on a thread of its own with one
intra-op thread, each on half the batch; plain PyTorch runs the whole batch with its intra-op
threads. Before blaming the strategy for a ratio to plain PyTorch, this measures the floor that
the cores themselves set: the MLP of the benchmarks (784-1024-1024-10), forward and backward
matrix products only (no optimizer, no exchange, nothing of stratagem), as

- ``intra-op``: one Python thread, ``torch.set_num_threads(2)``, the whole batch;
- ``one thread``: one Python thread, one intra-op thread, the whole batch;
- ``2 replica threads``: two Python threads at once, one intra-op thread each, half the batch each
  (what Mirrored(2)'s replicas compute, with no synchronisation but the final join).

Medians of ``--rounds`` rounds (interleaved), each the mean over ``--steps`` steps::

    python benchmarks/cpu_threads.py
    python benchmarks/cpu_threads.py --batch 512 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128, help="global batch (each replica thread: half)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    import torch

    torch.manual_seed(0)
    layers = [torch.randn(o, i, requires_grad=True) for i, o in ((784, 1024), (1024, 1024), (1024, 10))]

    def work(x: torch.Tensor) -> None:
        for _ in range(args.steps):
            out = x
            for k, w in enumerate(layers):
                out = out @ w.T
                if k < len(layers) - 1:
                    out = torch.relu(out)
            out.sum().backward()

    whole, half = torch.randn(args.batch, 784), torch.randn(args.batch // 2, 784)

    def intra_op() -> None:
        torch.set_num_threads(2)
        work(whole)

    def one_thread() -> None:
        torch.set_num_threads(1)
        work(whole)

    def replica_threads() -> None:
        torch.set_num_threads(1)
        threads = [threading.Thread(target=work, args=(half,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    configs = {"intra-op (2 threads, whole batch)": intra_op, "one thread, whole batch": one_thread,
               "2 replica threads x 1 thread, half batch each": replica_threads}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for fn in configs.values():   # warm-up: allocator, OpenMP pool
        fn()
    for r in range(args.rounds):
        names = list(configs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            configs[name]()
            times[name].append((time.perf_counter() - start) * 1e3 / args.steps)
    base = statistics.median(times["intra-op (2 threads, whole batch)"])
    rows = [[name, f"{statistics.median(ms):.2f}", f"{min(ms):.2f}-{max(ms):.2f}", f"{statistics.median(ms) / base:.2f}"]
            for name, ms in times.items()]
    print(f"forward + backward matrix products of the MLP, batch {args.batch}; {args.rounds} rounds x "
          f"{args.steps} steps; {os.cpu_count()} cores; load {h.loadavg():.2f}")
    print(h.format_table(["configuration", "median ms", "range", "x intra-op"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
