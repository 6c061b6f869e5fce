#!/usr/bin/env python
"""Every collective and implementation, 4 bytes to 64 MiB: time and bus bandwidth.

Bus bandwidth as NCCL's tests define it: ``algbw = S / time`` with ``S`` the bytes of the
full tensor (all-reduce, broadcast, reduce: the tensor; all-gather, gather: the output;
reduce-scatter, scatter: the input; all-to-all: what one replica sends), and
``busbw = algbw * factor`` with factor ``2 (n-1)/n`` for all-reduce, ``(n-1)/n`` for
all-gather, reduce-scatter, all-to-all, gather and scatter, ``1`` for broadcast and reduce.

- **in-process** (``MirroredStrategy`` on ``--replicas`` logical CPU devices, one process):
  every implementation (``HierarchicalCopyAllReduce``, ``ReductionToOneDevice``,
  ``RingAllReduce``, and the reference plug-in ``CrossDeviceOps()``) against the physical
  reference, one single-thread ``memcpy`` of ``S`` bytes (``dst.copy_(src)``), and the ring
  against the others (``ring/hier``). Collectives that do not reduce are the same for
  every implementation and are measured once.
- **across processes** (``MultiWorkerMirroredStrategy``, ``--workers`` processes over gloo
  on loopback, one replica each): ``sg.get_replica_context().<collective>`` against
  torch.distributed's own call *in the same processes*, on the same group, timed in
  alternating blocks (ABBA); ``torch/ours`` is our bus bandwidth as a fraction of torch's.
  torch's calls write into preallocated buffers (all-reduce in place), ours return new
  tensors, as the API promises; for all-reduce and broadcast, ``ours/torch+copy`` also
  compares with torch making that copy (``clone`` then ``all_reduce``; ``broadcast`` then
  ``clone`` on the source).

Each block times ``reps`` calls (at least ``--min-block-s`` seconds); the median over
blocks is reported; across processes, a block's time is the slowest rank's. Every child
runs with ``MALLOC_MMAP_THRESHOLD_`` raised (unless ``--keep-malloc``): otherwise each
large fresh buffer costs a page fault per 4 KiB, on both sides alike.

    python benchmarks/collectives.py            # 4 B .. 8 MiB in x8 steps, and 64 MiB
    python benchmarks/collectives.py --quick    # 4 B, 64 KiB, 4 MiB: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter"]
REDUCING = {"all_reduce"}  # in-process: the only one the cross-device op carries
IMPLEMENTATIONS = ["hierarchical", "one_device", "ring", "plugin"]


def bus_factor(name: str, n: int) -> float:
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


def sizes_for(args: argparse.Namespace) -> list[int]:
    sizes = [4, 64 << 10, 4 << 20] if args.quick else [4 << (3 * k) for k in range(8)] + [64 << 20]
    return [s for s in sizes if s >= args.min_size]  # 4 B, 32 B, ... 8 MiB, then 64 MiB


def calls(ctx: Any, torch: Any, n: int, size: int) -> dict[str, Callable[[], Any]]:
    """Our collectives on ``S = size`` bytes (float32), as defined in the module docstring."""
    r = ctx.replica_id_in_sync_group
    elems = max(size // 4, n)
    full = torch.ones(elems - elems % n or n)
    part = full[: full.numel() // n].clone()
    pieces = list(full.chunk(n))
    return {
        "all_reduce": lambda: ctx.all_reduce("sum", full),
        "all_gather": lambda: ctx.all_gather(part, axis=0),
        "reduce_scatter": lambda: ctx.reduce_scatter("sum", full, axis=0),
        "broadcast": lambda: ctx.broadcast(full, source_replica=0),
        "reduce": lambda: ctx.reduce("sum", full, destination_replica=0),
        "all_to_all": lambda: ctx.all_to_all(pieces),
        "gather": lambda: ctx.gather(part, axis=0, destination_replica=0),
        "scatter": lambda: ctx.scatter(pieces if r == 0 else None, source_replica=0),
    }


def reps_for(size: int, args: argparse.Namespace) -> int:
    return max(3, min(200, int(args.min_block_s * 2e9 / max(size, 1 << 12) / 8)))


# ============================================================ in-process child

def inprocess_main(args: argparse.Namespace) -> dict:
    import torch

    import stratagem as sg

    n = args.replicas
    ops = {"hierarchical": sg.HierarchicalCopyAllReduce(), "one_device": sg.ReductionToOneDevice(),
           "ring": sg.RingAllReduce(), "plugin": sg.CrossDeviceOps()}
    strategies = {name: sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=op)
                  for name, op in ops.items()}
    rows = []
    for size in sizes_for(args):
        reps = reps_for(size, args)
        src, dst = torch.ones(max(size // 4, 1)), torch.empty(max(size // 4, 1))

        def block(call: Callable[[], Any]) -> float:
            start = time.perf_counter()
            for _ in range(reps):
                call()
            return (time.perf_counter() - start) / reps

        for name in COLLECTIVES:
            for impl in IMPLEMENTATIONS if name in REDUCING else ["hierarchical"]:
                strategy = strategies[impl]

                def fn(name=name):
                    ctx = sg.get_replica_context()
                    call = calls(ctx, torch, n, size)[name]
                    call()  # warm-up
                    times, copies = [], []
                    for _ in range(args.blocks):  # the memcpy reference in the same blocks, paired
                        first = ctx.replica_id_in_sync_group == 0  # (the others wait in the collective)
                        copies.append(block(lambda: dst.copy_(src)) if first else 0.0)
                        times.append(block(call))
                    return {"times": times, "copies": copies}

                with torch.no_grad():
                    measured = strategy.run(fn)
                times, copies = ([strategy.experimental_local_results(v)[0] for v in measured[key]]
                                 for key in ("times", "copies"))  # replica 0's
                rows.append({"size": size, "collective": name, "impl": impl, "s": h.median(times),
                             "memcpy_s": h.median(copies),
                             "memcpy_ratio": h.median([c / t for c, t in zip(copies, times)])})
        h.log(f"in-process {size} B done")
    return {"replicas": n, "rows": rows}


# ============================================================ worker child

def worker_main(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    import stratagem as sg

    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=120))
    n, rank = strategy.num_replicas_in_sync, strategy.cluster_resolver.worker_rank
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    for size in sizes_for(args):
        reps = reps_for(size, args)
        elems = max(size // 4, n)
        full = torch.ones(elems - elems % n or n)
        part = full[: full.numel() // n].clone()
        out_full, out_part = torch.empty_like(full), torch.empty_like(part)
        parts = [torch.empty_like(part) for _ in range(n)]
        theirs = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: gather_single(out_full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out_part, full),
            "broadcast": lambda: dist.broadcast(full, src=0),
            "reduce": lambda: dist.reduce(full, dst=0),
            "all_to_all": lambda: dist.all_to_all_single(out_full, full),
            "gather": lambda: dist.gather(part, parts if rank == 0 else None, dst=0),
            "scatter": lambda: dist.scatter(out_part, parts if rank == 0 else None, src=0),
        }
        # torch with the copy our API makes (a new result tensor, the input untouched)
        with_copy = {
            "all_reduce": lambda: dist.all_reduce(full.clone()),
            "broadcast": lambda: (dist.broadcast(full, src=0), full.clone() if rank == 0 else None),
        }

        def measure(call: Callable[[], Any]) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                call()
            seconds = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return seconds.item()

        def fn():
            ours = calls(sg.get_replica_context(), torch, n, size)
            result = {}
            for name in COLLECTIVES:
                ours[name](), theirs[name]()  # warm-up
                contenders = {"ours": ours[name], "torch": theirs[name]}
                if name in with_copy:
                    contenders["torch_copy"] = with_copy[name]
                times: dict[str, list[float]] = {who: [] for who in contenders}
                for b in range(args.blocks):  # rotated from block to block
                    order = list(contenders)[b % len(contenders):] + list(contenders)[:b % len(contenders)]
                    for who in order:
                        times[who].append(measure(contenders[who]))
                result[name] = {who: h.median(t) for who, t in times.items()}
            return result

        with torch.no_grad():
            measured = strategy.run(fn)
        for name, t in measured.items():
            rows.append({"size": size, "collective": name, "ours_s": t["ours"], "torch_s": t["torch"],
                         "torch_copy_s": t.get("torch_copy")})
        if rank == 0:
            h.log(f"across processes {size} B done")
    return {"workers": n, "rows": rows} if rank == 0 else None


# ============================================================ parent

def gbps(size: int, seconds: float, factor: float) -> float:
    return size / seconds * factor / 1e9 if seconds > 0 else float("nan")


def child_cmd(args: argparse.Namespace, child: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", child, "--replicas", str(args.replicas),
           "--blocks", str(args.blocks), "--min-block-s", str(args.min_block_s), "--min-size", str(args.min_size)]
    return cmd + (["--quick"] if args.quick else [])


def run_workers(args: argparse.Namespace, env: dict) -> dict:
    from stratagem.testing import run_local_cluster

    script = os.path.abspath(__file__)
    results = run_local_cluster(script, args.workers, args=child_cmd(args, "worker")[2:], timeout=args.timeout,
                                env=env)
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"{r.task} failed:\n{r.output[-4000:]}")
    for line in results[0].output.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result from the chief:\n{results[0].output[-2000:]}")


def report(inproc: dict | None, workers: dict | None) -> str:
    out = []
    if inproc:
        n = inproc["replicas"]
        rows = []
        by_key = {(r["size"], r["collective"], r["impl"]): r for r in inproc["rows"]}
        for r in inproc["rows"]:
            factor = bus_factor(r["collective"], n)
            ring = by_key.get((r["size"], r["collective"], "ring"))
            hier = by_key.get((r["size"], r["collective"], "hierarchical"))
            rows.append([r["collective"], r["impl"], _size(r["size"]), f"{r['s'] * 1e6:.1f}",
                         f"{gbps(r['size'], r['s'], factor):.3f}", f"{r['memcpy_ratio']:.2f}",
                         f"{hier['s'] / ring['s']:.2f}" if ring and hier and r["impl"] == "ring" else ""])
        out.append(f"in-process, MirroredStrategy on {n} logical CPU devices")
        out.append(h.format_table(["collective", "impl", "S", "time us", "busbw GB/s", "memcpy/ours (time)",
                                   "hier/ring (time)"], rows))
    if workers:
        n = workers["workers"]
        rows = []
        for r in workers["rows"]:
            factor = bus_factor(r["collective"], n)
            ours, theirs = gbps(r["size"], r["ours_s"], factor), gbps(r["size"], r["torch_s"], factor)
            copy = r.get("torch_copy_s")
            rows.append([r["collective"], _size(r["size"]), f"{r['ours_s'] * 1e6:.1f}", f"{r['torch_s'] * 1e6:.1f}",
                         f"{ours:.3f}", f"{theirs:.3f}", f"{ours / theirs:.2f}",
                         f"{copy / r['ours_s']:.2f}" if copy else ""])
        out.append(f"across {n} processes (gloo, loopback), ours vs torch.distributed in the same processes")
        out.append(h.format_table(["collective", "S", "ours us", "torch us", "ours busbw GB/s",
                                   "torch busbw GB/s", "ours/torch (busbw)", "ours/torch+copy"], rows))
    return "\n\n".join(out)


def _size(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 sizes, 2 blocks: a smoke test")
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU devices in-process (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="processes across (default 2)")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per measurement (default 4)")
    parser.add_argument("--min-block-s", type=float, default=0.05, help="rough seconds per block")
    parser.add_argument("--only", choices=["inprocess", "workers"], help="run one half only")
    parser.add_argument("--min-size", type=int, default=0, help="skip sizes below this many bytes")
    parser.add_argument("--keep-malloc", action="store_true", help="leave glibc's mmap threshold as it is")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="write the raw measurements here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.blocks = min(args.blocks, 2)
    if args.child == "inprocess":
        print(json.dumps(inprocess_main(args)))
        return 0
    if args.child == "worker":
        result = worker_main(args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return 0
    env = h.child_env() if hasattr(h, "child_env") else dict(os.environ)
    if not args.keep_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 30)
        env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 30)
    inproc = workers = None
    if args.only in (None, "inprocess"):
        done = subprocess.run(child_cmd(args, "inprocess"), env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        inproc = json.loads(done.stdout.strip().splitlines()[-1])
    if args.only in (None, "workers"):
        workers = run_workers(args, env)
    print(report(inproc, workers))
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inprocess": inproc, "workers": workers, "commit": h.git_commit()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
