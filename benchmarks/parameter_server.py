#!/usr/bin/env python
"""ParameterServerStrategy + ClusterCoordinator: training rate, embedding traffic, RPC floor.

Every measurement runs in a real local cluster, ``python -m stratagem launch --workers 2 --ps M
benchmarks/parameter_server.py --chief SPEC`` (2 workers and M parameter servers running
``stratagem server``, this script as the chief; loopback only), and TensorFlow's
``ParameterServerStrategy`` in the same topologies when ``import tensorflow`` works in
``--tf-python`` (``_tf.py``). Measured, in this order (a worker pulls every dense variable it
knows before each closure, so no-op closures come first):

- ``noop``: no-op closures per second (``schedule`` + ``join``); ``sched``: ``schedule()`` calls
  per second, not waiting for them;
- ``emb``: ``nn.Embedding(rows, 64)`` + mean + ``nn.Linear(64, 10)``, batch 64, SGD (lr 0.1):
  steps/s, and the bytes on the ps tasks' TCP connections per step (the kernel's ``ss -ti`` counters),
  for 1M x 8 ids, 1M x 32 ids and 100k x 8 ids: bytes grow with the rows a step uses, not with
  the table;
- ``mlp``: the MLP 784-1024-1024-10, batch 64, SGD (lr 0.01, momentum 0.9), 8 distinct batches
  per worker: steps/s, 1 ps and 2 ps (``sg.FixedShardsPartitioner(2)``);
- ``noop_loaded``: no-op closures once the workers know the MLP.

Rates are medians of rounds during which processes outside the cluster kept at most
``--max-other-load`` cores busy (disturbed rounds are re-run, at most ``--extra-rounds``).

    python benchmarks/parameter_server.py                   # ~3-4 min on 2 cores
    python benchmarks/parameter_server.py --quick           # smoke test
    python benchmarks/parameter_server.py --profile         # + torch.profiler tables, coordinator and workers
    python benchmarks/parameter_server.py --tf-python /path/to/venv-with-tensorflow_cpu/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS, BATCH, DISTINCT, EMB_DIM, EMB_LR = 2, 64, 8, 64, 0.1
NOOP_TARGET = 1000.0                       # no-op closures/s, at least (an absolute floor set earlier)
TF_TARGET = 1.3                            # each row's rate against TensorFlow's in the same run, at least
TF_NOTES = (51.0, 60.0, 880.0)             # TensorFlow 2.21 measured earlier here: steps/s range and no-op closures/s here


# ================================================================ closures (run on workers)
# Module-level functions of the chief's __main__: cloudpickle ships them by value, so they
# must not use this module's imports (the worker has no benchmarks/ on its path).

def _noop() -> None:
    return None


def _worker_profiler(action: str) -> dict:
    """Start or stop torch.profiler on the worker that runs this closure. The profiler lives in a
    thread of its own (start and stop must happen in one thread) and records every thread."""
    import os
    import sys
    import threading
    import time
    import types

    import torch

    state = sys.modules.setdefault("_sg_bench_profiler", types.ModuleType("_sg_bench_profiler"))
    if action == "start" and not hasattr(state, "thread"):
        state.stop, started = threading.Event(), threading.Event()

        def run() -> None:
            config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        experimental_config=config) as prof:
                started.set()
                state.stop.wait()
            state.events = [(e.key, e.count, e.cpu_time_total / 1e3, e.self_cpu_time_total / 1e3)
                            for e in prof.key_averages()]
        state.thread = threading.Thread(target=run, daemon=True)
        state.thread.start()
        started.wait()
    elif action == "stop" and hasattr(state, "thread"):
        state.stop.set()
        state.thread.join()
        del state.thread
        return {"pid": os.getpid(), "events": state.events}
    time.sleep(0.2)   # hold this worker, so that the other one takes the next closure
    return {"pid": os.getpid()}


# ================================================================ the chief

def _ps_socket_bytes(ports: list[int]) -> int:
    """Bytes sent + received so far on the established TCP connections of the ps ports, from the
    kernel's per-socket counters (``ss -ti``): what the parameter servers moved, framing included."""
    where = " or ".join(f"sport = :{port}" for port in ports)
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( {where} )"], capture_output=True, text=True,
                         timeout=10).stdout
    return sum(int(n) for n in re.findall(r"\bbytes_(?:sent|received):(\d+)", out))


def chief_main(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import stratagem as sg

    torch.set_num_threads(1)   # the coordinator computes nothing: the cores are the cluster's
    strategy = sg.ParameterServerStrategy(
        sg.cluster.TFConfigClusterResolver(),
        variable_partitioner=sg.FixedShardsPartitioner(spec["shards"]) if spec["shards"] > 1 else None)
    coordinator = sg.ClusterCoordinator(strategy)
    num_workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
    ps_ports = [int(a.rpartition(":")[2]) for a in strategy.cluster_resolver.cluster_spec().job_tasks("ps")]
    ps_ports += [client.rpc.call("_rpc_lane")["port"] for client in strategy.cluster.ps_clients]   # their lanes
    result: dict[str, Any] = {"framework": "stratagem", "torch": torch.__version__}
    phases = spec["phases"].split(",")

    def rates(run_round: Any, count: int) -> dict:
        return h.rate_rounds(run_round, count, rounds=spec["rounds"], extra_rounds=spec["extra_rounds"],
                             max_other_load=spec["max_other_load"])

    def noops(count: int) -> None:
        for _ in range(count):
            coordinator.schedule(_noop)
        coordinator.join()

    def on_every_worker(action: str, key: str = "pid") -> dict:
        answers: dict = {}
        deadline = time.monotonic() + 60
        while len(answers) < num_workers and time.monotonic() < deadline:
            values = [coordinator.schedule(_worker_profiler, args=(action,)) for _ in range(2 * num_workers)]
            coordinator.join()
            answers.update({v["pid"]: v for v in (x.fetch() for x in values) if key in v})
        return answers

    def scheduled(step: Any, iterator: Any, out: list) -> Any:
        def run(count: int) -> None:
            values = [coordinator.schedule(step, args=(iterator,)) for _ in range(count)]
            coordinator.join()
            out.extend(v.fetch() for v in values)
        return run

    if "noop" in phases:
        noops(spec["warmup"])
        result["noop"] = rates(noops, spec["noop_count"])
    if "sched" in phases:
        result["sched"] = {"rates": []}
        for _ in range(spec["rounds"]):
            t0 = time.perf_counter()
            for _ in range(spec["sched_count"]):
                coordinator.schedule(_noop)
            result["sched"]["rates"].append(spec["sched_count"] / (time.perf_counter() - t0))
            coordinator.join()   # drained untimed

    if "emb" in phases:
        class EmbeddingModel(nn.Module):
            def __init__(self, rows: int):
                super().__init__()
                self.embedding = nn.Embedding(rows, EMB_DIM)
                self.head = nn.Linear(EMB_DIM, 10)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.head(self.embedding(ids).mean(dim=1))

        result["emb"] = []
        for rows, k in spec["emb"]:
            torch.manual_seed(0)
            with strategy.scope():
                model = EmbeddingModel(rows)
                optimizer = torch.optim.SGD(model.parameters(), lr=EMB_LR)

            def emb_data(ctx: Any, rows: int = rows, k: int = k, batch: int = BATCH) -> Any:
                g = torch.Generator().manual_seed(1000 + ctx.input_pipeline_id)
                while True:
                    yield torch.randint(0, rows, (batch, k), generator=g), torch.randint(0, 10, (batch,), generator=g)

            def emb_step(it: Any) -> tuple:
                ids, labels = next(it)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(ids), labels)
                loss.backward()
                optimizer.step()
                return float(loss), int(ids.unique().numel())   # rows this step pulled and pushed

            outputs: list = []
            run = scheduled(emb_step, iter(coordinator.create_per_worker_dataset(emb_data)), outputs)
            run(spec["warmup"])
            outputs.clear()
            before, cpu = _ps_socket_bytes(ps_ports), h.cluster_cpu_s()
            measured = rates(run, spec["emb_steps"])
            result["emb"].append({"rows": rows, "ids_per_example": k, **measured,
                                  "cluster_cpu_ms": 1e3 * (h.cluster_cpu_s() - cpu) / len(outputs),
                                  "ps_bytes_per_step": (_ps_socket_bytes(ps_ports) - before) / len(outputs),
                                  "rows_per_step": sum(r for _, r in outputs) / len(outputs)})
            del model, optimizer

    if "mlp" in phases:
        torch.manual_seed(0)
        with strategy.scope():
            mlp = h.mlp()
            mlp_optimizer = torch.optim.SGD(mlp.parameters(), lr=h.LR, momentum=h.MOMENTUM)
        features, classes = h.MLP_LAYERS[0], h.MLP_LAYERS[-1]

        def mlp_data(ctx: Any, features: int = features, classes: int = classes, batch: int = BATCH,
                     distinct: int = DISTINCT) -> Any:
            g = torch.Generator().manual_seed(ctx.input_pipeline_id)
            xs = torch.randn(distinct, batch, features, generator=g)
            ys = torch.randint(0, classes, (distinct, batch), generator=g)
            i = 0
            while True:
                yield xs[i % distinct], ys[i % distinct]
                i += 1

        def mlp_step(it: Any) -> float:
            x, y = next(it)
            mlp_optimizer.zero_grad()
            loss = F.cross_entropy(mlp(x), y)
            loss.backward()
            mlp_optimizer.step()
            return float(loss)

        losses: list = []
        run = scheduled(mlp_step, iter(coordinator.create_per_worker_dataset(mlp_data)), losses)
        run(spec["warmup"])
        before, done, cpu = _ps_socket_bytes(ps_ports), len(losses), h.cluster_cpu_s()
        if spec["profile"]:
            on_every_worker("start")
            with h.Profile() as prof:
                result["mlp"] = rates(run, spec["steps"])
            workers = on_every_worker("stop", key="events")
            result["profile"] = {"steps": len(losses) - done, "coordinator": prof.events,
                                 "workers": [w["events"] for w in workers.values()]}
        else:
            result["mlp"] = rates(run, spec["steps"])
        result["mlp"].update(ps_bytes_per_step=(_ps_socket_bytes(ps_ports) - before) / (len(losses) - done),
                             cluster_cpu_ms=1e3 * (h.cluster_cpu_s() - cpu) / (len(losses) - done),
                             first_loss=sum(losses[:10]) / 10, last_loss=sum(losses[-20:]) / 20)
        if "noop_loaded" in phases:
            result["noop_loaded"] = rates(noops, max(20, spec["noop_count"] // 10))   # each pulls the MLP
    coordinator.shutdown()
    return result


# ================================================================ the parent

def run_cluster(args: argparse.Namespace, tmp: str, name: str, num_ps: int, phases: str, emb: list,
                profile: bool = False) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    spec = {"out": out, "shards": num_ps, "phases": phases, "emb": emb, "profile": profile, "batch": BATCH,
            "distinct": DISTINCT, "emb_dim": EMB_DIM, "emb_lr": EMB_LR, **{k: getattr(args, k) for k in (
                "steps", "rounds", "warmup", "noop_count", "sched_count", "emb_steps", "max_other_load",
                "extra_rounds")}}
    h.log(f"[{name}] {WORKERS} workers, {num_ps} ps (timeout {args.timeout:.0f} s)")
    started = time.monotonic()
    with h.Processes() as procs:
        if name.startswith("tf_"):
            from stratagem.testing import local_cluster

            cluster = local_cluster(WORKERS, chief=True, num_ps=num_ps)
            tf_env = {"GRPC_FAIL_FAST": "use_caller", "TF_CPP_MIN_LOG_LEVEL": "2"}
            for job, count in (("ps", num_ps), ("worker", WORKERS), ("chief", 1)):
                for i in range(count):
                    tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": i}})
                    mode = ["ps-chief", json.dumps(spec)] if job == "chief" else ["ps-server"]
                    procs.start(f"{job} {i}", [args.tf_python, os.path.join(HERE, "_tf.py"), *mode],
                                h.child_env(TF_CONFIG=tf_config, **tf_env))
            procs.wait(["chief 0"], args.timeout)   # tf servers never exit: the block's end kills them
        else:
            procs.start("launch", [sys.executable, "-m", "stratagem", "launch", "--workers", str(WORKERS), "--ps",
                                   str(num_ps), os.path.abspath(__file__), "--chief", json.dumps(spec)],
                        graceful=True)
            procs.wait(["launch"], args.timeout)
    with open(out) as f:
        result = json.load(f)
    h.log(f"[{name}] done in {time.monotonic() - started:.0f} s")
    return result


def tensorflow_missing(python: str) -> str | None:
    try:
        probe = subprocess.run([python, "-c", "import tensorflow"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{python}: {error}"
    return None if probe.returncode == 0 else f"import tensorflow failed in {python}"


def measure_floor(steps: int = 40) -> dict:
    """What bounds the MLP row on this host: loopback TCP bandwidth (one stream, 256 MiB in 4 MiB
    sends) and one MLP step (forward, backward, SGD with momentum, batch 64) on one thread."""
    import socket
    import threading

    import torch

    chunk, total = bytes(4 << 20), 256 << 20
    with socket.create_server(("127.0.0.1", 0)) as server:
        def sink() -> None:
            conn, _ = server.accept()
            with conn:
                while conn.recv_into(buffer):
                    pass
        buffer = bytearray(4 << 20)
        reader = threading.Thread(target=sink, daemon=True)
        reader.start()
        with socket.create_connection(server.getsockname()) as conn:
            start = time.perf_counter()
            for _ in range(total // len(chunk)):
                conn.sendall(chunk)
        reader.join(timeout=60)
        seconds = time.perf_counter() - start
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = h.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
        times = []
        for i in range(steps + 5):
            start_step = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= 5:
                times.append(time.perf_counter() - start_step)
    finally:
        torch.set_num_threads(threads)
    return {"loopback_bytes_per_s": total / seconds, "compute_ms": 1e3 * h.median(times)}


def rate(cluster: dict | None, key: str) -> tuple[float | None, bool]:
    entry = (cluster or {}).get(key)
    return (h.median(entry["rates"]), bool(entry.get("contended"))) if entry and entry["rates"] else (None, False)


def report(args: argparse.Namespace, clusters: dict, errors: dict, tf_why: str | None) -> list[str]:
    def cell(name: str, key: str, emb: tuple | None = None) -> str:
        if name.startswith("tf_") and tf_why:
            return "skipped"
        if name in errors:
            return "FAILED"
        if emb is not None:
            entry = next((e for e in (clusters.get(name) or {}).get("emb", []) if tuple(e[k] for k in (
                "rows", "ids_per_example")) == emb), None)
            value, disturbed = (h.median(entry["rates"]), entry["contended"]) if entry else (None, False)
        else:
            value, disturbed = rate(clusters.get(name), key)
        return "-" if value is None else f"{value:,.1f}" + ("!" if disturbed else "")

    def against_tf(ours_name: str, key: str, emb: tuple | None = None, target: bool = True) -> list[str]:
        """The ratio to TensorFlow's rate in the same run, and (rows with a target) the verdict at 1.3x."""
        ours, tf = value(ours_name, key, emb), value("tf" + ours_name[4:], key, emb)
        if ours is None:
            return ["", "", ""]
        if tf is None:   # TensorFlow not run: its MLP rate measured earlier on these machines
            if key != "mlp" or not target:
                return ["", "", ""]
            lo, hi = TF_NOTES[:2]
            return [f">= {TF_TARGET}x TF {lo:.0f}-{hi:.0f} (earlier)", f"{ours / hi:.2f}-{ours / lo:.2f}x",
                    "ok" if ours >= TF_TARGET * hi else ("MISSED" if ours < TF_TARGET * lo else "undecided")]
        return [f">= {TF_TARGET}x TF" if target else "", f"{ours / tf:.2f}x",
                ("ok" if ours >= TF_TARGET * tf else "MISSED") if target else ""]

    def value(name: str, key: str, emb: tuple | None = None) -> float | None:
        if emb is None:
            return rate(clusters.get(name), key)[0]
        entry = next((e for e in (clusters.get(name) or {}).get("emb", []) if tuple(e[k] for k in (
            "rows", "ids_per_example")) == emb), None)
        return h.median(entry["rates"]) if entry and entry["rates"] else None

    e8 = (1000000, 8)
    rows = [["MLP 784-1024-1024-10 steps/s, 1 ps", cell("ours_1ps", "mlp"), cell("tf_1ps", "mlp"),
             *against_tf("ours_1ps", "mlp")],
            ["MLP steps/s, 2 ps (FixedShards(2))", cell("ours_2ps", "mlp"), cell("tf_2ps", "mlp"),
             *against_tf("ours_2ps", "mlp")],
            ["embedding 1Mx64, 8 ids: steps/s, 1 ps", cell("ours_1ps", "", e8), cell("tf_1ps", "", e8),
             *against_tf("ours_1ps", "", e8)],
            ["embedding 1Mx64, 8 ids: steps/s, 2 ps", cell("ours_2ps", "", e8), cell("tf_2ps", "", e8),
             *against_tf("ours_2ps", "", e8)],
            ["no-op closures/s, 1 ps", cell("ours_1ps", "noop"), cell("tf_1ps", "noop"), *against_tf("ours_1ps", "noop")],
            ["no-op closures/s, 2 ps", cell("ours_2ps", "noop"), cell("tf_2ps", "noop"),
             *against_tf("ours_2ps", "noop", target=False)],
            ["no-op closures/s, MLP known to workers", cell("ours_1ps", "noop_loaded"), cell("tf_1ps", "noop_loaded"),
             *against_tf("ours_1ps", "noop_loaded", target=False)],
            ["schedule() calls/s (not waiting)", cell("ours_1ps", "sched"), cell("tf_1ps", "sched"),
             *against_tf("ours_1ps", "sched", target=False)]]
    lines = [h.format_table(["measurement", "stratagem", "TensorFlow", "target", "ratio", "verdict"], rows,
                            align="lrrrrl"),
             f"(median over rounds in which other processes kept <= {args.max_other_load} cores busy; '!' = none did; "
             f"ratio = stratagem / TensorFlow in this run)"]
    noop = rate(clusters.get("ours_1ps"), "noop")[0]
    if noop is not None:
        lines.append(f"no-op closures/s, 1 ps, against the absolute floor of {NOOP_TARGET:,.0f} set earlier: {noop:,.0f} -> "
                     f"{'ok' if noop >= NOOP_TARGET else 'MISSED'} (the host's speed moves it; TensorFlow's rate "
                     "in the same run is the reference)")
    floor = clusters.get("floor")
    mlp = (clusters.get("ours_1ps") or {}).get("mlp")
    if floor and mlp and "ps_bytes_per_step" in mlp:
        wire_ms = 1e3 * mlp["ps_bytes_per_step"] / floor["loopback_bytes_per_s"]
        step_ms = wire_ms + floor["compute_ms"]
        cores, measured = h.usable_cores(), h.median(mlp["rates"])
        bound = 1e3 * cores / mlp["cluster_cpu_ms"]
        lines.append(f"The MLP's limit, 1 ps: a step moves {mlp['ps_bytes_per_step'] / 2**20:.1f} MiB (loopback, one TCP "
                     f"stream, {floor['loopback_bytes_per_s'] / 2**30:.2f} GiB/s measured now: {wire_ms:.1f} ms) and "
                     f"computes {floor['compute_ms']:.1f} ms (forward, backward, update, one thread): one worker's floor "
                     f"{step_ms:.1f} ms. The cluster's CPU a step ({mlp['cluster_cpu_ms']:.1f} ms: workers, ps, "
                     f"coordinator) bounds {cores} cores at {bound:.0f} steps/s; measured {measured:.1f}, "
                     f"{measured / bound:.0%} of that bound.")
    if tf_why:
        lines.append(f"TensorFlow skipped ({tf_why}): the MLP reference is TensorFlow's earlier {TF_NOTES[0]:.0f}-"
                     f"{TF_NOTES[1]:.0f} steps/s (~{TF_NOTES[2]:.0f} no-op closures/s).")
    emb = (clusters.get("ours_2ps") or {}).get("emb", [])
    if emb:
        table = [[f"{e['rows']:,}", e["ids_per_example"], f"{h.median(e['rates']):,.1f}", f"{e['rows_per_step']:.1f}",
                  f"{e['ps_bytes_per_step'] / 1024:.1f}"] for e in emb]
        lines += ["", "Embedding, 2 ps: bytes sent + received on the ps connections per step (gRPC framing, "
                      "the dense head and the MACs included)", h.format_table(
                          ["table rows", "ids/example", "steps/s", "rows used/step", "ps KiB/step"], table)]
        by = {(e["rows"], e["ids_per_example"]): e for e in emb}
        a, b, small = by.get((1000000, 8)), by.get((1000000, 32)), by.get((100000, 8))
        if a and b and small:
            per_row = (b["ps_bytes_per_step"] - a["ps_bytes_per_step"]) / (b["rows_per_step"] - a["rows_per_step"])
            table_ratio = small["ps_bytes_per_step"] / a["ps_bytes_per_step"]
            lines.append(f"bytes per extra row used (32 vs 8 ids): {per_row:.0f}; 100k vs 1M table, same ids: "
                         f"x{table_ratio:.3f} -> {'ok' if abs(table_ratio - 1) <= 0.05 else 'MISSED'} "
                         "(proportional to rows used, not to the table)")
    for name, cluster in clusters.items():
        if cluster.get("mlp"):
            m = cluster["mlp"]
            lines.append(f"{name}: MLP rounds {', '.join(f'{r:.1f}' for r in m['rates'])} steps/s; loss "
                         f"{m['first_loss']:.3f} -> {m['last_loss']:.3f}"
                         + (f"; ps traffic {m['ps_bytes_per_step'] / 2**20:.1f} MiB/step" if "ps_bytes_per_step" in m
                            else "") + f"; cluster CPU {m['cluster_cpu_ms']:.1f} ms/step")
        for e in cluster.get("emb", []):
            lines.append(f"{name}: embedding {e['rows']:,} x {e['ids_per_example']} ids: cluster CPU "
                         f"{e['cluster_cpu_ms']:.2f} ms/step")
    lines += [f"FAILED {name}: {error.splitlines()[0]}" for name, error in errors.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="timed MLP steps per round (default 100; --quick 60)")
    p.add_argument("--rounds", type=int, help="timed rounds per measurement (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, help="untimed steps/closures first (default 20; --quick 10)")
    p.add_argument("--emb-steps", type=int, help="timed embedding steps per round (default 100; --quick 40)")
    p.add_argument("--noop-count", type=int, help="no-op closures per round (default 1000; --quick 500)")
    p.add_argument("--sched-count", type=int, default=2000, help="schedule() calls per round (default 2000)")
    p.add_argument("--quick", action="store_true", help="smoke test")
    p.add_argument("--json", metavar="PATH", help="also write every raw measurement here")
    p.add_argument("--profile", action="store_true",
                   help="also a 1-ps MLP cluster profiled with torch.profiler on the coordinator and the workers")
    p.add_argument("--skip-tf", action="store_true", help="do not try TensorFlow")
    p.add_argument("--clusters", metavar="NAMES", help="only these, comma-separated: ours_1ps,ours_2ps,tf_1ps,tf_2ps")
    p.add_argument("--tf-python", default=sys.executable, help="interpreter for TensorFlow (default: this one)")
    p.add_argument("--max-other-load", type=float, default=0.3,
                   help="a round during which other processes kept more cores busy is re-run")
    p.add_argument("--extra-rounds", type=int, help="re-runs of disturbed rounds, at most (default 2; --quick 1)")
    p.add_argument("--max-wait", type=float, help="seconds in all to wait for a quiet machine (default 30)")
    p.add_argument("--timeout", type=float, help="seconds per cluster before it is killed (default 240; --quick 80)")
    p.add_argument("--chief", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chief:   # run by `stratagem launch` as the cluster's chief
        spec = json.loads(args.chief)
        result = chief_main(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0
    q = args.quick
    for key, value in dict(steps=60 if q else 100, rounds=1 if q else 3, warmup=10 if q else 20,
                           emb_steps=40 if q else 100, noop_count=500 if q else 1000, extra_rounds=1 if q else 2,
                           max_wait=10.0 if q else 30.0, timeout=80.0 if q else 240.0).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    h.exit_cleanly_on_sigterm()
    emb_all = [[1000000, 8], [1000000, 32], [100000, 8]]
    one = ("noop,sched,mlp", []) if q else ("noop,sched,emb,mlp,noop_loaded", [[1000000, 8]])
    two = ("emb,mlp", emb_all) if q else ("noop,emb,mlp", emb_all)
    plan = [("ours_1ps", 1, *one), ("ours_2ps", 2, *two), ("tf_1ps", 1, *one), ("tf_2ps", 2, *two)]
    wanted = set(args.clusters.split(",")) if args.clusters else None
    plan = [c for c in plan if (wanted is None or c[0] in wanted) and not (args.skip_tf and c[0].startswith("tf_"))]
    tf_why = "--skip-tf" if args.skip_tf else (tensorflow_missing(args.tf_python)
                                                if any(c[0].startswith("tf_") for c in plan) else "not run")
    clusters: dict = {}
    errors: dict = {}
    quiet = h.Quiet(args.max_wait, args.max_other_load)
    with tempfile.TemporaryDirectory(prefix="sg_ps_bench_") as tmp:
        for name, num_ps, phases, emb in plan:
            if name.startswith("tf_") and tf_why:
                continue
            quiet.wait()
            try:
                clusters[name] = run_cluster(args, tmp, name, num_ps, phases, emb)
            except (RuntimeError, TimeoutError, OSError) as error:
                h.log(f"[{name}] FAILED: {error}")
                errors[name] = str(error)
        quiet.wait()
        clusters["floor"] = measure_floor()
        if args.profile:
            try:
                profile = run_cluster(args, tmp, "profile_1ps", 1, "mlp", [], profile=True)["profile"]
            except (RuntimeError, TimeoutError, OSError) as error:
                errors["profile_1ps"], profile = str(error), None
    print(f"ParameterServerStrategy benchmark: {WORKERS} workers, local clusters over loopback gRPC, "
          f"{h.usable_cores()} cores, commit {h.git_commit()}\n")
    print("\n".join(report(args, clusters, errors, tf_why)))
    if args.profile and profile:
        print(f"\nProfile, MLP with 1 ps: coordinator ({profile['steps']} steps scheduled)")
        print(h.profile_table(profile["coordinator"], profile["steps"]))
        for i, events in enumerate(profile["workers"]):
            print(f"\nworker {i} (ms per cluster step; each worker runs about half of them)")
            print(h.profile_table(events, profile["steps"]))
    warning = h.load_warning()
    if warning:
        print(warning)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "clusters": clusters, "errors": errors}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
