"""Coordinator (chief) script of ``benchmarks/parameter_server.py``; not meant to be run by hand.

Modes (the first argument):

- ``stratagem``: run as the chief of ``python -m stratagem launch --workers 2 --ps M
  _ps_coordinator.py stratagem --out FILE ...``: measures no-op closures, the scheduling
  rate, embedding training (steps/s and ps bytes per step) and MLP training with
  ``sg.ParameterServerStrategy`` + ``sg.ClusterCoordinator``, and writes one JSON object to
  ``--out``.
- ``tf-chief``: the same measurements with ``tf.distribute.experimental.ParameterServerStrategy``
  and ``ClusterCoordinator`` (TF_CONFIG set by the parent, which also starts the servers).
- ``tf-server``: a TensorFlow worker or ps task (``tf.distribute.Server``), until killed.

Phases run in this order, because a stratagem worker pulls *every* dense variable it has
seen before each closure (``WorkerRuntime.pull_dense``): no-op closures first (workers
know no variable yet), then the embedding models (small dense heads), then the MLP, then
no-op closures again ("noop_loaded": what a no-op costs once the MLP is known).

``--profile`` (stratagem only) puts wall-clock timers around the worker runtime's phases
(whole request, pull_dense, backward, push, encode/decode, message authentication) by monkeypatching at
run time from inside a scheduled closure, and around the coordinator's dispatch; and, when
``py-spy`` is installed, samples the ps process(es) during the timed MLP steps. Nothing
under ``stratagem/`` is edited.

Every rate is measured in rounds; a round during which processes outside the cluster kept
more than ``--max-other-load`` cores busy (machine busy time from /proc/stat minus the CPU
time of this process and its sibling tasks) is marked disturbed and re-run, at most
``--extra-rounds`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

BATCH = 64
MLP_LAYERS = (784, 1024, 1024, 10)
MLP_LR, MLP_MOMENTUM = 0.01, 0.9
EMB_DIM, EMB_CLASSES, EMB_LR = 64, 10, 0.1
DISTINCT = 8                       # distinct synthetic MLP batches per worker, cycled


def _noop():
    """A no-op closure (module level: cloudpickle ships it by value from __main__)."""
    return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cluster_cpu_s() -> float:
    """CPU seconds used so far by this cluster: this process and its siblings (the other tasks
    started by the same launcher -- ``stratagem launch`` or the benchmark for TensorFlow)."""
    parent, total = os.getppid(), 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        # after the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        if int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def _cpu_sample():
    """(machine busy s from /proc/stat or None, cluster CPU s, this process's CPU s, monotonic s)."""
    now = time.monotonic()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    own = usage.ru_utime + usage.ru_stime
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(fields[:3]) + sum(fields[5:8])) / _CLK_TCK   # user nice system irq softirq steal
        return busy, _cluster_cpu_s(), own, now
    except (OSError, ValueError, IndexError):
        return None, None, own, now


class _Window:
    """Wall time and cores busy over a block: machine-wide, by the cluster, by the coordinator,
    and by other processes (``foreign_cores`` = machine - cluster: contention)."""

    def __enter__(self):
        self._start = _cpu_sample()
        return self

    def __exit__(self, *exc):
        end = _cpu_sample()
        self.seconds = s = end[3] - self._start[3]
        self.coordinator_cores = (end[2] - self._start[2]) / s
        self.machine_cores = self.cluster_cores = self.foreign_cores = None
        if self._start[0] is not None and end[0] is not None:
            self.machine_cores = (end[0] - self._start[0]) / s
            self.cluster_cores = (end[1] - self._start[1]) / s
            self.foreign_cores = max(0.0, self.machine_cores - self.cluster_cores)

    def record(self) -> dict:
        return {"seconds": self.seconds, "machine_cores": self.machine_cores, "cluster_cores": self.cluster_cores,
                "foreign_cores": self.foreign_cores, "coordinator_cores": self.coordinator_cores}


_LIMITS = {"max_other_load": 0.3, "extra_rounds": 3}


def _rate_rounds(run_round, count: int, rounds: int) -> dict:
    """Runs ``run_round(count)`` until ``rounds`` rounds ran without contention (other processes
    busier than ``--max-other-load`` cores), at most ``--extra-rounds`` more; per round:
    count / wall seconds. ``kept`` flags the undisturbed rounds."""
    rates, windows, kept = [], [], []
    while sum(kept) < rounds and len(rates) < rounds + _LIMITS["extra_rounds"]:
        with _Window() as w:
            run_round(count)
        rates.append(count / w.seconds)
        windows.append(w.record())
        kept.append(w.foreign_cores is None or w.foreign_cores <= _LIMITS["max_other_load"])
    return {"rates": rates, "kept": kept, "count": count, "windows": windows}


# ================================================================ stratagem

def _ps_bytes(strategy) -> dict:
    """Per ps op: calls, bytes_in, bytes_out, summed over the parameter servers."""
    total: dict = {}
    for client in strategy._ps_clients:
        for op, counts in client.stats()["ops"].items():
            entry = total.setdefault(op, {"calls": 0, "bytes_in": 0, "bytes_out": 0})
            for key in entry:
                entry[key] += counts.get(key, 0)
    return total


def _delta(after: dict, before: dict) -> dict:
    return {op: {k: v - before.get(op, {}).get(k, 0) for k, v in counts.items()} for op, counts in after.items()}


def run_stratagem(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import stratagem as sg

    torch.set_num_threads(1)   # the coordinator computes nothing; leave the cores to the cluster
    partitioner = sg.FixedShardsPartitioner(args.shards) if args.shards > 1 else None
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(), variable_partitioner=partitioner)
    coordinator = sg.ClusterCoordinator(strategy)
    result: dict = {"framework": "stratagem", "shards": args.shards, "num_ps": len(strategy._ps_clients),
                    "num_workers": len(strategy._worker_addresses), "torch": torch.__version__}
    profiler = _Profiler(coordinator) if args.profile else None

    def noops(count: int) -> None:
        for _ in range(count):
            coordinator.schedule(_noop)
        coordinator.join()

    def noop_phase(name: str, count: int) -> None:
        noops(args.warmup)
        result[name] = _rate_rounds(noops, count, args.rounds)

    phases = args.phases.split(",")
    if profiler is not None:
        profiler.install_on_workers()
    if "noop" in phases:
        noop_phase("noop", args.noop_count)
    if "sched" in phases:
        def schedule_only(count: int) -> None:
            for _ in range(count):
                coordinator.schedule(_noop)
        noops(args.warmup)
        rates = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            schedule_only(args.sched_count)
            rates.append(args.sched_count / (time.perf_counter() - t0))
            coordinator.join()   # drain before the next round (untimed)
        result["sched"] = {"rates": rates, "count": args.sched_count}

    if "emb" in phases:
        class EmbeddingModel(nn.Module):
            def __init__(self, rows: int):
                super().__init__()
                self.embedding = nn.Embedding(rows, EMB_DIM)
                self.head = nn.Linear(EMB_DIM, EMB_CLASSES)

            def forward(self, ids):
                return self.head(self.embedding(ids).mean(dim=1))

        result["emb"] = []
        for spec in args.emb.split(","):
            rows, ids_per_example = (int(v) for v in spec.split(":"))
            t0 = time.perf_counter()
            torch.manual_seed(0)
            with strategy.scope():
                model = EmbeddingModel(rows)
                optimizer = torch.optim.SGD(model.parameters(), lr=EMB_LR)

            def emb_dataset_fn(ctx, rows=rows, k=ids_per_example):
                g = torch.Generator().manual_seed(1000 + ctx.input_pipeline_id)

                def batches():
                    while True:
                        yield (torch.randint(0, rows, (BATCH, k), generator=g),
                               torch.randint(0, EMB_CLASSES, (BATCH,), generator=g))
                return batches()

            iterator = iter(coordinator.create_per_worker_dataset(emb_dataset_fn))

            def emb_step(it):
                ids, labels = next(it)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(ids), labels)
                loss.backward()
                optimizer.step()
                return loss.detach()

            def emb_steps(count: int) -> None:
                for _ in range(count):
                    coordinator.schedule(emb_step, args=(iterator,))
                coordinator.join()

            emb_steps(args.warmup)
            setup_s = time.perf_counter() - t0
            before = _ps_bytes(strategy)
            measured = _rate_rounds(emb_steps, args.emb_steps, args.rounds)
            traffic = _delta(_ps_bytes(strategy), before)
            steps = args.emb_steps * len(measured["rates"])
            sparse = {op: traffic.get(op, {"calls": 0, "bytes_in": 0, "bytes_out": 0})
                      for op in ("pull_rows", "push_rows")}
            sparse_bytes = sum(c["bytes_in"] + c["bytes_out"] for c in sparse.values())
            result["emb"].append({
                "rows": rows, "ids_per_example": ids_per_example, "setup_s": setup_s, **measured,
                "steps": steps, "sparse_bytes_per_step": sparse_bytes / steps,
                # pull_rows receives int64 row ids: 8 bytes per distinct row a step used
                "rows_per_step": sparse["pull_rows"]["bytes_in"] / 8 / steps,
                "ops_per_step": {op: {k: v / steps for k, v in c.items()} for op, c in traffic.items()},
                "table_shards": list(getattr(model.embedding.weight, "shard_shapes", None)
                                     or [tuple(model.embedding.weight.shape)])})
            del model, optimizer

    if "mlp" in phases:
        torch.manual_seed(0)
        with strategy.scope():
            layers = []
            for i, (n_in, n_out) in enumerate(zip(MLP_LAYERS[:-1], MLP_LAYERS[1:])):
                layers.append(nn.Linear(n_in, n_out))
                if i < len(MLP_LAYERS) - 2:
                    layers.append(nn.ReLU())
            mlp = nn.Sequential(*layers)
            mlp_optimizer = torch.optim.SGD(mlp.parameters(), lr=MLP_LR, momentum=MLP_MOMENTUM)

        def mlp_dataset_fn(ctx):
            g = torch.Generator().manual_seed(ctx.input_pipeline_id)
            xs = torch.randn(DISTINCT, BATCH, MLP_LAYERS[0], generator=g)
            ys = torch.randint(0, MLP_LAYERS[-1], (DISTINCT, BATCH), generator=g)

            def batches():
                i = 0
                while True:
                    yield xs[i % DISTINCT], ys[i % DISTINCT]
                    i += 1
            return batches()

        mlp_iterator = iter(coordinator.create_per_worker_dataset(mlp_dataset_fn))

        def mlp_step(it):
            x, y = next(it)
            mlp_optimizer.zero_grad()
            loss = F.cross_entropy(mlp(x), y)
            loss.backward()
            mlp_optimizer.step()
            return loss.detach()

        losses = []

        def mlp_steps(count: int) -> None:
            values = [coordinator.schedule(mlp_step, args=(mlp_iterator,)) for _ in range(count)]
            coordinator.join()
            losses.extend(float(v.fetch()) for v in values)

        mlp_steps(args.warmup)
        if profiler is not None:
            profiler.reset()
            profiler.start_py_spy()
        before = _ps_bytes(strategy)
        result["mlp"] = _rate_rounds(mlp_steps, args.steps, args.rounds)
        traffic = _delta(_ps_bytes(strategy), before)
        steps = args.steps * len(result["mlp"]["rates"])
        result["mlp"]["dense_bytes_per_step"] = sum(
            traffic.get(op, {}).get("bytes_in", 0) + traffic.get(op, {}).get("bytes_out", 0)
            for op in ("pull", "push")) / steps
        result["mlp"]["first_loss"] = sum(losses[:10]) / 10
        result["mlp"]["last_loss"] = sum(losses[-20:]) / 20
        if profiler is not None:
            result["profile"] = profiler.collect(steps)
        if "noop_loaded" in phases:
            noop_phase("noop_loaded", max(20, args.noop_count // 10))   # each pulls the MLP: slow
    coordinator.shutdown()
    return result


# ============================================================ profiling (stratagem)

def _install_worker_timers():
    """Runs on a worker (as a scheduled closure): wraps the runtime's phases with timers."""
    import time as _time

    from stratagem.coordinator import worker as worker_module
    from stratagem.rpc import auth, transport

    if getattr(worker_module, "_bench_timers", None) is not None:
        return True
    timers: dict = {}

    def wrap(owner, attr, name):
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            t0 = _time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                entry = timers.setdefault(name, [0.0, 0])
                entry[0] += _time.perf_counter() - t0
                entry[1] += 1
        setattr(owner, attr, wrapper)

    import torch

    # handlers are bound methods captured at start-up: time the server's whole request instead
    wrap(transport.RpcServer, "_handle", "RpcServer._handle (whole request: MAC, decode, run, encode)")
    wrap(torch.autograd, "backward", "backward (autograd)")
    wrap(worker_module.WorkerRuntime, "pull_dense", "pull_dense (RPC + copy into params)")
    wrap(worker_module.WorkerRuntime, "push_gradients", "push_gradients (RPC, wait for ps apply)")
    # codec and MAC are module functions / methods imported by name into transport
    wrap(transport, "encode", "encode (cloudpickle + tensor framing)")
    wrap(transport, "decode", "decode")
    wrap(auth.Authenticator, "sign_request", "MAC sign_request")
    wrap(auth.Authenticator, "verify_reply", "MAC verify_reply")
    wrap(auth.Authenticator, "verify_request", "MAC verify_request")
    wrap(auth.Authenticator, "sign_reply", "MAC sign_reply")
    worker_module._bench_timers = timers
    return True


def _read_worker_timers(reset: bool = False):
    from stratagem.coordinator import worker as worker_module

    timers = getattr(worker_module, "_bench_timers", None) or {}
    snapshot = {k: list(v) for k, v in timers.items()}
    if reset:
        for v in timers.values():
            v[0], v[1] = 0.0, 0
    import os as _os
    return {"pid": _os.getpid(), "timers": snapshot,
            "cpu_s": sum(_os.times()[:2])}


class _Profiler:
    """Timers on the workers (installed by a closure) and around the coordinator's dispatch."""

    def __init__(self, coordinator):
        from stratagem.coordinator import coordinator as coord_module
        from stratagem.rpc import auth, transport

        self.coordinator = coordinator
        self.timers: dict = {}
        self._wrap(coord_module._Worker, "_run", "coordinator: _Worker._run (RPC 'run' round trip)")
        self._wrap(coord_module._Worker, "_prepare", "coordinator: _Worker._prepare")
        self._wrap(coord_module.ClusterCoordinator, "schedule", "coordinator: schedule()")
        self._wrap(transport, "encode", "coordinator: encode")
        self._wrap(transport, "decode", "coordinator: decode")
        self._wrap(auth.Authenticator, "sign_request", "coordinator: MAC sign_request")
        self._wrap(auth.Authenticator, "verify_reply", "coordinator: MAC verify_reply")
        from stratagem.strategies import parameter_server as ps_module
        self._wrap(ps_module.ParameterServerStrategy, "_sync_before_schedule",
                   "coordinator: _sync_before_schedule")

    def _wrap(self, owner, attr, name):
        original = getattr(owner, attr)
        timers = self.timers

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                entry = timers.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
        setattr(owner, attr, wrapper)

    def _on_every_worker(self, fn, *args):
        """Runs ``fn`` on each worker: schedules batches of it until every worker's pid has answered
        (a worker still starting gets none of the first batches)."""
        answers: dict = {}
        deadline = time.monotonic() + 120
        while len(answers) < len(self.coordinator._workers) and time.monotonic() < deadline:
            values = [self.coordinator.schedule(fn, args=args) for _ in range(2 * len(self.coordinator._workers))]
            self.coordinator.join()
            for v in values:
                answer = v.fetch()
                answers.setdefault(answer["pid"], answer)
            if len(answers) < len(self.coordinator._workers):
                time.sleep(0.2)
        return answers

    def install_on_workers(self):
        self._on_every_worker(_install_and_pid)

    def start_py_spy(self, seconds: float = 6.0):
        """Samples the ps process(es) with py-spy, when it is installed, during the timed steps."""
        import shutil
        import subprocess
        import tempfile

        self._spies = []
        spy = shutil.which("py-spy") or next((p for p in (os.path.join(os.path.dirname(sys.executable), "py-spy"),)
                                              if os.path.exists(p)), None)
        if spy is None:
            self._spy_note = "py-spy not found (pip install py-spy): no ps-side profile"
            return
        self._spy_note = None
        for pid in _ps_pids():
            out = tempfile.mktemp(suffix=f"_ps{pid}.txt")
            proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                     "--rate", "200", "--format", "raw", "--nonblocking", "-o", out],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._spies.append((pid, proc, out, seconds))

    def _collect_py_spy(self) -> dict:
        if getattr(self, "_spy_note", None):
            return {"note": self._spy_note}
        result = {}
        for pid, proc, out, seconds in getattr(self, "_spies", []):
            try:
                _, err = proc.communicate(timeout=seconds + 30)
            except Exception:  # noqa: BLE001 - a profile is optional
                proc.kill()
                err = b"timed out"
            if os.path.exists(out):
                result[f"ps pid {pid}"] = _summarize_spy(out, seconds)
                os.unlink(out)
            else:
                result[f"ps pid {pid}"] = {"error": err.decode(errors="replace")[-300:]}
        return result

    def reset(self):
        self._worker_cpu0 = {pid: w["cpu_s"] for pid, w in self._on_every_worker(_read_worker_timers, True).items()}
        for v in self.timers.values():
            v[0], v[1] = 0.0, 0
        self._cpu0 = sum(os.times()[:2])
        self._wall0 = time.perf_counter()

    def collect(self, steps: int) -> dict:
        wall = time.perf_counter() - self._wall0
        coordinator_cpu = sum(os.times()[:2]) - self._cpu0
        coordinator = {k: {"total_s": v[0], "calls": v[1]} for k, v in self.timers.items()}
        workers = self._on_every_worker(_read_worker_timers, False)
        return {"steps": steps, "wall_s": wall, "coordinator": coordinator, "coordinator_cpu_s": coordinator_cpu,
                "ps_py_spy": self._collect_py_spy(),
                "workers": {str(pid): {"cpu_s": w["cpu_s"] - self._worker_cpu0.get(pid, w["cpu_s"]),
                                       "timers": {k: {"total_s": v[0], "calls": v[1]}
                                                  for k, v in w["timers"].items()}}
                            for pid, w in workers.items()}}


# py-spy categories: the first whose marker appears in a sample's stack takes the sample
_SPY_CATEGORIES = (
    ("message MAC, GMAC + HMAC (stratagem/rpc/auth.py)", ("stratagem/rpc/auth.py", "hmac.py")),
    ("codec.encode (stratagem/rpc/codec.py)", ("encode (stratagem/rpc/codec.py",)),
    ("codec.decode (stratagem/rpc/codec.py)", ("decode (stratagem/rpc/codec.py",)),
    ("ps push: optimizer apply (stratagem/ps/service.py)", ("push (stratagem/ps/service.py",)),
    ("ps pull: clone (stratagem/ps/service.py)", ("pull (stratagem/ps/service.py",)),
    ("gRPC (grpc/_server.py, _channel.py: send/receive, copies)", ("grpc/",)),
    ("thread pool / other Python", ("(",)),
)


def _summarize_spy(path: str, seconds: float) -> dict:
    """Collapsed py-spy stacks -> share of samples and cores per category (plus top leaves)."""
    totals: dict = {}
    leaves: dict = {}
    samples = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            samples += n
            name = "native threads (no Python frame: gRPC core I/O)"
            for category, markers in _SPY_CATEGORIES:
                if any(marker in stack for marker in markers):
                    name = category
                    break
            totals[name] = totals.get(name, 0) + n
            leaf = stack.split(";")[-1][:100]
            leaves[leaf] = leaves.get(leaf, 0) + n
    top = sorted(leaves.items(), key=lambda kv: -kv[1])[:6]
    return {"samples": samples, "seconds": seconds,
            "categories": {k: v / max(samples, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_leaves": {k: v / max(samples, 1) for k, v in top}}


def _ps_pids() -> list[int]:
    """The ps tasks of this cluster: siblings whose TF_CONFIG names a ps task."""
    parent, pids = os.getppid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            task = json.loads(env.get(b"TF_CONFIG", b"{}")).get("task", {})
        except (OSError, ValueError):
            continue
        if task.get("type") == "ps":
            pids.append(int(entry))
    return sorted(pids)


def _install_and_pid():
    import os as _os
    _install_worker_timers()
    return {"pid": _os.getpid()}


# ================================================================ TensorFlow

def run_tf_server() -> None:
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc", start=True)
    print(f"tf server {resolver.task_type} {resolver.task_id} up", flush=True)
    server.join()


def run_tf(args) -> dict:
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(args.shards)
                   if args.shards > 1 else None)
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    result: dict = {"framework": "tensorflow", "tf": tf.__version__, "shards": args.shards}

    def parts(v):   # a ShardedVariable's shards, or the variable itself
        return [v] if isinstance(v, tf.Variable) else list(v.variables)

    def whole(v):
        p = parts(v)
        return p[0] if len(p) == 1 else tf.concat(p, axis=0)

    @tf.function
    def noop():
        return tf.constant(0)

    def noops(count):
        for _ in range(count):
            coordinator.schedule(noop)
        coordinator.join()

    def per_worker(dataset_fn):
        @tf.function
        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)
        return iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    phases = args.phases.split(",")
    if "noop" in phases:
        noops(args.warmup)
        result["noop"] = _rate_rounds(noops, args.noop_count, args.rounds)
    if "sched" in phases:
        rates = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.sched_count):
                coordinator.schedule(noop)
            rates.append(args.sched_count / (time.perf_counter() - t0))
            coordinator.join()
        result["sched"] = {"rates": rates, "count": args.sched_count}

    if "emb" in phases:   # plain SGD with sparse (IndexedSlices) updates, as on our side
        result["emb"] = []
        for spec in args.emb.split(","):
            rows, k = (int(v) for v in spec.split(":"))
            t0 = time.perf_counter()
            with strategy.scope():
                table = tf.Variable(tf.random.normal([rows, EMB_DIM]))
                head_w = tf.Variable(tf.random.normal([EMB_DIM, EMB_CLASSES], stddev=EMB_DIM ** -0.5))
                head_b = tf.Variable(tf.zeros([EMB_CLASSES]))

            def emb_data(ctx, rows=rows, k=k):
                return tf.data.Dataset.range(1).repeat().map(lambda _: (
                    tf.random.uniform([BATCH, k], 0, rows, tf.int64),
                    tf.random.uniform([BATCH], 0, EMB_CLASSES, tf.int64)))

            iterator = per_worker(emb_data)
            variables = parts(table) + parts(head_w) + parts(head_b)

            @tf.function
            def emb_step(it):
                def replica_fn(ids, labels):
                    with tf.GradientTape() as tape:
                        looked = tf.nn.embedding_lookup(table, ids)
                        logits = tf.matmul(tf.reduce_mean(looked, axis=1), whole(head_w)) + whole(head_b)
                        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
                    for var, grad in zip(variables, tape.gradient(loss, variables)):
                        with tf.device(var.device):
                            if isinstance(grad, tf.IndexedSlices):
                                var.scatter_sub(tf.IndexedSlices(EMB_LR * grad.values, grad.indices))
                            elif grad is not None:
                                var.assign_sub(EMB_LR * grad)
                    return loss
                return strategy.run(replica_fn, args=next(it))

            def emb_steps(count):
                for _ in range(count):
                    coordinator.schedule(emb_step, args=(iterator,))
                coordinator.join()

            emb_steps(args.warmup)
            setup_s = time.perf_counter() - t0
            measured = _rate_rounds(emb_steps, args.emb_steps, args.rounds)
            result["emb"].append({"rows": rows, "ids_per_example": k, "setup_s": setup_s, **measured})

    if "mlp" in phases:
        with strategy.scope():
            weights, momenta = [], []
            for n_in, n_out in zip(MLP_LAYERS[:-1], MLP_LAYERS[1:]):
                bound = n_in ** -0.5   # torch.nn.Linear's default init range
                weights += [tf.Variable(tf.random.uniform([n_in, n_out], -bound, bound)),
                            tf.Variable(tf.random.uniform([n_out], -bound, bound))]
                momenta += [tf.Variable(tf.zeros([n_in, n_out])), tf.Variable(tf.zeros([n_out]))]

        def mlp_data(ctx):
            x = tf.random.stateless_normal([DISTINCT, BATCH, MLP_LAYERS[0]], seed=[ctx.input_pipeline_id, 0])
            y = tf.random.stateless_uniform([DISTINCT, BATCH], seed=[ctx.input_pipeline_id, 1],
                                            minval=0, maxval=MLP_LAYERS[-1], dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat()

        iterator = per_worker(mlp_data)
        flat_w = [p for w in weights for p in parts(w)]
        flat_m = [p for m in momenta for p in parts(m)]

        @tf.function
        def mlp_step(it):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    h = x
                    for i in range(0, len(weights), 2):
                        h = tf.matmul(h, whole(weights[i])) + whole(weights[i + 1])
                        if i + 2 < len(weights):
                            h = tf.nn.relu(h)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))
                for w, m, g in zip(flat_w, flat_m, tape.gradient(loss, flat_w)):
                    with tf.device(w.device):           # the update runs on the ps, as ours does
                        m.assign(MLP_MOMENTUM * m + g)  # torch.optim.SGD's momentum rule
                        w.assign_sub(MLP_LR * m)
                return loss
            return strategy.run(replica_fn, args=next(it))

        losses = []

        def mlp_steps(count):
            values = [coordinator.schedule(mlp_step, args=(iterator,)) for _ in range(count)]
            coordinator.join()
            losses.extend(float(v.fetch()) for v in values)

        mlp_steps(args.warmup)
        result["mlp"] = _rate_rounds(mlp_steps, args.steps, args.rounds)
        result["mlp"]["first_loss"] = sum(losses[:10]) / 10
        result["mlp"]["last_loss"] = sum(losses[-20:]) / 20
        if "noop_loaded" in phases:
            noops(args.warmup)
            result["noop_loaded"] = _rate_rounds(noops, max(20, args.noop_count // 10), args.rounds)
    return result


# ===================================================================== main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("stratagem", "tf-chief", "tf-server"))
    parser.add_argument("--out")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--phases", default="noop,sched,emb,mlp,noop_loaded")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--noop-count", type=int, default=1000)
    parser.add_argument("--sched-count", type=int, default=2000)
    parser.add_argument("--emb", default="1000000:8")
    parser.add_argument("--emb-steps", type=int, default=100)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--max-other-load", type=float, default=0.3)
    parser.add_argument("--extra-rounds", type=int, default=3)
    args = parser.parse_args(argv)
    _LIMITS.update(max_other_load=args.max_other_load, extra_rounds=args.extra_rounds)
    if args.mode == "tf-server":
        run_tf_server()
        return 0
    started = time.time()
    result = run_stratagem(args) if args.mode == "stratagem" else run_tf(args)
    result["wall_s"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({"done": args.out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
