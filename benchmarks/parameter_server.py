#!/usr/bin/env python
"""ParameterServerStrategy + ClusterCoordinator: training rate, embedding traffic, RPC floor.

Every measurement runs in a real local cluster started with ``python -m stratagem launch
--workers 2 --ps M benchmarks/_ps_coordinator.py ...`` (2 worker tasks and M parameter
servers running ``stratagem server``, the coordinator script as the chief; all on loopback,
with the cluster token and a MAC on every message, exactly as users run it). The script
measures, side by side in one invocation:

(a) asynchronous MLP training: the core benchmark's MLP 784-1024-1024-10 (1.86 M
    parameters), batch 64 per step, SGD (lr 0.01, momentum 0.9) on synthetic data from a
    per-worker ``dataset_fn`` generator (8 distinct batches per worker, cycled), with 1 ps
    and with 2 ps (``sg.FixedShardsPartitioner(2)``). steps/s = steps scheduled / wall time
    from the first ``schedule`` to the return of ``join()`` (per round; median of rounds).
(b) the same with an embedding model: ``nn.Embedding(rows, 64)``, mean of the ``ids`` rows
    looked up per example, ``nn.Linear(64, 10)`` head, cross-entropy, batch 64, SGD
    (lr 0.1; row-sparse updates on the ps). steps/s, and the bytes the ps moved per step for
    the table (``pull_rows`` + ``push_rows``: bytes in + out, from every ps's ``stats()``),
    for 1M x 8 ids, 1M x 32 ids and 100k x 8 ids, to show that the bytes are proportional
    to the rows a step uses and do not grow with the table.
(c) the RPC floor: the rate of no-op closures (``coordinator.schedule(_noop)`` then
    ``join()``, ``_noop`` a module-level function returning None) with 2 workers, on fresh
    workers and again once the workers know the MLP ("noop, MLP known": a stratagem worker
    pulls every dense variable it knows before each closure); and the coordinator's
    scheduling rate (``schedule()`` calls/s, not waiting for them to run).
(d) TensorFlow's ``tf.distribute.experimental.ParameterServerStrategy`` + ``ClusterCoordinator``
    with the same topologies and models (TF_CONFIG-launched ``tf.distribute.Server`` tasks;
    raw variables, the same SGD-with-momentum rule, ``tf.nn.embedding_lookup`` with sparse
    ``scatter_sub`` updates), when ``import tensorflow`` works in ``--tf-python``
    (default: this interpreter); otherwise "skipped" and NOTES' measurement (51-60 steps/s,
    ~880 no-op closures/s) is the reference.

Targets (from the issue): no-op closures >= 1,000/s; MLP steps/s >= TensorFlow's (measured,
or NOTES' 51-60 when TensorFlow is absent); embedding bytes/step proportional to the rows used.

Contention (the development machines have 2 shared cores): before each cluster the script
waits (``--max-wait`` s in all) for other processes to go quiet; inside a cluster every
round records how many cores processes *outside* the cluster kept busy, and a round above
``--max-other-load`` is re-run (``--extra-rounds``). Rates are medians of the undisturbed
rounds; a value marked ``!`` had none (median of all its rounds).

``--profile`` adds a 1-ps MLP cluster with wall-clock timers on the coordinator and inside
the workers (installed by a scheduled closure: nothing in ``stratagem/`` is edited) and, when
``py-spy`` is on PATH, a py-spy sample of the ps process during the timed steps.

    python benchmarks/parameter_server.py                  # default run, ~3-4 min on 2 cores
    python benchmarks/parameter_server.py --quick          # smoke test, < 90 s
    python benchmarks/parameter_server.py --json out.json  # also write every raw measurement
    python benchmarks/parameter_server.py --profile        # + where an MLP step's time goes
    python benchmarks/parameter_server.py --clusters ours_2ps   # a subset (ours_1ps ours_2ps tf_1ps tf_2ps)
    /path/to/venv-with-tf/bin/python benchmarks/parameter_server.py   # with TensorFlow's rows

Exit status: 0 when every cluster ran (targets missed or not), 1 when one failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO_ROOT, format_table, git_state, loadavg, median, usable_cores  # noqa: E402

COORDINATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ps_coordinator.py")
WORKERS = 2
NOOP_TARGET = 1000.0                  # no-op closures/s, at least
TF_NOTES_STEPS = (51.0, 60.0)         # NOTES: TF's PS strategy here, 2 workers, MLP, batch 64
TF_NOTES_NOOP = 880.0
PROPORTIONAL_TOLERANCE = 0.05         # bytes per row used may vary this much between configs
TABLE_TOLERANCE = 0.05                # bytes/step, 100k vs 1M table (same ids), at most this apart


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ================================================================ clusters

def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _coordinator_args(args: argparse.Namespace, shards: int, phases: str, emb: str, out: str) -> list[str]:
    return ["--out", out, "--shards", str(shards), "--phases", phases, "--emb", emb,
            "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--noop-count", str(args.noop_count), "--sched-count", str(args.sched_count),
            "--emb-steps", str(args.emb_steps), "--max-other-load", str(args.max_other_load),
            "--extra-rounds", str(args.extra_rounds)]


def _stop(proc: subprocess.Popen, graceful: bool) -> None:
    """Ends a process we started (its own session): SIGTERM first when ``graceful``."""
    if proc.poll() is not None:
        return
    if graceful:   # the launcher stops its tasks on SIGTERM
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n    ".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _cluster_result(name: str, code: int, out: str, log: str, started: float) -> dict:
    """The JSON a finished cluster's coordinator wrote, with the cluster's wall time added."""
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"{name}: exit status {code}\n    {_tail(log)}")
    with open(out) as f:
        result = json.load(f)
    result["cluster_wall_s"] = time.time() - started
    _log(f"[{name}] done in {result['cluster_wall_s']:.0f} s")
    return result


def run_stratagem_cluster(args: argparse.Namespace, tmp: str, name: str, num_ps: int, shards: int,
                          phases: str, emb: str, extra: list[str] | None = None) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    log = os.path.join(tmp, f"{name}.log")
    cmd = [sys.executable, "-m", "stratagem", "launch", "--workers", str(WORKERS), "--ps", str(num_ps),
           COORDINATOR, "stratagem", *_coordinator_args(args, shards, phases, emb, out), *(extra or [])]
    _log(f"[{name}] {' '.join(cmd[1:6])} ... (timeout {args.timeout:.0f} s)")
    started = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_env(), cwd=REPO_ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(proc, graceful=True)
            raise RuntimeError(f"{name}: timed out after {args.timeout:.0f} s\n    {_tail(log)}") from None
    return _cluster_result(name, code, out, log, started)


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def tensorflow_available(python: str) -> tuple[bool, str]:
    if python == sys.executable:
        if importlib.util.find_spec("tensorflow") is None:
            return False, "tensorflow is not installed in this interpreter"
        return True, ""
    try:
        probe = subprocess.run([python, "-c", "import tensorflow"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{python}: {error}"
    return (probe.returncode == 0,
            "" if probe.returncode == 0 else f"import tensorflow failed in {python}")


def run_tf_cluster(args: argparse.Namespace, tmp: str, name: str, num_ps: int, shards: int,
                   phases: str, emb: str) -> dict:
    """TensorFlow's PS strategy: a chief (the coordinator) plus tf.distribute.Server tasks."""
    out, log = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.log")
    ports = _free_ports(1 + WORKERS + num_ps)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    cluster = {"chief": addresses[:1], "worker": addresses[1:1 + WORKERS], "ps": addresses[1 + WORKERS:]}
    env = _env()
    env.update({"GRPC_FAIL_FAST": "use_caller", "TF_CPP_MIN_LOG_LEVEL": "2"})
    servers: list[subprocess.Popen] = []
    _log(f"[{name}] TensorFlow cluster: {WORKERS} workers, {num_ps} ps (timeout {args.timeout:.0f} s)")
    started = time.time()
    with open(log, "w") as f:
        try:
            for job in ("ps", "worker"):
                for index in range(len(cluster[job])):
                    task_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                               "task": {"type": job, "index": index}}))
                    servers.append(subprocess.Popen([args.tf_python, COORDINATOR, "tf-server"], env=task_env,
                                                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    cwd=REPO_ROOT, start_new_session=True))
            chief_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
            chief = subprocess.Popen([args.tf_python, COORDINATOR, "tf-chief",
                                      *_coordinator_args(args, shards, phases, emb, out)],
                                     env=chief_env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=REPO_ROOT, start_new_session=True)
            servers.append(chief)
            try:
                code = chief.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name}: timed out after {args.timeout:.0f} s\n    {_tail(log)}") from None
        finally:
            for proc in servers:   # tf servers never exit by themselves
                _stop(proc, graceful=False)
    return _cluster_result(name, code, out, log, started)


class _Quiet:
    """Before each cluster, waits (``max_wait`` seconds in all) for other processes to leave the
    cores alone: this machine is shared, and a busy neighbour halves a 2-core cluster's rate."""

    def __init__(self, max_wait: float, limit: float):
        self.left, self.limit, self.waited = max_wait, limit, 0.0

    @staticmethod
    def busy_cores(seconds: float = 0.5) -> float | None:
        def sample():
            try:
                with open("/proc/stat") as f:
                    fields = [int(v) for v in f.readline().split()[1:]]
            except (OSError, ValueError):
                return None
            return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK"), time.monotonic()
        a = sample()
        time.sleep(seconds)
        b = sample()
        return None if a is None or b is None else (b[0] - a[0]) / (b[1] - a[1])

    def wait(self) -> None:
        while self.left > 0:
            busy = self.busy_cores()   # nothing of ours runs now: all of it is someone else's
            if busy is None or busy <= self.limit:
                return
            _log(f"  machine busy ({busy:.2f} cores used by other processes): waiting ({self.left:.0f} s left)")
            pause = min(5.0, self.left)
            time.sleep(pause)
            self.left -= pause + 0.5
            self.waited += pause + 0.5


# ================================================================ the run

def plan(args: argparse.Namespace) -> list[tuple[str, str, int, int, str, str]]:
    """(name, framework, num_ps, shards, phases, embedding configs) per cluster."""
    if args.quick:
        one = ("ours_1ps", "stratagem", 1, 1, "noop,sched,mlp", "")
        two = ("ours_2ps", "stratagem", 2, 2, "emb,mlp", "1000000:8,1000000:32,100000:8")
    else:
        one = ("ours_1ps", "stratagem", 1, 1, "noop,sched,emb,mlp,noop_loaded", "1000000:8")
        two = ("ours_2ps", "stratagem", 2, 2, "noop,emb,mlp", "1000000:8,1000000:32,100000:8")
    clusters = [one, two]
    if not args.skip_tf:
        clusters += [("tf_1ps", "tensorflow", 1, 1, one[4], one[5]),
                     ("tf_2ps", "tensorflow", 2, 2, two[4], two[5])]
    if args.clusters:
        wanted = set(args.clusters.split(","))
        clusters = [c for c in clusters if c[0] in wanted]
    return clusters


def run_benchmark(args: argparse.Namespace) -> dict:
    raw: dict = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "clusters": {},
                 "errors": {}, "environment": {"cores": usable_cores(), "loadavg_before": loadavg(),
                                               "python": sys.version.split()[0], **git_state()}}
    tf_ok, tf_why = (False, "--skip-tf") if args.skip_tf else tensorflow_available(args.tf_python)
    raw["tensorflow"] = {"available": tf_ok, "why_not": tf_why, "python": args.tf_python}
    tmp = tempfile.mkdtemp(prefix="sg_ps_bench_")
    quiet = _Quiet(args.max_wait, args.max_other_load)
    try:
        for name, framework, num_ps, shards, phases, emb in plan(args):
            if framework == "tensorflow" and not tf_ok:
                continue
            quiet.wait()
            try:
                if framework == "stratagem":
                    raw["clusters"][name] = run_stratagem_cluster(args, tmp, name, num_ps, shards, phases, emb)
                else:
                    raw["clusters"][name] = run_tf_cluster(args, tmp, name, num_ps, shards, phases, emb)
            except RuntimeError as error:
                _log(f"[{name}] FAILED: {error}")
                raw["errors"][name] = str(error)
        if args.profile:
            try:
                raw["profile"] = run_stratagem_cluster(
                    args, tmp, "profile_1ps", 1, 1, "mlp", "",
                    extra=["--profile", "--steps", str(max(args.steps, 200)), "--rounds", "1"]).get("profile")
            except RuntimeError as error:
                _log(f"[profile] FAILED: {error}")
                raw["errors"]["profile"] = str(error)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw["environment"]["loadavg_after"] = loadavg()
    raw["environment"]["waited_for_quiet_s"] = quiet.waited
    return raw


# ================================================================ report

def _kept_rates(entry: dict) -> tuple[list[float], bool]:
    """The rates of undisturbed rounds, or all of them (disturbed=True) when none was quiet."""
    kept = [r for r, ok in zip(entry["rates"], entry.get("kept", [True] * len(entry["rates"]))) if ok]
    return (kept, False) if kept else (list(entry["rates"]), True)


def _rate(cluster: dict | None, key: str) -> float | None:
    if not cluster or key not in cluster:
        return None
    return median(_kept_rates(cluster[key])[0])


def _disturbed(entry: dict | None) -> bool:
    return bool(entry) and "windows" in entry and _kept_rates(entry)[1]


def _emb(cluster: dict | None, rows: int, ids: int) -> dict | None:
    for entry in (cluster or {}).get("emb", []):
        if entry["rows"] == rows and entry["ids_per_example"] == ids:
            return entry
    return None


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def summarize(raw: dict) -> dict:
    c = raw["clusters"]
    tf_measured = raw["tensorflow"]["available"]
    summary: dict = {"tf_measured": tf_measured, "checks": {}}
    for topo in ("1ps", "2ps"):
        ours, tf = c.get(f"ours_{topo}"), c.get(f"tf_{topo}")
        mlp = _rate(ours, "mlp")
        ref = _rate(tf, "mlp") if tf_measured else None
        lo, hi = (ref, ref) if ref is not None else TF_NOTES_STEPS
        if mlp is not None:
            verdict = "ok" if mlp >= hi else ("within TF's range" if mlp >= lo else "MISSED")
            summary["checks"][f"mlp_{topo}"] = {"steps_per_s": mlp, "reference": [lo, hi],
                                                "ratio": [mlp / lo, mlp / hi], "verdict": verdict}
    noop = _rate(c.get("ours_1ps"), "noop")   # the topology: 2 workers (1 ps)
    if noop is None:
        noop = _rate(c.get("ours_2ps"), "noop")
    if noop is not None:
        summary["checks"]["noop"] = {"closures_per_s": noop, "ratio": noop / NOOP_TARGET,
                                     "verdict": "ok" if noop >= NOOP_TARGET else "MISSED"}
    two = c.get("ours_2ps")
    a, b, small = _emb(two, 1000000, 8), _emb(two, 1000000, 32), _emb(two, 100000, 8)
    if a and b and small:
        per_row = [e["sparse_bytes_per_step"] / e["rows_per_step"] for e in (a, b, small)]
        spread = max(per_row) / min(per_row) - 1
        table_ratio = small["sparse_bytes_per_step"] / a["sparse_bytes_per_step"]
        ids_ratio = b["sparse_bytes_per_step"] / a["sparse_bytes_per_step"]
        rows_ratio = b["rows_per_step"] / a["rows_per_step"]
        ok = spread <= PROPORTIONAL_TOLERANCE and abs(table_ratio - 1) <= TABLE_TOLERANCE
        summary["checks"]["embedding"] = {
            "bytes_per_row": per_row, "bytes_per_row_spread": spread,
            "bytes_ratio_32_vs_8_ids": ids_ratio, "rows_ratio_32_vs_8_ids": rows_ratio,
            "bytes_ratio_100k_vs_1M_table": table_ratio, "verdict": "ok" if ok else "MISSED"}
    return summary


def render(raw: dict, summary: dict) -> str:
    c = raw["clusters"]
    tf_ok = raw["tensorflow"]["available"]
    tf_note = "" if tf_ok else f"skipped ({raw['tensorflow']['why_not']})"
    env = raw["environment"]
    lines = [f"ParameterServerStrategy benchmark: {WORKERS} workers, local cluster over loopback gRPC, "
             f"{env['cores']} cores, loadavg {env['loadavg_before']} -> {env['loadavg_after']}, "
             f"commit {env.get('commit')}"
             + (f" (+{env['stratagem_modified_files']} modified stratagem files)"
                if env.get("stratagem_modified_files") else ""), ""]

    def cell(name: str, key: str) -> str:
        if name.startswith("tf_") and not tf_ok:
            return "skipped"
        if name in raw["errors"]:
            return "FAILED"
        entry = (c.get(name) or {}).get(key)
        return _fmt(_rate(c.get(name), key)) + ("!" if _disturbed(entry) else "")

    def emb_cell(name: str) -> str:
        if name.startswith("tf_") and not tf_ok:
            return "skipped"
        entry = _emb(c.get(name), 1000000, 8)
        if name in raw["errors"]:
            return "FAILED"
        return (_fmt(median(_kept_rates(entry)[0])) + ("!" if _disturbed(entry) else "")) if entry else "-"

    checks = summary["checks"]

    def mlp_target(topo: str) -> tuple[str, str, str]:
        check = checks.get(f"mlp_{topo}")
        if check is None:
            return "", "", ""
        lo, hi = check["reference"]
        if summary["tf_measured"]:
            return f">= TF {_fmt(hi)}", f"{check['ratio'][0]:.2f}x", check["verdict"]
        return (f">= TF {lo:.0f}-{hi:.0f} (NOTES)", f"{check['ratio'][1]:.2f}-{check['ratio'][0]:.2f}x",
                check["verdict"])

    noop = checks.get("noop", {})
    rows = [
        ["MLP 784-1024-1024-10 steps/s, 1 ps", cell("ours_1ps", "mlp"), cell("tf_1ps", "mlp"), *mlp_target("1ps")],
        ["MLP steps/s, 2 ps (FixedShards(2))", cell("ours_2ps", "mlp"), cell("tf_2ps", "mlp"), *mlp_target("2ps")],
        ["embedding 1Mx64, 8 ids: steps/s, 1 ps", emb_cell("ours_1ps"), emb_cell("tf_1ps"), "", "", ""],
        ["embedding 1Mx64, 8 ids: steps/s, 2 ps", emb_cell("ours_2ps"), emb_cell("tf_2ps"), "", "", ""],
        ["no-op closures/s, 1 ps", cell("ours_1ps", "noop"), cell("tf_1ps", "noop"),
         ">= 1,000", f"{noop['ratio']:.2f}x" if noop else "", noop.get("verdict", "")],
        ["no-op closures/s, 2 ps", cell("ours_2ps", "noop"), cell("tf_2ps", "noop"), "", "", ""],
        ["no-op closures/s, MLP known to workers", cell("ours_1ps", "noop_loaded"),
         cell("tf_1ps", "noop_loaded"), "", "", ""],
        ["schedule() calls/s (not waiting)", cell("ours_1ps", "sched"), cell("tf_1ps", "sched"), "", "", ""],
    ]
    lines.append(format_table(["measurement", "stratagem", "TensorFlow", "target", "ratio", "verdict"], rows,
                              align="lrrrrl"))
    lines.append(f"(rates: median over rounds in which other processes kept <= {raw['config']['max_other_load']} "
                 f"cores busy; '!' = no such round, median of all)")
    if not tf_ok:
        lines.append(f"TensorFlow: {tf_note}; the MLP reference is NOTES' measurement of TensorFlow's "
                     f"ParameterServerStrategy here ({TF_NOTES_STEPS[0]:.0f}-{TF_NOTES_STEPS[1]:.0f} steps/s, "
                     f"~{TF_NOTES_NOOP:.0f} no-op closures/s); ratio = ours / {TF_NOTES_STEPS[1]:.0f} - "
                     f"ours / {TF_NOTES_STEPS[0]:.0f}.")

    two = c.get("ours_2ps")
    if two and two.get("emb"):
        lines += ["", "Embedding traffic, 2 ps (table sharded in 2), batch 64, SGD: ps bytes for the table "
                      "(pull_rows + push_rows, in + out) per step"]
        emb_rows = []
        for e in two["emb"]:
            table_mib = e["rows"] * 64 * 4 / 2**20
            emb_rows.append([f"{e['rows']:,}", e["ids_per_example"],
                             _fmt(median(_kept_rates(e)[0])) + ("!" if _disturbed(e) else ""),
                             _fmt(e["rows_per_step"]), _fmt(e["sparse_bytes_per_step"] / 1024),
                             _fmt(e["sparse_bytes_per_step"] / e["rows_per_step"]),
                             f"{e['sparse_bytes_per_step'] / (table_mib * 2**20) * 100:.3f}%",
                             _fmt(e["setup_s"])])
        lines.append(format_table(["table rows", "ids/example", "steps/s", "rows used/step", "KiB/step",
                                   "bytes/row used", "of table", "setup s"], emb_rows))
        emb = checks.get("embedding")
        if emb:
            lines.append(
                f"proportional to rows used: bytes per row used {min(emb['bytes_per_row']):.1f}-"
                f"{max(emb['bytes_per_row']):.1f} (spread {emb['bytes_per_row_spread'] * 100:.2f}%, "
                f"<= {PROPORTIONAL_TOLERANCE * 100:.0f}%); 32 vs 8 ids: bytes x{emb['bytes_ratio_32_vs_8_ids']:.3f} "
                f"for rows x{emb['rows_ratio_32_vs_8_ids']:.3f}; 100k vs 1M table: bytes "
                f"x{emb['bytes_ratio_100k_vs_1M_table']:.3f} (<= {TABLE_TOLERANCE * 100:.0f}% apart) -> "
                f"{emb['verdict']}")
        lines.append("(rows used/step = distinct rows a step looked up = pull_rows' int64 row ids / 8; "
                     "bytes per row = 2 x (8-byte id + 64 x 4-byte floats))")

    notes = []
    for name in ("ours_1ps", "ours_2ps", "tf_1ps", "tf_2ps"):
        cluster = c.get(name)
        if cluster and cluster.get("mlp"):
            busy = [w["cluster_cores"] for w in cluster["mlp"]["windows"] if w.get("cluster_cores") is not None]
            other = [w["foreign_cores"] for w in cluster["mlp"]["windows"] if w.get("foreign_cores") is not None]
            extra = ""
            if "dense_bytes_per_step" in cluster["mlp"]:
                extra = f", ps dense traffic {cluster['mlp']['dense_bytes_per_step'] / 2**20:.1f} MiB/step"
            notes.append(f"{name}: MLP rounds {', '.join(_fmt(r) for r in cluster['mlp']['rates'])} steps/s; "
                         f"cluster busy {_fmt(median(busy), 2) if busy else '-'} cores, other processes "
                         f"{_fmt(max(other), 2) if other else '-'} at most{extra}; loss "
                         f"{cluster['mlp']['first_loss']:.3f} -> {cluster['mlp']['last_loss']:.3f}; "
                         f"cluster wall {cluster['cluster_wall_s']:.0f} s")
    if notes:
        lines += [""] + notes
    for name, error in raw["errors"].items():
        lines.append(f"FAILED {name}: {error.splitlines()[0]}")
    if raw.get("profile"):
        lines += ["", render_profile(raw["profile"])]
    return "\n".join(lines)


def render_profile(profile: dict) -> str:
    steps, wall = profile["steps"], profile["wall_s"]
    rows = [["wall time of the timed steps", _fmt(wall * 1e3 / steps, 2), "", ""],
            ["coordinator CPU", _fmt(profile["coordinator_cpu_s"] * 1e3 / steps, 2), "", ""]]
    for name, t in sorted(profile["coordinator"].items(), key=lambda kv: -kv[1]["total_s"]):
        rows.append([name, _fmt(t["total_s"] * 1e3 / steps, 2), _fmt(t["calls"] / steps, 2),
                     _fmt(t["total_s"] * 1e3 / max(t["calls"], 1), 2)])
    for i, (_, worker) in enumerate(sorted(profile["workers"].items())):
        rows.append([f"worker {i}: process CPU", _fmt(worker["cpu_s"] * 1e3 / steps, 2), "", ""])
        for name, t in sorted(worker["timers"].items(), key=lambda kv: -kv[1]["total_s"]):
            rows.append([f"worker {i}: {name}", _fmt(t["total_s"] * 1e3 / steps, 2), _fmt(t["calls"] / steps, 2),
                         _fmt(t["total_s"] * 1e3 / max(t["calls"], 1), 2)])
    text = ("Profile: MLP, 1 ps; ms/step = wall (or CPU) time summed over calls / cluster steps (each worker "
            "runs about half of the steps; timers on gRPC threads overlap others)\n"
            + format_table(["timer", "ms/step", "calls/step", "ms/call"], rows))
    spy = profile.get("ps_py_spy") or {}
    if "note" in spy:
        return text + "\n" + spy["note"]
    for name, entry in spy.items():
        if "error" in entry:
            text += f"\n{name}: py-spy failed: {entry['error']}"
            continue
        cores = entry["samples"] / 200 / entry["seconds"]
        text += (f"\n\n{name} (py-spy, {entry['seconds']:.0f} s at 200 Hz, {cores:.2f} cores sampled): share of its "
                 "CPU samples\n" + format_table(
                     ["where", "share"], [[k, f"{v * 100:.1f}%"] for k, v in entry["categories"].items()])
                 + "\ntop leaves: " + "; ".join(f"{k} {v * 100:.0f}%" for k, v in entry["top_leaves"].items()))
    return text


# ================================================================ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="timed MLP steps per round (default 100; quick 60)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per measurement (default 3; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps/closures first (default 20)")
    parser.add_argument("--emb-steps", type=int, default=None, help="timed embedding steps per round (default 100)")
    parser.add_argument("--noop-count", type=int, default=None, help="no-op closures per round (default 1000)")
    parser.add_argument("--sched-count", type=int, default=None, help="schedule() calls per round (default 2000)")
    parser.add_argument("--quick", action="store_true", help="smoke test, < 90 s")
    parser.add_argument("--json", metavar="PATH", help="also write every raw measurement and the summary")
    parser.add_argument("--profile", action="store_true",
                        help="also run a 1-ps MLP cluster with timers on the coordinator and the workers")
    parser.add_argument("--skip-tf", action="store_true", help="do not try TensorFlow")
    parser.add_argument("--clusters", metavar="NAMES",
                        help="only these clusters, comma-separated: ours_1ps,ours_2ps,tf_1ps,tf_2ps")
    parser.add_argument("--tf-python", default=sys.executable,
                        help="interpreter for the TensorFlow clusters (default: this one)")
    parser.add_argument("--max-other-load", type=float, default=0.3,
                        help="a round during which other processes kept more cores than this busy is "
                             "disturbed and re-run (default 0.3)")
    parser.add_argument("--extra-rounds", type=int, default=None,
                        help="at most this many re-runs of disturbed rounds per measurement (default 2; quick 1)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds in all to wait for a quiet machine before clusters (default 30; quick 10)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per cluster before it is killed (default 240; quick 80)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"steps": 60 if quick else 100, "rounds": 1 if quick else 3, "warmup": 10 if quick else 20,
                "emb_steps": 40 if quick else 100, "noop_count": 500 if quick else 1000,
                "sched_count": 2000, "timeout": 80.0 if quick else 240.0,
                "extra_rounds": 1 if quick else 2, "max_wait": 10.0 if quick else 30.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    raw = run_benchmark(args)
    summary = summarize(raw)
    raw["wall_s"] = time.time() - started
    print(render(raw, summary))
    print(f"\n(total {raw['wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": raw, "summary": summary}, f, indent=1)
    return 1 if raw["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
