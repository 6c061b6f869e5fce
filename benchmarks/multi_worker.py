#!/usr/bin/env python
"""MultiWorkerMirroredStrategy against PyTorch's DistributedDataParallel, side by side.

Two worker processes on this machine, gloo over loopback, one intra-op thread per
process (``torch.set_num_threads(1)``), the same model, the same global batch (128 =
64 per rank), SGD (lr 0.01, momentum 0.9), trained on synthetic data (a few distinct
pre-generated global batches, cycled):

- ``DDP``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults (25 MiB
  buckets, 1 MiB first bucket), process group initialised with ``tcp://`` on a free
  port, rank and world size passed on the command line, a 60 s timeout. Each rank
  keeps its 64-row slice of every global batch (what a ``DistributedSampler`` gives),
  loss ``F.cross_entropy`` (mean; DDP averages the gradients over ranks).
- ``ours``: ``sg.MultiWorkerMirroredStrategy(communication_options=
  sg.CommunicationOptions(timeout_seconds=60))`` (default packs), started with
  TF_CONFIG. Every worker passes the *list of global batches* to
  ``strategy.experimental_distribute_dataset``, which keeps this worker's slice
  (TensorFlow's usual input pattern; the slicing happens inside the timed step),
  and the step is ``strategy.run(step, args=(next(iterator),))`` with
  ``sg.nn.compute_average_loss(F.cross_entropy(..., reduction="none"))``.

Models: the MLP 784-1024-1024-10 (1.9 M parameters) and 784-4096-4096-1024-10 (24 M).

All-reduce bandwidth at 64 MiB (16 Mi float32) between the 2 processes, reported as
bus bandwidth ``2 (n-1)/n * bytes / time`` (= bytes / time for n = 2):

- ``raw gloo``: ``dist.all_reduce`` of a 64 MiB tensor, nothing else.
- ``ours: GradientPacks.finish``: the strategy's own gradient path, timed directly:
  ``stratagem.comm.gradients.GradientPacks`` over one 16 Mi-float parameter with a
  gradient, built as the strategy builds it (its ``WorkerGroup``, its
  ``bytes_per_pack``) but with ``overlap=False``, so that ``finish()`` does all the
  work: copy the gradient into the pack, all-reduce, copy the sum back into ``.grad``.
  This is the number checked against the target. Inside the same processes, op by
  op, a raw ``dist.all_reduce`` is alternated with ``finish()`` and with its two
  pieces (the pack buffer's all-reduce through the WorkerGroup, and the two local
  copies): the same check, less exposed to other processes' load, and where the
  time goes.
- ``ours: strategy.run step - local step``: end to end through ``strategy.run`` with a
  model whose only parameter has 16 Mi floats and a trivial loss (``w.sum()``): the
  median step time minus the median of the identical step without a strategy, in
  the same process (a difference of two noisy medians: for information).

Every measured configuration runs in two fresh worker processes (nothing leaks from
one configuration into the next); each worker does warm-up steps, then timed steps,
and writes its timings to a JSON file that the parent reads. Configurations are
interleaved round by round (DDP / ours alternating, in a rotating order) so that slow
drifts of this shared machine hit both alike; the ratio ours / DDP is taken per
round and the median over rounds is reported. Every child has a deadline and both
ranks' process groups are killed when one fails or the deadline passes.

Because a shared 2-core machine is noisy at the scale of seconds, three more views
of the same comparison are printed: the ratio of the best rounds (others' load only
adds time), the CPU time per step of both ranks (all threads, gloo's included: what
the step costs, whoever else runs), and, unless ``--no-interleaved``, DDP and ours
built side by side in the same two processes (DDP on the default process group, the
strategy on its own gloo group) and timed in alternating blocks of steps.

    python benchmarks/multi_worker.py                    # full run, a few minutes on 2 cores
    python benchmarks/multi_worker.py --quick            # smoke test, < 90 s
    python benchmarks/multi_worker.py --json out.json    # also write every raw measurement
    python benchmarks/multi_worker.py --profile          # where each step's time goes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (REPO_ROOT, CpuWindow, _cpu_sample, format_table, git_state, loadavg, median,  # noqa: E402
                     percentile, synthetic_batches, usable_cores)

SCRIPT = os.path.abspath(__file__)
WORLD = 2
GLOBAL_BATCH = 128
LR, MOMENTUM = 0.01, 0.9
TIMEOUT_S = 60.0                      # gloo / CommunicationOptions timeout in the workers
BW_FLOATS = 16 * 2**20                # 64 MiB of float32
MODELS: dict[str, tuple[int, ...]] = {
    "small": (784, 1024, 1024, 10),
    "large": (784, 4096, 4096, 1024, 10),
}
STEP_TARGET = 1.05                    # ours / DDP step time, at most
BW_TARGET = 0.90                      # ours / raw gloo bus bandwidth, at least
AB_BLOCK = 5                          # steps per block in the interleaved (same processes) comparison


def param_count(layers: tuple[int, ...]) -> int:
    return sum(i * o + o for i, o in zip(layers[:-1], layers[1:]))


# =================================================================== workers
# A worker is one rank of one measurement. It writes one JSON object to --out.

def _setup_threads() -> None:
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # only possible before inter-op work started
        torch.set_num_interop_threads(1)


def _mlp(layers: tuple[int, ...]):
    import torch

    mods: list = []
    for i, (n_in, n_out) in enumerate(zip(layers[:-1], layers[1:])):
        mods.append(torch.nn.Linear(n_in, n_out))
        if i < len(layers) - 2:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _global_batches(distinct: int, seed: int):
    """``distinct`` global batches, identical on every rank (same seed)."""
    import torch

    x_np, y_np = synthetic_batches(GLOBAL_BATCH, distinct, seed=seed)
    return [(torch.from_numpy(x_np[i]), torch.from_numpy(y_np[i])) for i in range(distinct)]


def _init_gloo(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _strategy():
    import stratagem as sg

    return sg.MultiWorkerMirroredStrategy(
        communication_options=sg.CommunicationOptions(timeout_seconds=TIMEOUT_S))


class _Phases:
    """Accumulates wall time per named phase (profile mode only)."""

    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.totals[name] = self.totals.get(name, 0.0) + seconds
            self.counts[name] = self.counts.get(name, 0) + 1

    @contextlib.contextmanager
    def time(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        clock = self

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                clock.add(name, time.perf_counter() - t0)
        setattr(owner, attr, wrapper)


def _timed_loop(one_step: Callable[[int], Any], warmup: int, steps: int, clock: _Phases | None = None) -> dict:
    for i in range(warmup):
        one_step(i)
    gc.collect()
    if clock is not None:
        clock.enabled = True
    times, cpu = [], []
    with CpuWindow() as window:
        for i in range(warmup, warmup + steps):
            c0 = time.process_time()   # CPU time of every thread of this process (gloo's included)
            t0 = time.perf_counter()
            one_step(i)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if clock is not None:
        clock.enabled = False
    return {"step_ms": [1e3 * t for t in times], "cpu_ms": [1e3 * c for c in cpu],
            "own_cores": window.own_cores, "window_s": window.seconds}


def _build_ddp(rank: int, layers: tuple[int, ...], batches: list, seed: int, clock: _Phases | None):
    """DDP over the default process group: the model and ``one_step(i)``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    distinct = len(batches)
    per_rank = GLOBAL_BATCH // WORLD
    torch.manual_seed(seed)
    model = _mlp(layers)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    # this rank's rows of every global batch: what a DistributedSampler would hand it
    local = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
             for x, y in batches]

    if clock is None:
        def one_step(i: int) -> None:
            x, y = local[i % distinct]
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        def one_step(i: int) -> None:
            x, y = local[i % distinct]
            with clock.time("forward + loss"):
                loss = F.cross_entropy(ddp(x), y)
            with clock.time("zero_grad"):
                opt.zero_grad()
            with clock.time("backward (DDP: incl. bucket copy-in, all-reduce, wait, copy-out)"):
                loss.backward()
            with clock.time("optimizer.step (SGD only)"):
                opt.step()
    return model, one_step


def _build_ours(layers: tuple[int, ...], batches: list, seed: int, total: int, clock: _Phases | None):
    """MultiWorkerMirroredStrategy (TF_CONFIG): the strategy, the model and ``one_step(i)``."""
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    distinct = len(batches)
    strategy = _strategy()
    torch.manual_seed(seed)
    with strategy.scope():
        model = _mlp(layers)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    # references to the `distinct` global batches: cycling costs no memory
    dist_data = strategy.experimental_distribute_dataset([batches[i % distinct] for i in range(total)])
    iterator = iter(dist_data)

    if clock is None:
        def step(batch: Any) -> Any:
            x, y = batch
            loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        def one_step(i: int) -> None:
            strategy.run(step, args=(next(iterator),))
    else:
        _instrument_ours(clock)

        def step(batch: Any) -> Any:
            x, y = batch
            with clock.time("forward + loss"):
                loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            with clock.time("zero_grad"):
                opt.zero_grad()
            with clock.time("backward (ours: incl. hooks = pack copy-in + async launch)"):
                loss.backward()
            with clock.time("optimizer.step (ours: finish() + SGD)"):
                opt.step()
            return loss

        def one_step(i: int) -> None:
            with clock.time("next(iterator): input split"):
                batch = next(iterator)
            with clock.time("strategy.run (total)"):
                strategy.run(step, args=(batch,))
    return strategy, model, one_step


def _final_loss(model: Any, batches: list) -> float:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():   # for ours, outside run the module reads its primary copy
        return float(F.cross_entropy(model(batches[0][0]), batches[0][1]))


def train_worker(config: str, rank: int, port: int, model_name: str, steps: int, warmup: int, distinct: int,
                 seed: int, profile: bool) -> dict:
    _setup_threads()
    import torch
    import torch.distributed as dist

    import stratagem  # noqa: F401  - both configurations load the same modules

    layers = MODELS[model_name]
    batches = _global_batches(distinct, seed)
    result: dict[str, Any] = {"config": config, "model": model_name, "rank": rank, "pid": os.getpid(),
                              "torch_version": torch.__version__}
    clock = _Phases() if profile else None

    if config == "ddp":
        _init_gloo(rank, port)
        model, one_step = _build_ddp(rank, layers, batches, seed, clock)
        result.update(_timed_loop(one_step, warmup, steps, clock))
        result["threads"] = torch.get_num_threads()
        dist.barrier()
        result["final_loss"] = _final_loss(model, batches)
        dist.destroy_process_group()
    elif config == "ours":
        strategy, model, one_step = _build_ours(layers, batches, seed, warmup + steps, clock)
        result["strategy"] = repr(strategy)
        result.update(_timed_loop(one_step, warmup, steps, clock))
        result["threads"] = torch.get_num_threads()
        strategy._group.all_gather_object(None, "benchmark end")  # a barrier
        result["final_loss"] = _final_loss(model, batches)
    elif config == "ab":
        # DDP and ours in the same two processes, alternating blocks of steps (ABBA order),
        # so that other processes' load hits both alike. DDP owns the default process group;
        # the strategy, finding torch.distributed initialised, makes its own gloo group.
        _init_gloo(rank, port)
        ddp_model, ddp_step = _build_ddp(rank, layers, batches, seed, None)
        strategy, ours_model, ours_step = _build_ours(layers, batches, seed, warmup + steps, None)
        result["strategy"] = repr(strategy)
        fns = {"ddp": ddp_step, "ours": ours_step}
        for i in range(warmup):
            ddp_step(i)
            ours_step(i)
        gc.collect()
        block = AB_BLOCK
        times: dict[str, list[float]] = {"ddp": [], "ours": []}
        cpu: dict[str, list[float]] = {"ddp": [], "ours": []}
        done = {"ddp": 0, "ours": 0}
        b = 0
        while min(done.values()) < steps:
            order = ("ddp", "ours") if b % 4 in (0, 3) else ("ours", "ddp")
            b += 1
            for name in order:
                n = min(block, steps - done[name])
                dist.barrier()
                for _ in range(n):
                    i = warmup + done[name]
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    fns[name](i)
                    times[name].append(1e3 * (time.perf_counter() - t0))
                    cpu[name].append(1e3 * (time.process_time() - c0))
                    done[name] += 1
        result.update({"ddp_step_ms": times["ddp"], "ours_step_ms": times["ours"],
                       "ddp_cpu_ms": cpu["ddp"], "ours_cpu_ms": cpu["ours"]})
        result["threads"] = torch.get_num_threads()
        dist.barrier()
        result["final_loss_ddp"] = _final_loss(ddp_model, batches)
        result["final_loss_ours"] = _final_loss(ours_model, batches)
        dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown config {config!r}")

    if clock is not None:
        result["phases_ms_per_step"] = {k: 1e3 * v / steps for k, v in clock.totals.items()}
        result["calls_per_step"] = {k: c / steps for k, c in clock.counts.items()}
    return result


def _instrument_ours(clock: _Phases) -> None:
    """Time the gradient path's pieces (pack copy-in, launch, wait, copy-out)."""
    from stratagem.cluster import process_group
    from stratagem.comm import gradients
    from stratagem.strategies import local, multi_worker

    clock.wrap(gradients._Pack, "fill", "  pack.fill (grad -> pack copy-in, per parameter)")
    clock.wrap(gradients.GradientPacks, "_on_grad", "  backward hook _on_grad (fill + launch)")
    clock.wrap(gradients.GradientPacks, "finish", "  GradientPacks.finish (total)")
    clock.wrap(process_group.WorkerGroup, "wait", "    WorkerGroup.wait (all-reduce still in flight)")
    clock.wrap(process_group.WorkerGroup, "all_reduce_async", "  WorkerGroup.all_reduce_async (launch)")
    clock.wrap(process_group.WorkerGroup, "all_reduce", "  WorkerGroup.all_reduce (blocking; expected 0)")
    clock.wrap(process_group.WorkerGroup, "all_gather_object", "  WorkerGroup.all_gather_object (expected 0)")
    clock.wrap(multi_worker.MultiWorkerMirroredStrategy, "_cross_worker_gradients",
               "  _cross_worker_gradients (finish + bookkeeping)")
    clock.wrap(local.LocalStrategy, "_optimizer_step", "  LocalStrategy._optimizer_step (total)")
    clock.wrap(local, "_call_in_replica", "  _call_in_replica (the step fn + context push/pop)")


def bandwidth_worker(config: str, rank: int, port: int, steps: int, warmup: int) -> dict:
    _setup_threads()
    import torch

    result: dict[str, Any] = {"config": config, "rank": rank, "pid": os.getpid(), "bytes": BW_FLOATS * 4,
                              "torch_version": torch.__version__}
    if config == "bw_raw":
        import torch.distributed as dist

        _init_gloo(rank, port)
        buf = torch.ones(BW_FLOATS)
        times = []
        for i in range(warmup + steps):
            if i % 16 == 0:
                buf.fill_(1.0)   # keep the values finite
            dist.barrier()       # start each op together on both ranks (as the bw_ours loop does)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        result["op_ms"] = [1e3 * t for t in times]
        dist.destroy_process_group()
        return result

    if config != "bw_ours":
        raise SystemExit(f"unknown config {config!r}")
    import torch.nn.functional  # noqa: F401

    import stratagem as sg
    from stratagem.comm.gradients import GradientPacks

    strategy = _strategy()
    result["strategy"] = repr(strategy)

    # (1) the gradient path itself: GradientPacks.finish() with overlap=False. In the same
    #     processes and interleaved with it, iteration by iteration (so that other processes'
    #     load hits all alike): a raw dist.all_reduce of a plain 64 MiB tensor, the pack's own
    #     buffer all-reduced through the strategy's WorkerGroup (async + wait, as finish does),
    #     and the local copies finish makes (into the pack and back to .grad).
    import torch.distributed as dist

    group = strategy._group
    param = torch.nn.Parameter(torch.zeros(BW_FLOATS))
    param.grad = torch.ones(BW_FLOATS)
    packs = GradientPacks([param], group, bytes_per_pack=strategy._options.bytes_per_pack, overlap=False)
    result["packs"] = [int(p.buffer.numel()) for p in packs.packs]
    buffer = packs.packs[0].buffer
    plain = torch.ones(BW_FLOATS)

    def copies() -> None:
        buffer[:BW_FLOATS].copy_(param.grad)
        param.grad.copy_(buffer[:BW_FLOATS])

    ops: dict[str, Callable[[], Any]] = {
        "op_ms": packs.finish,
        "same_process_raw_ms": lambda: dist.all_reduce(plain, group=group.group),
        "pack_buffer_allreduce_ms": lambda: group.wait(group.all_reduce_async(buffer)),
        "copy_in_out_ms": copies,
    }
    names = list(ops)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + steps):
        if i % 16 == 0:   # keep the values finite
            param.grad.fill_(1.0)
            plain.fill_(1.0)
            buffer.fill_(1.0)
        for name in names[i % len(names):] + names[:i % len(names)]:
            group.all_gather_object(None, "sync")   # start each op together on both ranks
            t0 = time.perf_counter()
            ops[name]()
            if i >= warmup:
                timings[name].append(1e3 * (time.perf_counter() - t0))
    result.update(timings)
    packs.close()
    del packs, buffer, plain

    # (2) end to end: strategy.run of a step whose only parameter has 16 Mi floats,
    #     against the same step without a strategy (both ranks run each phase together)
    class Big(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(BW_FLOATS))

        def forward(self) -> Any:
            return self.w.sum()

    plain = Big()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-9)

    def plain_step() -> None:
        plain_opt.zero_grad()
        plain().backward()
        plain_opt.step()

    with strategy.scope():
        big = Big()
        big_opt = torch.optim.SGD(big.parameters(), lr=1e-9)

    def step() -> None:
        big_opt.zero_grad()
        big().backward()
        big_opt.step()

    def ours_step() -> None:
        strategy.run(step)

    strategy._group.all_gather_object(None, "sync")
    result["local_step_ms"] = _timed_loop(lambda i: plain_step(), warmup, steps)["step_ms"]
    strategy._group.all_gather_object(None, "sync")
    result["strategy_step_ms"] = _timed_loop(lambda i: ours_step(), warmup, steps)["step_ms"]
    strategy._group.all_gather_object(None, "benchmark end")
    return result


# ==================================================================== parent

class WorkerFailed(RuntimeError):
    pass


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago.

    The same as ``stratagem.testing.free_ports``, written out here because importing
    ``stratagem`` imports torch, and the parent process stays light (see _common.py).
    """
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_ranks(worker_args: list[str], config: str, timeout: float) -> tuple[list[dict], dict]:
    """Start WORLD ranks of one measurement; wait with a deadline; return their results.

    Both ranks get their own session, so a failure or timeout kills each process group
    whole. Returns the per-rank results and what the parent saw (wall time, other load).
    """
    tmp = tempfile.mkdtemp(prefix="sg-bench-mw-")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TF_CONFIG", None)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)  # the children must not think they run under torchrun
    # ours: a TF_CONFIG cluster of WORLD workers (as stratagem.testing.local_cluster makes);
    # DDP: its own free port for the tcp:// rendezvous
    ports = _free_ports(WORLD + 1)
    port = ports[0]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[1:]]} if config in ("ours", "bw_ours", "ab") else None
    procs: list[subprocess.Popen] = []
    logs = []
    busy0, self0, _ = _cpu_sample()
    children0 = _children_cpu()
    t_start = time.monotonic()
    try:
        for rank in range(WORLD):
            task_env = dict(env)
            if cluster is not None:
                task_env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            cmd = [sys.executable, SCRIPT, *worker_args, "--rank", str(rank), "--port", str(port),
                   "--out", os.path.join(tmp, f"rank{rank}.json")]
            procs.append(subprocess.Popen(cmd, env=task_env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        failed: str | None = None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = f"rank {bad[0]} exited with code {procs[bad[0]].returncode}"
                break
            time.sleep(0.02)
        if failed is None:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"rank {bad[0]} exited with code {procs[bad[0]].returncode}"
        if failed is not None:
            for p in procs:
                _kill(p)
            for p in procs:
                p.wait()
            tails = []
            for rank, log in enumerate(logs):
                log.flush()
                log.seek(0)
                lines = log.read().strip().splitlines()[-12:]
                tails.append(f"--- rank {rank} ---\n    " + "\n    ".join(lines))
            raise WorkerFailed(f"{config} {' '.join(worker_args)}: {failed}\n" + "\n".join(tails))
        results = []
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
                p.wait()
        for log in logs:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    seen = {"wall_s": time.monotonic() - t_start}
    busy1, self1, _ = _cpu_sample()
    if busy0 is not None and busy1 is not None and seen["wall_s"] > 0:
        ours = (self1 - self0) + (_children_cpu() - children0)
        seen["other_load_cores"] = max(0.0, (busy1 - busy0 - ours) / seen["wall_s"])
    return results, seen


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _machine_other_load(seconds: float = 0.4) -> float | None:
    with CpuWindow() as window:
        time.sleep(seconds)
    return window.foreign_cores


class Quiet:
    """Before a measurement, wait (at most 15 s at a time) until other processes keep fewer
    than ``limit`` cores busy. Waiting and repeating disturbed measurements share one budget
    for the whole run (``--max-wait``), so a busy machine cannot stretch the run much."""

    def __init__(self, budget_s: float, limit: float):
        self.budget_s = budget_s
        self.limit = limit
        self.waited_s = 0.0
        self.repeated_s = 0.0

    @property
    def left_s(self) -> float:
        return self.budget_s - self.waited_s - self.repeated_s

    def wait(self) -> None:
        allowed = min(15.0, self.left_s)
        if allowed <= 0:
            return
        start = time.monotonic()
        try:
            while True:
                load = _machine_other_load(0.3)
                if load is None or load <= self.limit or time.monotonic() - start >= allowed:
                    return
                time.sleep(0.7)
        finally:
            self.waited_s += time.monotonic() - start


def _train_timeout(args: argparse.Namespace, model: str) -> float:
    per_step = 2.0 if model == "large" else 0.3   # generous, for a badly contended machine
    return 90.0 + (args.steps + args.warmup) * per_step


def _bw_timeout(args: argparse.Namespace) -> float:
    return 90.0 + (args.bw_steps + args.warmup) * 1.5 * 3


def _measure(args: argparse.Namespace, quiet: Quiet, worker_args: list[str], config: str, timeout: float,
             label: str) -> dict:
    """One measurement (both ranks); repeated (--retries, within the --max-wait budget) when
    other processes disturbed it; the least disturbed attempt is kept."""
    best: dict | None = None
    for attempt in range(1 + args.retries):
        quiet.wait()
        try:
            ranks, seen = run_ranks(worker_args, config, timeout)
        except WorkerFailed as error:
            _log(f"  FAILED {label}: {error}")
            return {"error": str(error)}
        m = {"ranks": ranks, **seen, "attempt": attempt}
        load = seen.get("other_load_cores")
        if best is None or (load or 0.0) < (best.get("other_load_cores") or 0.0):
            best = m
        if load is None or load <= args.max_other_load or attempt == args.retries or quiet.left_s <= 0:
            break
        quiet.repeated_s += seen["wall_s"]
        _log(f"    other processes kept {load:.2f} cores busy: measuring {label} again")
    assert best is not None
    return best


def run_benchmark(args: argparse.Namespace) -> dict:
    quiet = Quiet(args.max_wait, args.max_other_load)
    started = time.monotonic()
    train: list[dict] = []
    interleaved: list[dict] = []
    bandwidth: list[dict] = []
    pair = ["ddp", "ours"]
    for rnd in range(args.rounds):
        order = pair if rnd % 2 == 0 else pair[::-1]
        for model in args.models:
            if args.interleaved:
                worker_args = ["--worker", "ab", "--model", model, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), "--distinct", str(args.distinct),
                               "--seed", str(args.seed)]
                m = _measure(args, quiet, worker_args, "ab", 2 * _train_timeout(args, model), f"interleaved {model}")
                m.update(config="ab", model=model, round=rnd)
                interleaved.append(m)
                if "error" not in m:
                    r0 = m["ranks"][0]
                    _log(f"[round {rnd + 1}/{args.rounds}, {time.monotonic() - started:5.0f} s] "
                         f"{model:5s} interleaved in the same processes: ddp {median(r0['ddp_step_ms']):8.2f}, "
                         f"ours {median(r0['ours_step_ms']):8.2f} ms/step  "
                         f"(other load {m.get('other_load_cores', float('nan')):.2f} cores)")
            for config in order:
                worker_args = ["--worker", config, "--model", model, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), "--distinct", str(args.distinct),
                               "--seed", str(args.seed)]
                label = f"{config} {model}"
                m = _measure(args, quiet, worker_args, config, _train_timeout(args, model), label)
                m.update(config=config, model=model, round=rnd)
                train.append(m)
                if "error" not in m:
                    _log(f"[round {rnd + 1}/{args.rounds}, {time.monotonic() - started:5.0f} s] "
                         f"{model:5s} {config:4s} {median(m['ranks'][0]['step_ms']):8.2f} ms/step  "
                         f"(other load {m.get('other_load_cores', float('nan')):.2f} cores)")
        if args.bw_steps:
            for config in (["bw_raw", "bw_ours"] if rnd % 2 == 0 else ["bw_ours", "bw_raw"]):
                worker_args = ["--worker", config, "--steps", str(args.bw_steps), "--warmup", str(args.warmup)]
                m = _measure(args, quiet, worker_args, config, _bw_timeout(args), config)
                m.update(config=config, round=rnd)
                bandwidth.append(m)
                if "error" not in m:
                    _log(f"[round {rnd + 1}/{args.rounds}, {time.monotonic() - started:5.0f} s] "
                         f"{config:7s} 64 MiB all-reduce {median(m['ranks'][0]['op_ms']):8.2f} ms  "
                         f"(other load {m.get('other_load_cores', float('nan')):.2f} cores)")
    return {"train": train, "interleaved": interleaved, "bandwidth": bandwidth,
            "elapsed_s": time.monotonic() - started,
            "waited_for_quiet_s": quiet.waited_s,
            "repeated_s": quiet.repeated_s}


def _rank_steps(m: dict) -> list[float]:
    """Per step, the slower rank's time (the step is synchronous: both ranks see ~ the same)."""
    a, b = m["ranks"][0]["step_ms"], m["ranks"][1]["step_ms"]
    return [max(x, y) for x, y in zip(a, b)]


def _rank_cpu(m: dict) -> list[float]:
    """Per step, the CPU time of both ranks together (every thread: compute, gloo, Python)."""
    a, b = m["ranks"][0]["cpu_ms"], m["ranks"][1]["cpu_ms"]
    return [x + y for x, y in zip(a, b)]


def summarize(args: argparse.Namespace, raw: dict) -> dict:
    ok = [m for m in raw["train"] if "error" not in m]
    rows = []
    for model in args.models:
        by_round = {c: {m["round"]: median(_rank_steps(m)) for m in ok if m["config"] == c and m["model"] == model}
                    for c in ("ddp", "ours")}
        for config in ("ddp", "ours"):
            ms = [m for m in ok if m["config"] == config and m["model"] == model]
            row: dict[str, Any] = {"model": model, "config": config,
                                   "params_m": param_count(MODELS[model]) / 1e6}
            if not ms:
                row["skipped"] = "no successful measurement"
                rows.append(row)
                continue
            steps = [t for m in ms for t in _rank_steps(m)]
            row["median_ms"] = median(steps)
            row["p90_ms"] = percentile(steps, 90)
            row["round_medians_ms"] = [median(_rank_steps(m)) for m in ms]
            row["samples_per_s"] = GLOBAL_BATCH / (row["median_ms"] / 1e3)
            row["cpu_ms"] = median([t for m in ms for t in _rank_cpu(m)])
            row["best_round_ms"] = min(row["round_medians_ms"])
            row["other_load_cores"] = median([m.get("other_load_cores") or 0.0 for m in ms])
            row["final_loss"] = median([m["ranks"][0]["final_loss"] for m in ms])
            row["threads"] = ms[0]["ranks"][0].get("threads")
            if config == "ours":
                paired = [by_round["ours"][r] / by_round["ddp"][r] for r in by_round["ours"] if r in by_round["ddp"]]
                row["ratio_per_round"] = paired
                row["ratio_vs_ddp"] = median(paired) if paired else None
                cpu_by_round = {c: {m["round"]: median(_rank_cpu(m)) for m in ok
                                    if m["config"] == c and m["model"] == model} for c in ("ddp", "ours")}
                cpu_paired = [cpu_by_round["ours"][r] / cpu_by_round["ddp"][r] for r in cpu_by_round["ours"]
                              if r in cpu_by_round["ddp"]]
                row["cpu_ratio_per_round"] = cpu_paired
                row["cpu_ratio_vs_ddp"] = median(cpu_paired) if cpu_paired else None
                if by_round["ddp"]:
                    row["best_round_ratio"] = min(by_round["ours"].values()) / min(by_round["ddp"].values())
                if row["ratio_vs_ddp"] is not None:
                    row["target"] = STEP_TARGET
                    row["meets_target"] = row["ratio_vs_ddp"] <= STEP_TARGET
            rows.append(row)

    ab_rows = []
    ab_ok = [m for m in raw.get("interleaved", []) if "error" not in m]
    for model in args.models:
        ms = [m for m in ab_ok if m["model"] == model]
        if not ms:
            continue

        def per_step(m: dict, key: str, combine: Callable[[float, float], float]) -> list[float]:
            return [combine(a, b) for a, b in zip(m["ranks"][0][key], m["ranks"][1][key])]

        ratios = {c: [] for c in ("ddp", "ours")}
        for config in ("ddp", "ours"):
            steps = [t for m in ms for t in per_step(m, f"{config}_step_ms", max)]
            cpu = [t for m in ms for t in per_step(m, f"{config}_cpu_ms", lambda a, b: a + b)]
            row = {"model": model, "config": config, "params_m": param_count(MODELS[model]) / 1e6,
                   "median_ms": median(steps), "p90_ms": percentile(steps, 90),
                   "samples_per_s": GLOBAL_BATCH / (median(steps) / 1e3), "cpu_ms": median(cpu),
                   "round_medians_ms": [median(per_step(m, f"{config}_step_ms", max)) for m in ms],
                   "other_load_cores": median([m.get("other_load_cores") or 0.0 for m in ms]),
                   "final_loss": median([m["ranks"][0][f"final_loss_{config}"] for m in ms])}
            ratios[config] = row["round_medians_ms"]
            if config == "ours":
                paired = [o / d for o, d in zip(ratios["ours"], ratios["ddp"])]
                cpu_paired = [median(per_step(m, "ours_cpu_ms", lambda a, b: a + b)) /
                              median(per_step(m, "ddp_cpu_ms", lambda a, b: a + b)) for m in ms]
                row.update(ratio_per_round=paired, ratio_vs_ddp=median(paired), cpu_ratio_per_round=cpu_paired,
                           cpu_ratio_vs_ddp=median(cpu_paired), target=STEP_TARGET,
                           meets_target=median(paired) <= STEP_TARGET)
            ab_rows.append(row)

    bw_ok = [m for m in raw["bandwidth"] if "error" not in m]
    bw: dict[str, Any] = {}
    nbytes = BW_FLOATS * 4
    factor = 2 * (WORLD - 1) / WORLD

    def busbw(ms: float) -> float:
        return factor * nbytes / (ms / 1e3) / 1e9

    def slower(m: dict, key: str) -> list[float]:   # per op, the slower rank
        return [max(a, b) for a, b in zip(m["ranks"][0][key], m["ranks"][1][key])]

    raw_ms = [m for m in bw_ok if m["config"] == "bw_raw"]
    ours_ms = [m for m in bw_ok if m["config"] == "bw_ours"]
    raw_by_round = {m["round"]: median(slower(m, "op_ms")) for m in raw_ms}
    ours_by_round = {m["round"]: median(slower(m, "op_ms")) for m in ours_ms}
    if raw_ms:
        ops = [t for m in raw_ms for t in slower(m, "op_ms")]
        bw["raw"] = {"median_ms": median(ops), "p90_ms": percentile(ops, 90), "busbw_gbs": busbw(median(ops)),
                     "round_medians_ms": list(raw_by_round.values())}
    if ours_ms:
        ops = [t for m in ours_ms for t in slower(m, "op_ms")]
        bw["ours_finish"] = {"median_ms": median(ops), "p90_ms": percentile(ops, 90),
                             "busbw_gbs": busbw(median(ops)), "round_medians_ms": list(ours_by_round.values()),
                             "packs_elements": ours_ms[0]["ranks"][0]["packs"]}
        if raw_by_round:
            paired = [raw_by_round[r] / ours_by_round[r] for r in ours_by_round if r in raw_by_round]
            frac = median(paired) if paired else None
            bw["ours_finish"].update(fraction_of_raw=frac, fraction_per_round=paired,
                                     meets_target=frac is not None and frac >= BW_TARGET)
        # the same comparison inside the bw_ours processes, interleaved op by op
        same_raw = [t for m in ours_ms for t in slower(m, "same_process_raw_ms")]
        same_fin = [t for m in ours_ms for t in slower(m, "op_ms")]
        ratios = [r / f for m in ours_ms for r, f in zip(slower(m, "same_process_raw_ms"), slower(m, "op_ms"))]
        frac = median(ratios)
        bw["interleaved"] = {
            "raw_median_ms": median(same_raw), "raw_p90_ms": percentile(same_raw, 90),
            "raw_busbw_gbs": busbw(median(same_raw)),
            "finish_median_ms": median(same_fin), "finish_p90_ms": percentile(same_fin, 90),
            "finish_busbw_gbs": busbw(median(same_fin)),
            "pack_buffer_allreduce_ms": median([t for m in ours_ms for t in slower(m, "pack_buffer_allreduce_ms")]),
            "copy_in_out_ms": median([t for m in ours_ms for t in slower(m, "copy_in_out_ms")]),
            "fraction_of_raw": frac, "meets_target": frac >= BW_TARGET}
        diffs = [median(r["strategy_step_ms"]) - median(r["local_step_ms"]) for m in ours_ms for r in m["ranks"]]
        d = median(diffs)
        bw["ours_step"] = {"strategy_step_ms": median([median(r["strategy_step_ms"]) for m in ours_ms
                                                       for r in m["ranks"]]),
                           "local_step_ms": median([median(r["local_step_ms"]) for m in ours_ms for r in m["ranks"]]),
                           "comm_ms": d, "busbw_gbs": busbw(d) if d > 0 else None}
        if raw_ms and d > 0:
            bw["ours_step"]["fraction_of_raw"] = bw["raw"]["median_ms"] / d
    return {"rows": rows, "interleaved_rows": ab_rows, "bandwidth": bw}


def render(args: argparse.Namespace, raw: dict, summary: dict) -> str:
    headers = ["model", "config", "median ms", "p90 ms", "samples/s", "ours/DDP", "target", "best rnd ms",
               "best o/D", "CPU ms", "CPU o/D", "other load"]
    table = []
    for row in summary["rows"]:
        name = f"{row['model']} ({row['params_m']:.1f} M)"
        label = "DDP (gloo)" if row["config"] == "ddp" else "MultiWorkerMirrored"
        if "skipped" in row:
            table.append([name, label, "skipped: " + row["skipped"]] + [""] * 9)
            continue
        ratio, target, cpu_ratio = "", "", ""
        if row.get("ratio_vs_ddp") is not None:
            ratio = f"{row['ratio_vs_ddp']:.3f}"
            target = f"<={row['target']:.2f} {'ok' if row['meets_target'] else 'MISSED'}"
        if row.get("cpu_ratio_vs_ddp") is not None:
            cpu_ratio = f"{row['cpu_ratio_vs_ddp']:.3f}"
        best = f"{row['best_round_ratio']:.3f}" if row.get("best_round_ratio") is not None else ""
        table.append([name, label, f"{row['median_ms']:.2f}", f"{row['p90_ms']:.2f}",
                      f"{row['samples_per_s']:,.0f}", ratio, target, f"{row['best_round_ms']:.2f}", best,
                      f"{row['cpu_ms']:.1f}", cpu_ratio, f"{row['other_load_cores']:.2f}"])
    out = [format_table(headers, table, align="llrrrrlrrrrr")]

    if summary.get("interleaved_rows"):
        out.append(f"\nThe same comparison in the same two processes (DDP and ours built side by side, blocks of "
                   f"{AB_BLOCK} steps alternating DDP/ours in ABBA order; 'ours/DDP' = median over rounds):")
        table = []
        for row in summary["interleaved_rows"]:
            name = f"{row['model']} ({row['params_m']:.1f} M)"
            label = "DDP (gloo)" if row["config"] == "ddp" else "MultiWorkerMirrored"
            ratio = target = cpu_ratio = ""
            if row["config"] == "ours":
                ratio = f"{row['ratio_vs_ddp']:.3f}"
                target = f"<={row['target']:.2f} {'ok' if row['meets_target'] else 'MISSED'}"
                cpu_ratio = f"{row['cpu_ratio_vs_ddp']:.3f}"
            table.append([name, label, f"{row['median_ms']:.2f}", f"{row['p90_ms']:.2f}",
                          f"{row['samples_per_s']:,.0f}", ratio, target, f"{row['cpu_ms']:.1f}", cpu_ratio,
                          f"{row['other_load_cores']:.2f}"])
        out.append(format_table(["model", "config", "median ms", "p90 ms", "samples/s", "ours/DDP", "target",
                                 "CPU ms", "CPU o/D", "other load"], table, align="llrrrrlrrr"))

    bw = summary["bandwidth"]
    if bw:
        out.append("")
        rows = []

        def verdict(ok: bool) -> str:
            return f">={100 * BW_TARGET:.0f}% {'ok' if ok else 'MISSED'}"

        if "raw" in bw:
            r = bw["raw"]
            rows.append(["raw gloo dist.all_reduce", f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
                         f"{r['busbw_gbs']:.2f}", "100%", ""])
        if "ours_finish" in bw:
            r = bw["ours_finish"]
            frac = r.get("fraction_of_raw")
            rows.append(["ours: GradientPacks.finish (overlap=False)", f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
                         f"{r['busbw_gbs']:.2f}", "" if frac is None else f"{100 * frac:.1f}%",
                         "" if frac is None else verdict(r["meets_target"])])
        if "interleaved" in bw:
            r = bw["interleaved"]
            rows.append(["raw dist.all_reduce in ours' processes (b)", f"{r['raw_median_ms']:.2f}",
                         f"{r['raw_p90_ms']:.2f}", f"{r['raw_busbw_gbs']:.2f}",
                         f"{100 * r['fraction_of_raw']:.1f}%", verdict(r["meets_target"]) + " (b)"])
            rows.append(["  pieces of finish(): pack buffer all-reduce", f"{r['pack_buffer_allreduce_ms']:.2f}",
                         "", "", "", ""])
            rows.append(["  pieces of finish(): copy into pack + back", f"{r['copy_in_out_ms']:.2f}", "", "", "",
                         ""])
        if "ours_step" in bw:
            r = bw["ours_step"]
            frac = r.get("fraction_of_raw")
            rows.append(["ours: strategy.run step - local step", f"{r['comm_ms']:.2f}", "",
                         "" if r["busbw_gbs"] is None else f"{r['busbw_gbs']:.2f}",
                         "" if frac is None else f"{100 * frac:.1f}%", "(info)"])
        out.append(format_table([f"{BW_FLOATS * 4 >> 20} MiB all-reduce, {WORLD} processes", "median ms", "p90 ms",
                                 "bus GB/s", "ours/raw", "target"], rows, align="lrrrrl"))
        if "ours_step" in bw:
            r = bw["ours_step"]
            out.append(f"  end-to-end probe: strategy.run step {r['strategy_step_ms']:.2f} ms, the same step "
                       f"without a strategy {r['local_step_ms']:.2f} ms")
        out.append("  bus bandwidth = 2(n-1)/n * bytes / median time. Rows 1-2: each in its own fresh processes, "
                   "'ours/raw' = median over rounds of raw/finish. (b): a raw dist.all_reduce alternated op by op "
                   "with finish() (and with the pieces below it) inside ours' processes; its 'ours/raw' is "
                   "finish() against it (median of per-op ratios), the same check with less noise.")

    checks = []
    for rows_ in (summary["rows"], summary.get("interleaved_rows", [])):
        losses = {(r["model"], r["config"]): r["final_loss"] for r in rows_ if "final_loss" in r}
        for model in args.models:
            a, b = losses.get((model, "ddp")), losses.get((model, "ours"))
            if a is not None and b is not None:
                checks.append((abs(a - b) / max(abs(a), 1e-12), model))
    if checks:
        worst = max(checks)
        verdict = "same training" if worst[0] < 1e-3 else "DIFFERENT TRAINING: numbers are not comparable"
        out.append(f"\nCheck: loss on global batch 0 after warmup+steps, ours vs DDP: max relative difference "
                   f"{worst[0]:.1e} ({worst[1]}): {verdict}")
    loads = [r["other_load_cores"] for r in summary["rows"] if "other_load_cores" in r]
    loads += [m.get("other_load_cores") or 0.0 for m in raw["bandwidth"] + raw.get("interleaved", [])
              if "error" not in m]
    if loads and max(loads) > args.max_other_load:
        out.append(f"WARNING: other processes kept up to {max(loads):.2f} of {usable_cores()} cores busy during "
                   f"some measurements; their times are inflated. Rerun on a quiet machine.")
    errors = [m for m in raw["train"] + raw["bandwidth"] + raw.get("interleaved", []) if "error" in m]
    if errors:
        out.append(f"WARNING: {len(errors)} measurement(s) failed; see stderr")
    out.append("Step times: per step the slower rank's time, pooled over rounds. 'ours/DDP' is the median over "
               "rounds of the ratio of medians measured in the same round; 'best rnd ms' the lowest round median and "
               "'best o/D' the ratio of the two lowest (others' load only adds time). 'CPU ms': CPU time per step of both "
               "ranks together (all threads; less sensitive to other processes than wall time), 'CPU o/D' its "
               "ratio ours/DDP (per round, median). 'other load': cores kept busy by processes other than this "
               "benchmark while the measurement ran (start-up included).")
    return "\n".join(out)


def environment(raw: dict) -> dict:
    first = next((m["ranks"][0] for m in raw["train"] if "error" not in m), {})
    return {"python": platform.python_version(), "platform": platform.platform(), "cores": usable_cores(),
            "torch": first.get("torch_version"), "threads_per_worker": first.get("threads"),
            "loadavg_end": loadavg(), **git_state()}


# ------------------------------------------------------------------ profile

def run_profile(args: argparse.Namespace) -> dict:
    quiet = Quiet(args.max_wait, args.max_other_load)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for model in args.models:
            for config in (["ddp", "ours"] if rnd % 2 == 0 else ["ours", "ddp"]):
                quiet.wait()
                _log(f"[round {rnd + 1}/{args.rounds}] profiling {config} {model} ({args.steps} steps)...")
                worker_args = ["--worker", config, "--model", model, "--steps", str(args.steps), "--warmup",
                               str(args.warmup), "--distinct", str(args.distinct), "--seed", str(args.seed),
                               "--profile"]
                ranks, seen = run_ranks(worker_args, config, _train_timeout(args, model) * 2)
                runs.setdefault((model, config), []).append({"ranks": ranks, **seen})
    for model in args.models:
        merged = {}
        for config in ("ddp", "ours"):
            rs = [r for m in runs[(model, config)] for r in m["ranks"]]
            keys = list(dict.fromkeys(k for r in rs for k in r["phases_ms_per_step"]))
            merged[config] = {k: median([r["phases_ms_per_step"].get(k, 0.0) for r in rs]) for k in keys}
            merged[config]["whole step (loop)"] = median([median(r["step_ms"]) for r in rs])
        keys = list(dict.fromkeys(["whole step (loop)", *merged["ddp"], *merged["ours"]]))
        table = [[k, _fmt(merged["ddp"].get(k)), _fmt(merged["ours"].get(k))] for k in keys]
        print(f"\n{model} MLP {'-'.join(map(str, MODELS[model]))}: phase times in ms per step (median over "
              f"{args.rounds} round(s) x {WORLD} ranks of the mean over {args.steps} steps; timers add a little)")
        print(format_table(["phase", "DDP", "ours"], table, align="lrr"))
    return {"profile": {f"{m} {c}": v for (m, c), v in runs.items()}}


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


# --------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved repeats of every configuration, each in fresh processes (default 4)")
    p.add_argument("--bw-steps", type=int, default=None,
                   help="timed 64 MiB all-reduces per bandwidth measurement (default 16; 0 skips bandwidth)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                   help="skip the extra comparison with DDP and ours side by side in the same processes")
    p.add_argument("--distinct", type=int, default=8, help="distinct synthetic global batches, cycled")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="a measurement during which other processes kept more than this many cores busy is "
                        "repeated (up to --retries times; the least disturbed one is kept)")
    p.add_argument("--retries", type=int, default=None, help="repeats of a disturbed measurement (default 1)")
    p.add_argument("--max-wait", type=float, default=None,
                   help="seconds the whole run may spend waiting for other processes to go quiet and repeating "
                        "disturbed measurements (default 90; 0 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny run for smoke testing (< 90 s)")
    p.add_argument("--json", metavar="PATH", help="write raw measurements and the summary here")
    p.add_argument("--profile", action="store_true", help="instead of the table: phase timings, DDP vs ours")
    # worker-side (internal)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = dict(steps=4, warmup=1, rounds=1, bw_steps=3, retries=0, max_wait=0.0)
    full = dict(steps=20, warmup=5, rounds=4, bw_steps=16, retries=1, max_wait=90.0)
    if args.profile:
        full.update(steps=40, rounds=2, bw_steps=0)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("steps", "rounds", "distinct"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.retries < 0 or args.bw_steps < 0:
        p.error("--warmup, --bw-steps and --retries must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        if args.worker in ("ddp", "ours", "ab"):
            result = train_worker(args.worker, args.rank, args.port, args.model, args.steps, args.warmup,
                                  args.distinct, args.seed, args.profile)
        else:
            result = bandwidth_worker(args.worker, args.rank, args.port, args.steps, args.warmup)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    if args.profile:
        profile = run_profile(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), **profile}, f, indent=1)
        return 0

    _log(f"stratagem MultiWorkerMirroredStrategy vs DDP: {WORLD} workers, global batch {GLOBAL_BATCH}, "
         f"{args.rounds} round(s) of {args.warmup} warm-up + {args.steps} timed steps, {usable_cores()} cores, "
         f"load {loadavg()}")
    raw = run_benchmark(args)
    summary = summarize(args, raw)
    env = environment(raw)
    print(f"\n{WORLD} worker processes x 1 intra-op thread, gloo over loopback; global batch {GLOBAL_BATCH} "
          f"({GLOBAL_BATCH // WORLD} per rank), SGD lr {LR} momentum {MOMENTUM}; {args.rounds} round(s) x "
          f"{args.steps} timed steps (+{args.warmup} warm-up); torch {env['torch']}, {env['cores']} cores; "
          f"{raw['elapsed_s']:.0f} s, of which {raw['waited_for_quiet_s']:.0f} s waiting for a quiet machine and "
          f"{raw['repeated_s']:.0f} s repeating disturbed measurements")
    print(render(args, raw, summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": env, "summary": summary, **raw}, f, indent=1)
        _log(f"wrote {args.json}")
    return 1 if any("error" in m for m in raw["train"] + raw["bandwidth"] + raw["interleaved"]) else 0


if __name__ == "__main__":
    sys.exit(main())
