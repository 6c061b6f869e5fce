#!/usr/bin/env python
"""MirroredStrategy on logical CPU devices against plain PyTorch, side by side.

Trains the MLP 784-1024-1024-10 (SGD, lr 0.01, momentum 0.9) on synthetic data
(a few distinct pre-generated batches, cycled) with:

- plain PyTorch: one process, torch's default intra-op threads, no stratagem;
- ``sg.OneDeviceStrategy("cpu")``;
- ``sg.MirroredStrategy(["cpu:0", "cpu:1"])`` with its default cross-device op
  (``HierarchicalCopyAllReduce`` on CPU) and with ``ReductionToOneDevice``;
- TensorFlow's own single-device loop and ``tf.distribute.MirroredStrategy`` over two
  logical CPU devices, when ``import tensorflow`` works (skipped otherwise).

Every measurement runs in a fresh subprocess (so that thread settings, allocator
caches and lazily loaded libraries never leak from one configuration into the
next) and the configurations are interleaved round by round, in a rotating
order, so that slow drifts of a shared machine hit all of them alike. See
benchmarks/README.md for what each column means.

    python benchmarks/mirrored.py                    # full run, a few minutes on 2 cores
    python benchmarks/mirrored.py --quick            # smoke test, < 1 minute
    python benchmarks/mirrored.py --json out.json    # also write every raw measurement
    python benchmarks/mirrored.py --profile          # where Mirrored(2)'s time goes
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import platform
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (CpuWindow, WorkerFailed, emit, format_table, git_state, loadavg, median,  # noqa: E402
                     peak_rss_mib, percentile, run_worker, synthetic_batches, usable_cores)

SCRIPT = os.path.abspath(__file__)
LAYERS = (784, 1024, 1024, 10)
LR, MOMENTUM = 0.01, 0.9

# name -> (label, family). "torch" configs share the torch baseline for memory.
CONFIGS: dict[str, tuple[str, str]] = {
    "plain": ("PyTorch plain", "torch"),
    "one_device": ("OneDeviceStrategy(cpu)", "torch"),
    "mirrored_hier": ("Mirrored(2) HierarchicalCopy*", "torch"),
    "mirrored_r1d": ("Mirrored(2) ReductionToOneDevice", "torch"),
    "tf_single": ("TF single device", "tf"),
    "tf_mirrored": ("TF Mirrored(2)", "tf"),
}

# ratio-to-plain targets from the issue: (config, batch size or None for all) -> bound
TARGETS: dict[tuple[str, int | None], float] = {
    ("one_device", None): 1.03,
    ("mirrored_hier", 128): 1.25, ("mirrored_hier", 512): 1.10,
    ("mirrored_r1d", 128): 1.25, ("mirrored_r1d", 512): 1.10,
}


def target_for(config: str, batch: int) -> float | None:
    return TARGETS.get((config, batch), TARGETS.get((config, None)))


def mlp_param_count() -> int:
    return sum(i * o + o for i, o in zip(LAYERS[:-1], LAYERS[1:]))


# =================================================================== workers
# Each worker runs in its own interpreter, measures one configuration at one batch
# size, and prints one JSON line.

def _torch_model():
    import torch

    layers: list = []
    for i, (n_in, n_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(LAYERS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _torch_setup(config: str, batch: int, distinct: int, seed: int):
    """Model, optimizer and ``one_step(i)`` for a torch configuration."""
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    x_np, y_np = synthetic_batches(batch, distinct, seed=seed)
    xs = [torch.from_numpy(x_np[i]) for i in range(distinct)]
    ys = [torch.from_numpy(y_np[i]) for i in range(distinct)]
    torch.manual_seed(seed)
    info: dict[str, Any] = {}

    if config == "plain":
        model = _torch_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def one_step(i: int) -> Any:
            x, y = xs[i % distinct], ys[i % distinct]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        return model, one_step, xs, ys, info

    if config == "one_device":
        strategy = sg.OneDeviceStrategy("cpu")
    elif config == "mirrored_hier":
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])   # default op: HierarchicalCopyAllReduce
    elif config == "mirrored_r1d":
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.ReductionToOneDevice())
    else:
        raise SystemExit(f"unknown torch config {config!r}")
    info["strategy"] = repr(strategy)
    ops = getattr(strategy, "_cross_device_ops", None)
    if ops is not None:
        info["cross_device_ops"] = repr(ops)

    with strategy.scope():
        model = _torch_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(batch_: Any) -> Any:
        x, y = batch_
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    # an endless cycle over references to the `distinct` batches: no copies
    dist = strategy.experimental_distribute_dataset(itertools.cycle(list(zip(xs, ys))))
    iterator = iter(dist)

    def one_step(i: int) -> Any:
        return strategy.run(step, args=(next(iterator),))

    info["strategy_object"] = strategy   # removed before printing
    return model, one_step, xs, ys, info


def _timed_loop(one_step: Callable[[int], Any], warmup: int, steps: int, patience_s: float,
                max_other_load: float, sync: Callable[[Any], Any] = lambda out: None,
                probe: Callable[[], float] | None = None,
                on_chunk: Callable[[bool | None, int], None] | None = None) -> dict:
    """Warm up, then time steps in chunks of >= 0.25 s and keep the undisturbed chunks.

    During each chunk a :class:`CpuWindow` measures how many cores other processes
    kept busy. Steps of chunks above ``max_other_load`` are set aside. The loop ends
    once ``steps`` undisturbed steps are collected or, after at least ``steps``
    steps, once ``patience_s`` seconds have passed; when no chunk was undisturbed,
    the disturbed steps are reported instead (and flagged ``contended``). ``probe``
    (untimed) runs after exactly ``warmup + steps`` steps, so that its value can be
    compared between configurations however many steps each ends up timing.
    ``on_chunk(None, 0)`` is called before each chunk and ``on_chunk(kept, steps)``
    after it.
    """
    for i in range(warmup):
        sync(one_step(i))
    gc.collect()
    clean: list[float] = []
    disturbed: list[float] = []
    probed: float | None = None
    own_cpu = {True: 0.0, False: 0.0}
    chunks: list[tuple[int, float | None]] = []
    i = warmup
    started = time.perf_counter()
    while True:
        times = []
        if on_chunk is not None:
            on_chunk(None, 0)
        with CpuWindow() as window:
            chunk_start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                sync(one_step(i))
                t1 = time.perf_counter()
                times.append(1e3 * (t1 - t0))
                i += 1
                if probe is not None and i == warmup + steps:
                    probed = probe()
                if t1 - chunk_start >= 0.25:
                    break
        load = window.foreign_cores
        chunks.append((len(times), load))
        quiet = load is None or load <= max_other_load
        (clean if quiet else disturbed).extend(times)
        own_cpu[quiet] += (window.own_cores or 0.0) * window.seconds
        if on_chunk is not None:
            on_chunk(quiet, len(times))
        if len(clean) >= steps:
            break
        if len(clean) + len(disturbed) >= steps and time.perf_counter() - started >= patience_s:
            break
    used_loads = [(n, load or 0.0) for n, load in chunks if (load is None or load <= max_other_load) == bool(clean)]
    return {"step_ms": clean or disturbed, "contended": not clean, "clean_steps": len(clean),
            "disturbed_steps": len(disturbed),
            "foreign_cores": sum(n * load for n, load in used_loads) / max(1, sum(n for n, _ in used_loads)),
            "chunk_loads": [round(load, 3) if load is not None else None for _, load in chunks],
            "timed_s": time.perf_counter() - started, "final_loss": probed,
            "cpu_ms_per_step": 1e3 * own_cpu[bool(clean)] / max(1, len(clean or disturbed))}


def torch_worker(config: str, batch: int, steps: int, warmup: int, distinct: int, seed: int,
                 patience_s: float, max_other_load: float) -> dict:
    import torch
    import torch.nn.functional as F

    import stratagem  # noqa: F401  - every torch worker, baseline included, loads the same modules

    result: dict[str, Any] = {"config": config, "batch": batch, "torch_version": torch.__version__,
                              "threads": torch.get_num_threads(), "pid": os.getpid()}
    if config == "baseline":
        x_np, y_np = synthetic_batches(batch, distinct, seed=seed)
        xs = [torch.from_numpy(x_np[i]) for i in range(distinct)]
        # load and start the math libraries (BLAS, OpenMP pool) as every config does
        tiny = torch.nn.Linear(8, 8)
        tiny(torch.randn(4, 8)).sum().backward()
        result["peak_rss_mib"] = peak_rss_mib()
        del xs
        return result

    model, one_step, xs, ys, info = _torch_setup(config, batch, distinct, seed)
    strategy = info.pop("strategy_object", None)
    result.update(info)
    def probe() -> float:
        with torch.no_grad():   # outside run a mirrored module reads the primary copy
            return float(F.cross_entropy(model(xs[0]), ys[0]))

    result.update(_timed_loop(one_step, warmup, steps, patience_s, max_other_load, probe=probe))
    result["peak_rss_mib"] = peak_rss_mib()
    result["threads_after"] = torch.get_num_threads()
    del strategy
    return result


def tf_worker(config: str, batch: int, steps: int, warmup: int, distinct: int, seed: int,
              patience_s: float, max_other_load: float) -> dict:
    """TensorFlow's own numbers: a custom loop (``strategy.run`` inside ``tf.function``)."""
    result: dict[str, Any] = {"config": config, "batch": batch, "pid": os.getpid()}
    x_np, y_np = synthetic_batches(batch, distinct, seed=seed)
    try:
        import tensorflow as tf
    except Exception as error:  # noqa: BLE001 - ImportError, or a broken install
        result["skipped"] = f"import tensorflow failed: {type(error).__name__}: {error}"
        return result
    result["tf_version"] = tf.__version__
    # memory baseline inside this process: TF and the data are loaded, nothing built yet
    result["baseline_rss_mib"] = peak_rss_mib()

    if config == "tf_mirrored":
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        logical = tf.config.list_logical_devices("CPU")
        strategy = tf.distribute.MirroredStrategy(devices=[d.name for d in logical[:2]])
    elif config == "tf_single":
        strategy = tf.distribute.get_strategy()     # the default (no-op) strategy
    else:
        raise SystemExit(f"unknown tf config {config!r}")
    result["strategy"] = type(strategy).__name__
    result["replicas"] = strategy.num_replicas_in_sync

    tf.random.set_seed(seed)
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input(shape=(LAYERS[0],))]
            + [tf.keras.layers.Dense(n, activation="relu") for n in LAYERS[1:-1]]
            + [tf.keras.layers.Dense(LAYERS[-1])])
        optimizer = tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)

    # the same `distinct` global batches, cycled; the strategy splits each one
    dataset = (tf.data.Dataset.from_tensor_slices((x_np.reshape(-1, LAYERS[0]), y_np.reshape(-1)))
               .batch(batch, drop_remainder=True).repeat())
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def step_fn(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(dist_batch: Any) -> Any:
        per_replica = strategy.run(step_fn, args=dist_batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def probe() -> float:
        logits = model(x_np[0], training=False)
        return float(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_np[0], logits=logits)))

    result.update(_timed_loop(lambda i: train_step(next(iterator)), warmup, steps, patience_s,
                              max_other_load, sync=lambda loss: loss.numpy(), probe=probe))
    result["peak_rss_mib"] = peak_rss_mib()
    return result


# ================================================================== profiling
# Phase timers put around stratagem's internals by monkeypatching (no file under
# stratagem/ is edited). Names that a later version of stratagem no longer has are
# reported as missing instead of failing.

class _PhaseClock:
    """Per-thread accumulation of named phases, in seconds."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], float] = {}
        self.cpu_totals: dict[tuple[str, str], float] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.enabled = False
        # CPU time that a phase used: the calling thread's (replica threads run one
        # intra-op thread each), or the whole process's for plain PyTorch (whose
        # intra-op work runs on OpenMP threads too). Unlike wall time it does not
        # grow while other processes hold the cores.
        self.cpu_time: Callable[[], float] = time.thread_time

    def add(self, who: str, phase: str, seconds: float, cpu_seconds: float | None = None) -> None:
        if not self.enabled:
            return
        key = (who, phase)
        with self._lock:
            self.totals[key] = self.totals.get(key, 0.0) + seconds
            self.counts[key] = self.counts.get(key, 0) + 1
            if cpu_seconds is not None:
                self.cpu_totals[key] = self.cpu_totals.get(key, 0.0) + cpu_seconds


def _who() -> str:
    import threading

    name = threading.current_thread().name
    return "replica 0 (caller)" if name == "MainThread" else name.replace("stratagem-", "")


def _wrap(owner: Any, attr: str, clock: _PhaseClock, phase: str, missing: list) -> None:
    original = getattr(owner, attr, None)
    if original is None:
        missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
        return
    is_static = isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), clock.cpu_time()
        try:
            return original(*args, **kwargs)
        finally:
            clock.add(_who(), phase, time.perf_counter() - t0, clock.cpu_time() - c0)

    setattr(owner, attr, staticmethod(timed) if is_static else timed)


def profile_worker(config: str, batch: int, steps: int, warmup: int, distinct: int, seed: int,
                   patience_s: float, max_other_load: float) -> dict:
    """Time the phases of ``steps`` training steps of ``config`` (plain or mirrored_*)."""
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    clock = _PhaseClock()
    missing: list[str] = []
    result: dict[str, Any] = {"config": config, "batch": batch, "threads": torch.get_num_threads()}

    x_np, y_np = synthetic_batches(batch, distinct, seed=seed)
    xs = [torch.from_numpy(x_np[i]) for i in range(distinct)]
    ys = [torch.from_numpy(y_np[i]) for i in range(distinct)]
    torch.manual_seed(seed)

    def phased(fwd: Callable[[], Any], opt: Any) -> Any:
        who, cpu = _who(), clock.cpu_time
        t0, c0 = time.perf_counter(), cpu()
        loss = fwd()
        t1, c1 = time.perf_counter(), cpu()
        opt.zero_grad()
        t2, c2 = time.perf_counter(), cpu()
        loss.backward()
        t3, c3 = time.perf_counter(), cpu()
        opt.step()
        t4, c4 = time.perf_counter(), cpu()
        clock.add(who, "step fn: forward + loss", t1 - t0, c1 - c0)
        clock.add(who, "step fn: zero_grad", t2 - t1, c2 - c1)
        clock.add(who, "step fn: backward", t3 - t2, c3 - c2)
        clock.add(who, "step fn: optimizer.step (total)", t4 - t3, c4 - c3)
        return loss

    if config in ("plain", "plain_1thread"):
        if config == "plain_1thread":
            torch.set_num_threads(1)     # the pure work of a step, without intra-op parallelism
        clock.cpu_time = time.process_time
        model = _torch_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def one_step(i: int) -> Any:
            x, y = xs[i % distinct], ys[i % distinct]
            return phased(lambda: F.cross_entropy(model(x), y), opt)
    else:
        from stratagem.comm import cross_device_ops as cdo
        from stratagem.comm import sync as sync_mod
        from stratagem.data import input as input_mod
        from stratagem.strategies import base as base_mod
        from stratagem.strategies import local as local_mod
        from stratagem.strategies import mirroring as mirroring_mod

        ops = sg.ReductionToOneDevice() if config == "mirrored_r1d" else None
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
        with strategy.scope():
            model = _torch_model()
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        # --- where run() spends time outside the replica functions
        _wrap(mirroring_mod.Placement, "before_run", clock, "run: placement.before_run", missing)
        _wrap(mirroring_mod.Placement, "after_run", clock, "run: placement.after_run", missing)
        _wrap(base_mod.Strategy, "_select_replica", clock, "run: _select_replica (args per replica)", missing)
        _wrap(base_mod, "regroup", clock, "run: regroup results", missing)
        # --- inside optimizer.step
        _wrap(local_mod.LocalStrategy, "_reduce_gradients", clock,
              "opt.step: _reduce_gradients (exchange + all-reduce)", missing)
        _wrap(cdo.CrossDeviceOps, "reduce_exchanged", clock,
              "opt.step: cross_device_ops.reduce_exchanged", missing)
        for cls in (cdo.HierarchicalCopyAllReduce, cdo.ReductionToOneDevice):
            _wrap(cls, "_reduce_all", clock, "opt.step: _reduce_all (the summing)", missing)
        _wrap(sync_mod.ReplicaSync, "exchange", clock, "sync: ReplicaSync.exchange (incl. waiting)", missing)
        _wrap(local_mod, "_copy_hyperparameters", clock, "opt.step: _copy_hyperparameters", missing)
        # --- input splitting (runs on the caller's thread, inside next(iterator))
        _wrap(input_mod, "split_batch", clock, "input: split_batch", missing)

        # --- thread handoff: when each replica's function starts and ends vs run()
        marks: dict[str, float] = {}
        original_call = getattr(local_mod, "_call_in_replica", None)
        if original_call is not None:
            def call_in_replica(*args: Any, **kwargs: Any) -> Any:
                who = _who()
                marks[f"start {who}"] = time.perf_counter()
                try:
                    return original_call(*args, **kwargs)
                finally:
                    marks[f"end {who}"] = time.perf_counter()
            local_mod._call_in_replica = call_in_replica
        else:
            missing.append("local._call_in_replica")
        threads_cls = getattr(local_mod, "_ReplicaThreads", None)
        original_threads_run = getattr(threads_cls, "run", None)
        if original_threads_run is not None:
            def threads_run(self: Any, fn: Any, per_replica_args: Any) -> Any:
                marks.clear()
                t0 = time.perf_counter()
                out = original_threads_run(self, fn, per_replica_args)
                t1 = time.perf_counter()
                starts = [v for k, v in marks.items() if k.startswith("start ")]
                ends = [v for k, v in marks.items() if k.startswith("end ")]
                clock.add("run", "handoff: _ReplicaThreads.run total", t1 - t0)
                if len(starts) >= 2:
                    clock.add("run", "handoff: run entry -> last replica fn starts", max(starts) - t0)
                    clock.add("run", "handoff: first fn start -> last fn start (skew)", max(starts) - min(starts))
                if len(ends) >= 2:
                    clock.add("run", "handoff: last replica fn ends -> run returns", t1 - max(ends))
                    clock.add("run", "handoff: first fn end -> last fn end (skew)", max(ends) - min(ends))
                return out
            threads_cls.run = threads_run
        else:
            missing.append("local._ReplicaThreads.run")

        def step(batch_: Any) -> Any:
            x, y = batch_
            return phased(lambda: sg.nn.compute_average_loss(
                F.cross_entropy(model(x), y, reduction="none")), opt)

        dist = strategy.experimental_distribute_dataset(itertools.cycle(list(zip(xs, ys))))
        iterator = iter(dist)

        def one_step(i: int) -> Any:
            t0 = time.perf_counter()
            batch_ = next(iterator)
            t1 = time.perf_counter()
            out = strategy.run(step, args=(batch_,))
            t2 = time.perf_counter()
            clock.add("loop", "next(iterator) (input split + PerReplica)", t1 - t0)
            clock.add("loop", "strategy.run (total)", t2 - t1)
            return out

        # cost of the thread-count switch run() makes on the caller's thread
        n = torch.get_num_threads()
        t0 = time.perf_counter()
        for _ in range(200):
            torch.set_num_threads(1)
            torch.set_num_threads(n)
        result["set_num_threads_pair_us"] = (time.perf_counter() - t0) / 200 * 1e6
        torch.set_num_threads(n)

    # accumulate the phases of undisturbed chunks only (all chunks if none was)
    kept: dict[bool, list] = {True: [{}, {}, {}, 0], False: [{}, {}, {}, 0]}
    snapshot: list = [{}, {}, {}]

    def on_chunk(quiet: bool | None, n: int) -> None:
        if quiet is None:
            snapshot[:] = [dict(clock.totals), dict(clock.counts), dict(clock.cpu_totals)]
            clock.enabled = True
            return
        clock.enabled = False
        acc = kept[quiet]
        for target, now, before in ((acc[0], clock.totals, snapshot[0]), (acc[1], clock.counts, snapshot[1]),
                                    (acc[2], clock.cpu_totals, snapshot[2])):
            for key, value in now.items():
                target[key] = target.get(key, 0) + value - before.get(key, 0)
        acc[3] += n

    timing = _timed_loop(one_step, warmup, steps, patience_s, max_other_load, on_chunk=on_chunk)
    totals, counts, cpu_totals, n = kept[True] if kept[True][3] else kept[False]
    result["phases_ms_per_step"] = {f"{who} | {phase}": 1e3 * v / n for (who, phase), v in totals.items()}
    result["phases_cpu_ms_per_step"] = {f"{who} | {phase}": 1e3 * v / n for (who, phase), v in cpu_totals.items()}
    result["cpu_ms_per_step"] = timing["cpu_ms_per_step"]
    result["phases_ms_per_step"]["loop | whole step"] = sum(timing["step_ms"]) / len(timing["step_ms"])
    result["calls_per_step"] = {f"{who} | {phase}": c / n for (who, phase), c in counts.items()}
    result["calls_per_step"]["loop | whole step"] = 1.0
    result["wall_ms_per_step"] = result["phases_ms_per_step"]["loop | whole step"]
    for key in ("contended", "clean_steps", "disturbed_steps", "foreign_cores"):
        result[key] = timing[key]
    result["missing_hooks"] = missing
    return result


# ==================================================================== parent

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 40)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="global batch sizes (default 128 512; 128 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved repeats of every configuration, each in a fresh process (default 5)")
    p.add_argument("--distinct", type=int, default=8, help="distinct synthetic batches, cycled")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="which configurations to run (plain is always run: it is the reference)")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="timed steps during which other processes kept more than this many cores busy "
                        "are set aside (measured per chunk of >= 0.25 s)")
    p.add_argument("--patience", type=float, default=None,
                   help="seconds a measurement may go on timing steps to collect --steps undisturbed "
                        "ones (default 6; 0 with --quick)")
    p.add_argument("--max-wait", type=float, default=None,
                   help="seconds the whole run may spend waiting for other processes to go quiet "
                        "before measurements (default 60; 0 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny run for smoke testing (< 1 minute)")
    p.add_argument("--json", metavar="PATH", help="write raw measurements and the summary here")
    p.add_argument("--profile", action="store_true",
                   help="instead of the table: phase timings of plain vs Mirrored(2) at the first batch size")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = dict(steps=4, warmup=2, rounds=1, patience=0.0, max_wait=0.0, batch_sizes=[128])
    full = dict(steps=40, warmup=10, rounds=5, patience=6.0, max_wait=60.0, batch_sizes=[128, 512])
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.profile and not args.quick:
        given = argv if argv is not None else sys.argv
        if "--steps" not in given:
            args.steps = 60
        if "--rounds" not in given:
            args.rounds = 3
    if "plain" not in args.configs:
        args.configs = ["plain"] + args.configs
    for name in ("steps", "rounds", "distinct"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.patience < 0 or args.max_wait < 0:
        p.error("--warmup, --patience and --max-wait must be >= 0")
    return args


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _worker_argv(args: argparse.Namespace, worker: str, batch: int) -> list[str]:
    return ["--worker", worker, "--batch", str(batch), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--distinct", str(args.distinct), "--seed", str(args.seed),
            "--patience", str(args.patience), "--max-other-load", str(args.max_other_load)]


def _timeout(args: argparse.Namespace, batch: int) -> float:
    # generous: ~0.5 s per step of batch 512 on a badly contended 2-core machine
    return 120.0 + args.patience + (args.steps + args.warmup) * 0.5 * max(1.0, batch / 512)


_waited = [0.0]


def _wait_for_quiet(args: argparse.Namespace) -> None:
    """Before a measurement, wait (within --max-wait for the whole run, at most 15 s at a
    time) until other processes keep fewer than --max-other-load cores busy."""
    allowed = min(15.0, args.max_wait - _waited[0])
    if allowed <= 0:
        return
    start = time.monotonic()
    try:
        while True:
            with CpuWindow() as window:
                time.sleep(0.3)
            if window.foreign_cores is None or window.foreign_cores <= args.max_other_load:
                return
            if time.monotonic() - start >= allowed:
                return
            time.sleep(0.7)
    finally:
        _waited[0] += time.monotonic() - start


def _measure(args: argparse.Namespace, config: str, batch: int) -> dict:
    _wait_for_quiet(args)
    return run_worker(SCRIPT, _worker_argv(args, config, batch), _timeout(args, batch))


def run_benchmark(args: argparse.Namespace) -> dict:
    configs = [c for c in CONFIGS if c in args.configs]
    tf_skip: str | None = None
    if any(CONFIGS[c][1] == "tf" for c in configs) and importlib.util.find_spec("tensorflow") is None:
        tf_skip = "tensorflow is not installed"
    measurements: list[dict] = []
    baselines: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
    started = time.monotonic()
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for batch in args.batch_sizes:
            base = run_worker(SCRIPT, _worker_argv(args, "baseline", batch), _timeout(args, batch))
            baselines[batch].append(base["peak_rss_mib"])
            for config in order:
                if CONFIGS[config][1] == "tf" and tf_skip:
                    continue
                try:
                    m = _measure(args, config, batch)
                except WorkerFailed as error:
                    _log(f"  FAILED {config} batch {batch}: {error}")
                    measurements.append({"config": config, "batch": batch, "round": rnd, "error": str(error)})
                    continue
                if "skipped" in m:
                    tf_skip = m["skipped"]
                    _log(f"  skipping TensorFlow: {tf_skip}")
                    continue
                m["round"] = rnd
                measurements.append(m)
                _log(f"[round {rnd + 1}/{args.rounds}, {time.monotonic() - started:4.0f} s] batch {batch:4d} "
                     f"{CONFIGS[config][0]:33s} {median(m['step_ms']):8.2f} ms/step  "
                     f"({m['clean_steps']} undisturbed steps, {m['disturbed_steps']} set aside"
                     f"{'; CONTENDED' if m['contended'] else ''})")
    return {"measurements": measurements, "baseline_rss_mib": baselines, "tf_skipped": tf_skip,
            "elapsed_s": time.monotonic() - started, "waited_for_quiet_s": _waited[0]}


def summarize(args: argparse.Namespace, raw: dict) -> list[dict]:
    ok = [m for m in raw["measurements"] if "error" not in m]
    rows = []
    for batch in args.batch_sizes:
        def usable(config: str) -> tuple[list[dict], bool]:
            ms = [m for m in ok if m["config"] == config and m["batch"] == batch]
            quiet = [m for m in ms if not m["contended"]]
            return (quiet, False) if quiet else (ms, bool(ms))

        plain_ms, _ = usable("plain")
        plain_by_round = {m["round"]: median(m["step_ms"]) for m in plain_ms}
        plain_median = median([t for m in plain_ms for t in m["step_ms"]]) if plain_ms else None
        base_rss = median(raw["baseline_rss_mib"][batch]) if raw["baseline_rss_mib"][batch] else None
        for config in CONFIGS:
            ms, contended = usable(config)
            row: dict[str, Any] = {"config": config, "label": CONFIGS[config][0], "batch": batch}
            if not ms:
                if config in args.configs:
                    row["skipped"] = (raw["tf_skipped"] if CONFIGS[config][1] == "tf" and raw["tf_skipped"]
                                      else "no successful measurement")
                    rows.append(row)
                continue
            steps = [t for m in ms for t in m["step_ms"]]
            row["contended"] = contended
            row["measurements"] = len(ms)
            row["steps_kept"] = sum(m["clean_steps"] for m in ms) if not contended else 0
            row["steps_timed"] = sum(m["clean_steps"] + m["disturbed_steps"] for m in ms)
            row["median_ms"] = median(steps)
            row["p90_ms"] = percentile(steps, 90)
            row["round_medians_ms"] = [median(m["step_ms"]) for m in ms]
            row["samples_per_s"] = batch / (row["median_ms"] / 1e3)
            paired = [median(m["step_ms"]) / plain_by_round[m["round"]] for m in ms if m["round"] in plain_by_round]
            row["ratio_per_round"] = paired
            if len(paired) >= max(1, len(ms) // 2):
                row["ratio_vs_plain"] = median(paired)
                row["ratio_kind"] = "median of same-round ratios"
            elif plain_median:
                row["ratio_vs_plain"] = row["median_ms"] / plain_median
                row["ratio_kind"] = "ratio of medians (too few rounds with both undisturbed)"
            else:
                row["ratio_vs_plain"] = None
            if CONFIGS[config][1] == "tf":
                row["mem_delta_mib"] = median([m["peak_rss_mib"] - m["baseline_rss_mib"] for m in ms])
                row["mem_baseline"] = "in-process, after importing TensorFlow and building the data"
            elif base_rss is not None:
                row["mem_delta_mib"] = median([m["peak_rss_mib"] for m in ms]) - base_rss
            row["other_load_cores"] = median([m["foreign_cores"] or 0.0 for m in ms])
            row["cpu_ms_per_step"] = median([m["cpu_ms_per_step"] for m in ms])
            row["final_loss"] = median([m["final_loss"] for m in ms])
            row["threads"] = ms[0].get("threads")
            target = target_for(config, batch)
            if target is not None and row["ratio_vs_plain"] is not None:
                row["target"] = target
                row["meets_target"] = row["ratio_vs_plain"] <= target
            rows.append(row)
    return rows


def render(args: argparse.Namespace, raw: dict, rows: list[dict]) -> str:
    headers = ["config", "batch", "median ms", "p90 ms", "samples/s", "x plain", "target",
               "CPU ms", "peak RSS +MiB", "steps kept"]
    table = []
    for row in rows:
        if "skipped" in row:
            table.append([row["label"], row["batch"], "skipped: " + row["skipped"]] + [""] * 7)
            continue
        target = ""
        if "target" in row:
            verdict = "n/a (!)" if row["contended"] else ("ok" if row["meets_target"] else "MISSED")
            target = f"<={row['target']:.2f} {verdict}"
        ratio = row["ratio_vs_plain"]
        flag = "!" if row["contended"] else ""
        table.append([row["label"] + flag, row["batch"], f"{row['median_ms']:.2f}", f"{row['p90_ms']:.2f}",
                      f"{row['samples_per_s']:,.0f}", "" if ratio is None else f"{ratio:.3f}", target,
                      f"{row['cpu_ms_per_step']:.1f}",
                      "" if row.get("mem_delta_mib") is None else f"{row['mem_delta_mib']:.1f}",
                      f"{row['steps_kept']}/{row['steps_timed']}"])
    out = [format_table(headers, table, align="lrrrrrlrrr")]

    # memory per extra replica against its budget: one model + grads + momentum
    budget_mib = 3 * mlp_param_count() * 4 / 2**20
    notes = []
    for batch in args.batch_sizes:
        by = {r["config"]: r for r in rows if r["batch"] == batch and "skipped" not in r}
        one = by.get("one_device", {}).get("mem_delta_mib")
        for config in ("mirrored_hier", "mirrored_r1d"):
            mir = by.get(config, {}).get("mem_delta_mib")
            if one is not None and mir is not None:
                extra = mir - one
                notes.append(f"  batch {batch}: {CONFIGS[config][0]} uses {extra:+.1f} MiB over OneDevice for its "
                             f"extra replica (budget {budget_mib:.1f} MiB): {'ok' if extra <= budget_mib else 'OVER'}")
        if "tf_mirrored" in by and "tf_single" in by:
            notes.append(f"  batch {batch}: TF Mirrored(2) / TF single = "
                         f"{by['tf_mirrored']['median_ms'] / by['tf_single']['median_ms']:.2f}")
    if notes:
        out.append("\nMemory per extra replica (Mirrored(2) - OneDevice peak RSS):")
        out += notes

    # equivalence check: every torch config trained on the same batches from the same init
    losses = {(r["config"], r["batch"]): r["final_loss"] for r in rows if "final_loss" in r}
    diffs = []
    for (config, batch), loss in losses.items():
        ref = losses.get(("plain", batch))
        if ref is not None and CONFIGS[config][1] == "torch" and config != "plain":
            diffs.append((abs(loss - ref) / max(abs(ref), 1e-12), config, batch))
    if diffs:
        worst = max(diffs)
        verdict = "same training" if worst[0] < 1e-3 else "DIFFERENT TRAINING: numbers are not comparable"
        out.append(f"\nCheck: loss on batch 0 after warmup+steps, torch configs vs plain: max relative "
                   f"difference {worst[0]:.1e} ({worst[1]}, batch {worst[2]}): {verdict}")

    contended = [r for r in rows if r.get("contended")]
    if contended:
        out.append(f"WARNING: rows marked ! had no undisturbed steps at all (other processes kept up to "
                   f"{max(r['other_load_cores'] for r in contended):.2f} of {usable_cores()} cores busy): their "
                   f"times are inflated. Rerun on a quieter machine, or with a larger --patience.")
    unpaired = [r for r in rows if r.get("ratio_kind", "").startswith("ratio of medians")]
    if unpaired:
        out.append("Note: for " + ", ".join(f"{r['label']} @ {r['batch']}" for r in unpaired) +
                   " too few rounds had both it and plain undisturbed; 'x plain' is then the ratio of medians.")
    errors = [m for m in raw["measurements"] if "error" in m]
    if errors:
        out.append(f"WARNING: {len(errors)} measurement(s) failed; see stderr")
    out.append("* = the default cross-device op on CPU. 'x plain' = median over rounds of the ratio to plain "
               "PyTorch measured in the same round. 'CPU ms' = CPU time of the process (all its threads) per kept "
               "step. 'steps kept' = timed steps during which other processes "
               f"kept <= {args.max_other_load} cores busy / all timed steps; only kept steps are reported.")
    return "\n".join(out)


def environment(raw: dict) -> dict:
    torch_m = next((m for m in raw.get("measurements", []) if "torch_version" in m), {})
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cores": usable_cores(), "torch": torch_m.get("torch_version"),
            "torch_default_threads": torch_m.get("threads"), "loadavg_end": loadavg(), **git_state()}


PROFILE_CONFIGS = ("plain", "plain_1thread", "mirrored_hier", "mirrored_r1d")


def _profile_rows(phases: dict[str, float], config: str) -> dict[str, dict[str, float]]:
    """Per column (thread), the phases of one profile run, with derived sub-phases."""
    def get(who: str, phase: str) -> float | None:
        return phases.get(f"{who} | {phase}")

    columns: dict[str, dict[str, float]] = {}
    threads = ["replica 0 (caller)"] + (["replica-1"] if config.startswith("mirrored") else [])
    for who in threads:
        col: dict[str, float] = {}
        for phase in ("step fn: forward + loss", "step fn: zero_grad", "step fn: backward",
                      "step fn: optimizer.step (total)"):
            value = get(who, phase)
            if value is not None:
                col[phase] = value
        reduce_grads = get(who, "opt.step: _reduce_gradients (exchange + all-reduce)")
        exchanged = get(who, "opt.step: cross_device_ops.reduce_exchanged")
        summing = get(who, "opt.step: _reduce_all (the summing)")
        total = col.get("step fn: optimizer.step (total)")
        if reduce_grads is not None and exchanged is not None:
            col["  deposit grads + wait for the other replica"] = reduce_grads - exchanged
        if summing is not None:
            col["  all-reduce: summing my range (_reduce_all)"] = summing
        if exchanged is not None and summing is not None:
            col["  all-reduce: 'done' barrier wait"] = exchanged - summing
        if total is not None and reduce_grads is not None:
            col["  twin optimizer update (SGD step)"] = total - reduce_grads
        columns[who] = col
    loop: dict[str, float] = {}
    whole = phases.get("loop | whole step")
    if whole is not None:
        loop["whole step (loop)"] = whole
    for key, label in (("loop | next(iterator) (input split + PerReplica)", "next(iterator): input split"),
                       ("replica 0 (caller) | input: split_batch", "  of which split_batch"),
                       ("run | handoff: run entry -> last replica fn starts", "handoff: run entry -> last fn starts"),
                       ("run | handoff: last replica fn ends -> run returns", "handoff: last fn ends -> run returns"),
                       ("run | handoff: first fn end -> last fn end (skew)", "replica finish skew")):
        if key in phases:
            loop[label] = phases[key]
    run_total = phases.get("loop | strategy.run (total)")
    threads_total = phases.get("run | handoff: _ReplicaThreads.run total")
    if run_total is not None and threads_total is not None:
        loop["strategy.run outside the threads"] = run_total - threads_total
    for key, label in (("replica 0 (caller) | run: placement.before_run", "  placement.before_run"),
                       ("replica 0 (caller) | run: placement.after_run", "  placement.after_run"),
                       ("replica 0 (caller) | run: _select_replica (args per replica)", "  _select_replica"),
                       ("replica 0 (caller) | run: regroup results", "  regroup")):
        if key in phases:
            loop[label] = phases[key]
    columns["step"] = loop
    return columns


def run_profile(args: argparse.Namespace) -> None:
    batch = args.batch_sizes[0]
    runs: dict[str, list[dict]] = {c: [] for c in PROFILE_CONFIGS}
    for rnd in range(args.rounds):
        for config in PROFILE_CONFIGS:
            _wait_for_quiet(args)
            _log(f"[round {rnd + 1}/{args.rounds}] profiling {config} at batch {batch} ({args.steps} steps)...")
            r = run_worker(SCRIPT, _worker_argv(args, "profile:" + config, batch), _timeout(args, batch) * 2)
            runs[config].append(r)
            _log(f"    {r['wall_ms_per_step']:.2f} ms/step ({r['clean_steps']} undisturbed steps, "
                 f"{r['disturbed_steps']} set aside)")
    # median over rounds of every phase (rounds with undisturbed steps, if any)
    merged: dict[str, dict[str, float]] = {}
    merged_cpu: dict[str, dict[str, float]] = {}
    for config, results in runs.items():
        results = [r for r in results if not r["contended"]] or results
        for r in results:
            r["phases_cpu_ms_per_step"]["loop | whole step"] = r["cpu_ms_per_step"]
        for out, field in ((merged, "phases_ms_per_step"), (merged_cpu, "phases_cpu_ms_per_step")):
            keys = set().union(*(r[field] for r in results))
            out[config] = {k: median([r[field][k] for r in results if k in r[field]]) for k in keys}
    columns = [("plain", "replica 0 (caller)", "plain"), ("plain_1thread", "replica 0 (caller)", "plain 1 thread"),
               ("mirrored_hier", "replica 0 (caller)", "Hier r0"),
               ("mirrored_hier", "replica-1", "Hier r1"), ("mirrored_r1d", "replica 0 (caller)", "R1D r0"),
               ("mirrored_r1d", "replica-1", "R1D r1")]
    per_config = {c: _profile_rows(merged[c], c) for c in PROFILE_CONFIGS}
    per_config_cpu = {c: _profile_rows(merged_cpu[c], c) for c in PROFILE_CONFIGS}

    def cell(c: str, who: str, phase: str) -> str:
        wall = per_config[c].get(who, {}).get(phase)
        cpu = per_config_cpu[c].get(who, {}).get(phase)
        if wall is None:
            return ""
        return f"{wall:.2f}" + (f" ({cpu:.2f})" if cpu is not None else "")

    phase_order: list[str] = []
    for c in PROFILE_CONFIGS:
        for who in ("step", "replica 0 (caller)", "replica-1"):
            for phase in per_config[c].get(who, {}):
                if phase not in phase_order:
                    phase_order.append(phase)
    table = []
    step_phases = [p for p in phase_order if p in set().union(*(per_config[c]["step"] for c in PROFILE_CONFIGS))]
    for phase in step_phases:
        table.append([phase] + [cell(c, "step", phase) if who == "replica 0 (caller)" else ""
                                for c, who, _ in columns])
    for phase in [p for p in phase_order if p not in step_phases]:
        table.append([phase] + [cell(c, who, phase) for c, who, _ in columns])
    kept = {c: f"{sum(r['clean_steps'] for r in runs[c])}/"
               f"{sum(r['clean_steps'] + r['disturbed_steps'] for r in runs[c])}" for c in PROFILE_CONFIGS}
    table.append(["undisturbed steps kept / timed"] + [kept[c] if who == "replica 0 (caller)" else ""
                                                      for c, who, _ in columns])
    print(f"Phase times in ms per step, batch {batch}: median over {args.rounds} round(s) of the mean over "
          f"{args.steps} steps (after {args.warmup} warm-up). 'plain 1 thread' = plain PyTorch with "
          f"torch.set_num_threads(1): the work of a step without intra-op parallelism. Hier = Mirrored(2) HierarchicalCopy (default), "
          f"R1D = Mirrored(2) ReductionToOneDevice; r0 = replica 0 on the caller's thread, r1 = replica 1's "
          f"thread. Step-level rows are in the r0 column. In parentheses: CPU time (plain: the whole process, "
          f"all its threads; Mirrored: the replica's own thread; whole step: the whole process), which "
          f"does not grow while other processes hold the cores. Timers add a little overhead.\n")
    print(format_table(["phase"] + [label for _, _, label in columns], table, align="l" + "r" * len(columns)))
    pair = [r.get("set_num_threads_pair_us") for r in runs["mirrored_hier"] if r.get("set_num_threads_pair_us")]
    if pair:
        print(f"\ntorch.set_num_threads(1) + set_num_threads(back) pair, as run() does on the caller: "
              f"{median(pair):.1f} us")
    missing = sorted(set().union(*(r.get("missing_hooks", []) for rs in runs.values() for r in rs)))
    if missing:
        print("hooks not installed (stratagem changed?):", ", ".join(missing))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "profile": runs, "merged_ms_per_step": merged}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        if args.worker.startswith("profile:"):
            emit(profile_worker(args.worker.split(":", 1)[1], args.batch, args.steps, args.warmup,
                                args.distinct, args.seed, args.patience, args.max_other_load))
        elif args.worker == "baseline" or CONFIGS.get(args.worker, ("", ""))[1] == "torch":
            emit(torch_worker(args.worker, args.batch, args.steps, args.warmup, args.distinct, args.seed,
                              args.patience, args.max_other_load))
        elif CONFIGS.get(args.worker, ("", ""))[1] == "tf":
            emit(tf_worker(args.worker, args.batch, args.steps, args.warmup, args.distinct, args.seed,
                           args.patience, args.max_other_load))
        else:
            raise SystemExit(f"unknown worker {args.worker!r}")
        return 0
    if args.profile:
        run_profile(args)
        return 0

    _log(f"stratagem MirroredStrategy benchmark: batch sizes {args.batch_sizes}, {args.rounds} round(s) of "
         f"{args.warmup} warm-up + {args.steps} timed steps, {usable_cores()} cores, load {loadavg()}")
    raw = run_benchmark(args)
    rows = summarize(args, raw)
    env = environment(raw)
    print(f"\nMLP {'-'.join(map(str, LAYERS))} ({mlp_param_count() / 1e6:.2f} M params), SGD lr {LR} momentum "
          f"{MOMENTUM}; {args.rounds} round(s) x {args.steps} timed steps (+{args.warmup} warm-up); torch "
          f"{env['torch']}, {env['cores']} cores, torch default threads {env['torch_default_threads']}; "
          f"{raw['elapsed_s']:.0f} s, of which {raw['waited_for_quiet_s']:.0f} s waiting for a quiet machine")
    print(render(args, raw, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": env, "summary": rows, **raw}, f, indent=1)
        _log(f"wrote {args.json}")
    return 1 if any("error" in m for m in raw["measurements"]) else 0


if __name__ == "__main__":
    sys.exit(main())
