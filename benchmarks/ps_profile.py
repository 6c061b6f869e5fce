#!/usr/bin/env python
"""Where a parameter-server step's time goes: one worker's steps against real ps processes.

The worker is this process: a :class:`~stratagem.ps.runtime.WorkerRuntime` with local copies of
the model's variables, running the step a scheduled closure runs (pull, forward, backward,
``optimizer.step()`` = push), in this thread, under cProfile. Each ps is a ``ParameterServer``
behind an ``RpcServer`` in a spawned process, every handler thread under cProfile too. Printed:
counts that do not depend on the machine's load -- RPC calls and bytes per step, per method
(the servers' wire counters) -- then both profiles' top functions by own time.

    python benchmarks/ps_profile.py mlp --ps 1 --steps 50
    python benchmarks/ps_profile.py emb --ps 2 --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import secrets
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402


def ps_main(token: str, name: str, ready: Any, stop: Any, out: Any) -> None:
    """A ps task: every handler thread profiled; the merged profile goes to ``out`` on stop."""
    import torch

    from stratagem.ps.server import _keep_large_buffers
    from stratagem.ps.service import ParameterServer
    from stratagem.rpc import RpcServer

    torch.set_num_threads(1)
    _keep_large_buffers()
    profiles: list[cProfile.Profile] = []

    def hook(*_: Any) -> None:   # the first event of a new thread starts its own profiler
        sys.setprofile(None)
        prof = cProfile.Profile(time.thread_time)   # CPU time, not waiting
        profiles.append(prof)
        prof.enable()

    threading.setprofile(hook)
    server = RpcServer("127.0.0.1:0", ParameterServer(name=name).handlers(), token, name=name).start()
    ready.send(server.address)
    stop.recv()
    for prof in profiles:
        prof.disable()
    text = io.StringIO()
    stats = None
    for prof in profiles:
        if prof.getstats():
            stats = pstats.Stats(prof, stream=text) if stats is None else stats.add(prof)
    if stats is not None:
        stats.sort_stats("tottime").print_stats(25)
    out.send(text.getvalue())
    server.stop(None)


def build(kind: str, num_ps: int, runtime: Any) -> tuple[Any, Any, Any]:
    """The model as a worker holds it (local copies), its variables created on the ps, the
    worker's optimizer, and a batch function."""
    import torch
    from torch import nn

    from stratagem.ps.embedding import PSEmbedding
    from stratagem.ps.runtime import WorkerOptimizer
    from stratagem.ps.variables import RemoteVariable, Shard

    torch.manual_seed(0)
    if kind == "mlp":
        model = h.mlp()
        spec = (torch.optim.SGD, {"lr": h.LR, "momentum": h.MOMENTUM})
    else:
        class EmbeddingModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embedding = nn.Embedding(1_000_000, 64)
                self.head = nn.Linear(64, 10)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.head(self.embedding(ids).mean(dim=1))
        model = EmbeddingModel()
        model.embedding.__class__ = PSEmbedding
        spec = (torch.optim.SGD, {"lr": 0.1})
    var_ids = []
    for i, (module_name, module) in enumerate(model.named_modules()):
        for name, tensor in list(module._parameters.items()):
            var_id = f"{i}/{module_name}.{name}"
            rows = tensor.shape[0]
            cut = [0, *([rows // 2] if num_ps > 1 else []), rows]
            shards = tuple(Shard(f"{var_id}/part_{j}", j, a, b) for j, (a, b) in enumerate(zip(cut, cut[1:])))
            remote = RemoteVariable(var_id, tuple(tensor.shape), tensor.dtype, shards,
                                    row_sparse=isinstance(module, nn.Embedding))
            for shard in shards:
                runtime.ps[shard.ps].call("create", var_id=shard.shard_id, value=shard.of(tensor.detach()).clone(),
                                          optimizer_spec=spec)
            module._parameters[name] = runtime.local_parameter(remote, True)
            var_ids.append(var_id)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        xs, ys = torch.randn(8, 64, 784, generator=g), torch.randint(0, 10, (8, 64), generator=g)
        batch = lambda i: (xs[i % 8], ys[i % 8])   # noqa: E731
    else:
        batch = lambda i: (torch.randint(0, 1_000_000, (64, 8), generator=g),   # noqa: E731
                           torch.randint(0, 10, (64,), generator=g))
    return model, WorkerOptimizer(runtime, var_ids), batch, var_ids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["mlp", "emb"])
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true", help="time only (no cProfile)")
    p.add_argument("--no-prefetch", action="store_true", help="pull before every step (no values from the push)")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    from stratagem.ps.runtime import WorkerRuntime
    from stratagem.ps.server import _keep_large_buffers
    from stratagem.rpc.transport import STATS_METHOD

    torch.set_num_threads(1)
    _keep_large_buffers()
    token = secrets.token_urlsafe(32)
    ctx = mp.get_context("spawn")
    servers = []
    for i in range(args.ps):
        ready_r, ready_w = ctx.Pipe(False)
        stop_r, stop_w = ctx.Pipe(False)
        out_r, out_w = ctx.Pipe(False)
        proc = ctx.Process(target=ps_main, args=(token, f"ps {i}", ready_w, stop_r, out_w), daemon=True)
        proc.start()
        servers.append((proc, ready_r.recv(), stop_w, out_r))
    runtime = WorkerRuntime([s[1] for s in servers], token, num_workers=1, worker_index=0)
    model, optimizer, batch, var_ids = build(args.kind, args.ps, runtime)

    losses = []

    def step(i: int) -> None:
        runtime.pull_dense(var_ids, writes=None if args.no_prefetch else 0)   # (as a run with no coordinator writes)
        runtime.begin_closure(None)
        x, y = batch(i)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))

    for i in range(args.warmup):
        step(i)
    before = [c.rpc.call(STATS_METHOD) for c in runtime.ps]
    ps_cpu = [h._cpu_s_of(proc.pid) for proc, *_ in servers]
    prof = cProfile.Profile(time.thread_time)   # CPU time of the step's thread, not waiting
    t0, c0 = time.perf_counter(), time.process_time()
    if not args.no_profile:
        prof.enable()
    for i in range(args.steps):
        step(args.warmup + i)
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = [c.rpc.call(STATS_METHOD) for c in runtime.ps]
    ps_cpu = [h._cpu_s_of(proc.pid) - cpu0 for (proc, *_), cpu0 in zip(servers, ps_cpu)]
    print(f"{args.kind}, {args.ps} ps, {args.steps} steps: {1e3 * wall / args.steps:.2f} ms/step wall, "
          f"{1e3 * cpu / args.steps:.2f} ms/step worker CPU, "
          f"{', '.join(f'{1e3 * c / args.steps:.2f}' for c in ps_cpu)} ms/step ps CPU, load {h.loadavg()}; loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}")
    rows = []
    for i, (b, a) in enumerate(zip(before, after)):
        for method, counts in sorted(a["methods"].items()):
            old = b["methods"].get(method, {"calls": 0, "bytes_in": 0, "bytes_out": 0})
            calls = counts["calls"] - old["calls"]
            if calls and method != STATS_METHOD:
                rows.append([f"ps {i}", method, f"{calls / args.steps:.2f}",
                             f"{(counts['bytes_in'] - old['bytes_in']) / args.steps / 1024:.1f}",
                             f"{(counts['bytes_out'] - old['bytes_out']) / args.steps / 1024:.1f}"])
    print(h.format_table(["task", "method", "calls/step", "KiB in/step", "KiB out/step"], rows))
    if not args.no_profile:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\n=== worker (this process, the step's thread) ===\n" + text.getvalue())
    for proc, _, stop_w, out_r in servers:
        stop_w.send(None)
    for i, (proc, _, stop_w, out_r) in enumerate(servers):
        if not args.no_profile:
            print(f"\n=== ps {i} (all handler threads) ===\n" + out_r.recv())
        proc.join(10)
    runtime_close = [c.close() for c in runtime.ps]
    del runtime_close
    print(" ".join(f"{v:.6f}" for v in losses[-3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
