"""What every benchmark shares: the workload, one contention-aware timed loop, interleaved
rounds, processes with deadlines, the profiler table, and plain-text tables.

The machines here have 2 shared cores: another engineer's test run makes a 2-thread step
5-20x slower. So a number is only worth printing with the conditions it was taken in:

- :func:`timed_loop` times steps in chunks of >= ``min_chunk_s`` and, per chunk, measures
  how many cores processes *outside* the benchmark kept busy (:class:`CpuWindow`: the
  machine's busy time from ``/proc/stat`` minus our own processes'); steps of a disturbed
  chunk are set aside, and more steps are timed while the patience lasts.
- :class:`Rounds` runs every configuration once per round, in an order rotated from round to
  round, so that slow drifts hit all alike; a ratio to the baseline is taken per round
  (paired) and reported as the median over rounds with its spread (min-max).
- :func:`load_warning` reads the load average and says so when the machine is not quiet.

Nothing here imports torch at import time: parents stay light, and the TensorFlow baselines
(``_tf.py``) use this module in an interpreter that has no torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP_LAYERS = (784, 1024, 1024, 10)   # 1.86 M parameters: docs/benchmarks.md's tables use this MLP
LR, MOMENTUM = 0.01, 0.9
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ workload

def param_count(layers: Sequence[int] = MLP_LAYERS) -> int:
    return sum(i * o + o for i, o in zip(layers[:-1], layers[1:]))


def mlp(layers: Sequence[int] = MLP_LAYERS):
    """``Linear-ReLU-...-Linear`` with the given widths (torch's default initialisation)."""
    import torch

    mods: list = []
    for i, (n_in, n_out) in enumerate(zip(layers[:-1], layers[1:])):
        mods += [torch.nn.Linear(n_in, n_out)] + ([torch.nn.ReLU()] if i < len(layers) - 2 else [])
    return torch.nn.Sequential(*mods)


def gpt(dim: int, layers: int, vocab: int, heads: int, *, tied: bool = False, seed: int = 0):
    """A GPT as ``nn.Sequential(Embedding(vocab, dim), layers x Block, Head)``: each block a
    LayerNorm, causal self-attention (``q``, ``k``, ``v`` and ``out`` projections: the names a
    tensor-parallel plan addresses) and an MLP (dim -> 4 dim -> dim); the head a LayerNorm and
    ``Linear(dim, vocab)``. ``tied``: the embedding's weight is the head's (GPT-2's tying, which
    gives one parameter two gradient contributions); leave it off where stages split the model."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
            self.head = dim // heads

        def forward(self, h):
            q, k, v = (f(h).unflatten(-1, (-1, self.head)).transpose(1, 2) for f in (self.q, self.k, self.v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(out.transpose(1, 2).flatten(2))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, h):
            h = h + self.attn(self.norm1(h))
            return h + self.mlp(self.norm2(h))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, h):
            return self.proj(self.norm(h))

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, dim), *(Block() for _ in range(layers)), Head())
    if tied:
        model[0].weight = model[-1].proj.weight   # (nanoGPT: wte.weight = lm_head.weight)
    return model


def synthetic_batches(batch_size: int, distinct: int, features: int = 784, classes: int = 10, seed: int = 0):
    """``distinct`` batches (float32 ``(distinct, batch, features)``, int64 labels), made with numpy
    so that PyTorch and TensorFlow train on bit-identical data."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.standard_normal((distinct, batch_size, features), dtype=np.float32),
            rng.integers(0, classes, size=(distinct, batch_size), dtype=np.int64))


# ---------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``lo-hi`` of per-round values: how far one round is from deciding anything."""
    return "" if len(values) < 2 else f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def quartiles(values: Sequence[float], digits: int = 3) -> str:
    """``q1-q3`` of per-round values: the middle half, which one run's verdict has to clear."""
    return "" if len(values) < 2 else f"{percentile(values, 25):.{digits}f}-{percentile(values, 75):.{digits}f}"


def loss_check(label: str, losses: Sequence[float], tolerance: float = 1e-3) -> str | None:
    """``label``'s check line: whether ``losses``, which the same training gives, agree (None for
    fewer than two)."""
    if len(losses) < 2:
        return None
    diff = (max(losses) - min(losses)) / abs(losses[0])
    return f"{label}, max relative difference {diff:.1e}: " + (
        "same training" if diff < tolerance else "DIFFERENT TRAINING")


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval for the median of what ``values`` sample: the
    order statistics ``x(k)`` and ``x(n-k+1)`` with ``k`` the largest rank that a Binomial(n, 1/2)
    count stays below with probability at most ``(1 - confidence) / 2``. It narrows as rounds are
    added (with 20 rounds it is about the interquartile range; with 40, 70 % of it); None while
    ``values`` are too few for any interval at that confidence (fewer than 6 at 95 %)."""
    n = len(values)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n   # P(count <= k)
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def decision(ratios: Sequence[float], target: float) -> str:
    """Whether per-round ``ratios`` decide that their median is ``<= target``: ``ok`` or
    ``MISSED`` when the 95 % interval of the median (:func:`median_interval`) lies on one side of
    the target, else ``undecided`` (the interval is wider than the margin to the target: more
    rounds, or a quieter machine). Fewer than 6 rounds decide nothing."""
    interval = median_interval(ratios)
    if interval is None:
        return "undecided"
    lo, hi = interval
    return "ok" if hi <= target else "MISSED" if lo > target else "undecided"


def interval_text(ratios: Sequence[float], digits: int = 3) -> str:
    """``lo-hi`` of :func:`median_interval`, or ``-`` while the rounds are too few."""
    interval = median_interval(ratios)
    return "-" if interval is None else f"{interval[0]:.{digits}f}-{interval[1]:.{digits}f}"


def verdict(ratios: Sequence[float], target: float) -> str:
    """:func:`decision` with the target, the margin of the median and its 95 % interval, for a table."""
    if not ratios:
        return f"<={target:.2f} n/a"
    return (f"<={target:.2f} {decision(ratios, target)} (margin {target - median(ratios):+.3f}, median's 95 % "
            f"interval {interval_text(ratios)}, {len(ratios)} round{'s' if len(ratios) > 1 else ''})")


# ---------------------------------------------------------------- contention

def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def loadavg() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError):
        return None


def load_warning(limit: float = 0.5) -> str | None:
    """A warning when the 1-minute load average says that the machine is not quiet."""
    load = loadavg()
    if load is None or load <= limit:
        return None
    return (f"WARNING: load average {load:.2f} on {usable_cores()} cores: other processes ran during this "
            "benchmark; single rounds are inflated, read the medians and their spread.")


def sibling_pids() -> list[int]:
    """Processes with the same parent as this one (the other ranks or tasks of one measurement)."""
    parent, pids = os.getppid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == parent:
                        pids.append(int(entry))
    return pids


def cluster_cpu_s() -> float:
    """CPU seconds used so far by every process of this process's cluster: those whose
    environment holds the same TF_CONFIG cluster (chief, workers, parameter servers, whatever
    the framework). A load-independent cost: CPU per step, where rates depend on the machine."""
    marker = json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"], sort_keys=True)
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                if json.dumps(json.loads(env[b"TF_CONFIG"])["cluster"], sort_keys=True) == marker:
                    total += _cpu_s_of(int(entry))
    return total


def _cpu_s_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK    # utime + stime
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuWindow:
    """Cores kept busy during a block: by this process (``own_cores``), and by processes that
    are not ours (``foreign_cores``: machine busy time, steal included, minus this process's and,
    with ``siblings=True``, its siblings' CPU time). ``foreign_cores`` is None without /proc."""

    def __init__(self, siblings: bool = False):
        self._pids = sibling_pids() if siblings else []

    def _sample(self) -> tuple[float | None, float, float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime
        family = own + sum(_cpu_s_of(pid) for pid in self._pids)
        try:
            with open("/proc/stat") as f:
                user, nice, system, _idle, _iowait, irq, softirq, steal = \
                    (int(v) for v in f.readline().split()[1:9])
            busy: float | None = (user + nice + system + irq + softirq + steal) / _CLK_TCK
        except (OSError, ValueError):
            busy = None
        return busy, own, family, time.monotonic()

    def __enter__(self) -> "CpuWindow":
        self._start = self._sample()
        self.foreign_cores: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._sample()
        self.seconds = max(end[3] - self._start[3], 1e-9)
        self.own_cores = (end[1] - self._start[1]) / self.seconds
        if end[0] is not None and self._start[0] is not None:
            self.foreign_cores = max(0.0, (end[0] - self._start[0] - (end[2] - self._start[2])) / self.seconds)


class Quiet:
    """Waits, before a measurement, until other processes keep at most ``limit`` cores busy;
    ``budget_s`` bounds the waiting of a whole run (at most 15 s at a time)."""

    def __init__(self, budget_s: float, limit: float):
        self.budget_s, self.limit, self.waited_s = budget_s, limit, 0.0

    def wait(self) -> None:
        start = time.monotonic()
        allowed = min(15.0, self.budget_s - self.waited_s)
        try:
            while allowed > 0 and time.monotonic() - start < allowed:
                with CpuWindow() as window:
                    time.sleep(0.3)
                if window.foreign_cores is None or window.foreign_cores <= self.limit:
                    return
                time.sleep(0.7)
        finally:
            self.waited_s += time.monotonic() - start


# ---------------------------------------------------------------- the timed loop

def timed_loop(step: Callable[[int], Any], *, warmup: int, steps: int, max_other_load: float = 0.3,
               patience_s: float = 0.0, max_steps: int | None = None, min_chunk_s: float = 0.25,
               siblings: bool = False, probe: Callable[[], float] | None = None) -> dict:
    """Warm up, then time ``step(i)`` in chunks and keep the steps of undisturbed chunks.

    A chunk is disturbed when processes other than ours kept more than ``max_other_load`` cores
    busy during it (``siblings``: this process's siblings count as ours). Timing ends once
    ``steps`` undisturbed steps are kept, or, after ``steps`` steps, when ``patience_s`` has
    passed or ``max_steps`` steps were timed; with no undisturbed chunk at all the disturbed
    steps are returned (``contended``). ``probe()`` runs untimed after exactly ``warmup + steps``
    steps, so that configurations can be compared however many steps each timed.
    Returns ``step_ms`` and ``cpu_ms`` (this process, all threads) per kept step.
    """
    for i in range(warmup):
        step(i)
    import gc
    gc.collect()
    kept: dict[bool, list] = {True: [[], [], []], False: [[], [], []]}   # ms, cpu ms, foreign
    probed, i, started = None, warmup, time.monotonic()
    while True:
        ms, cpu = [], []
        with CpuWindow(siblings) as window:
            chunk_start = time.perf_counter()
            while True:
                c0, t0 = time.process_time(), time.perf_counter()
                step(i)
                t1 = time.perf_counter()
                ms.append(1e3 * (t1 - t0))
                cpu.append(1e3 * (time.process_time() - c0))
                i += 1
                if probe is not None and i == warmup + steps:
                    probed = probe()
                if t1 - chunk_start >= min_chunk_s or (max_steps is not None and i - warmup >= max_steps):
                    break   # with max_steps every rank of a collective times the same number of steps
        quiet = window.foreign_cores is None or window.foreign_cores <= max_other_load
        kept[quiet][0] += ms
        kept[quiet][1] += cpu
        kept[quiet][2] += [window.foreign_cores or 0.0] * len(ms)
        timed = i - warmup
        if len(kept[True][0]) >= steps or (max_steps is not None and timed >= max_steps):
            break
        if timed >= steps and time.monotonic() - started >= patience_s:
            break
    use = kept[True] if kept[True][0] else kept[False]
    return {"step_ms": use[0], "cpu_ms": use[1], "contended": not kept[True][0],
            "clean_steps": len(kept[True][0]), "disturbed_steps": len(kept[False][0]),
            "foreign_cores": median(use[2]), "final_loss": probed}


def rate_rounds(run_round: Callable[[int], Any], count: int, *, rounds: int, extra_rounds: int,
                max_other_load: float) -> dict:
    """``count / seconds`` of ``run_round(count)`` over ``rounds`` undisturbed rounds (at most
    ``extra_rounds`` more are run to replace disturbed ones). For a cluster's coordinator:
    the tasks that ``stratagem launch`` started beside it count as ours."""
    timing = timed_loop(lambda i: run_round(count), warmup=0, steps=rounds, max_steps=rounds + extra_rounds,
                        min_chunk_s=0.0, siblings=True, max_other_load=max_other_load)
    return {"rates": [count / (ms / 1e3) for ms in timing["step_ms"]], "contended": timing["contended"],
            "disturbed_rounds": timing["disturbed_steps"], "foreign_cores": timing["foreign_cores"],
            "cpu_ms_per_round": median(timing["cpu_ms"])}


def log(message: str) -> None:
    """Progress goes to stderr; stdout keeps the tables."""
    print(message, file=sys.stderr, flush=True)


class Rounds:
    """Interleaved rounds: each round measures every configuration once, in an order rotated
    from round to round. ``measure(config, round)`` returns a dict (or raises to mark a failure)."""

    def __init__(self, configs: Sequence[str], rounds: int, quiet: Quiet | None = None):
        self.configs, self.rounds, self.quiet = list(configs), rounds, quiet
        self.results: dict[str, list[dict]] = {c: [] for c in self.configs}
        self.errors: list[str] = []

    def run(self, measure: Callable[[str, int], dict], *, max_rounds: int = 0,
            decided: Callable[[], bool] = lambda: True) -> "Rounds":
        """``self.rounds`` rounds, then more, up to ``max_rounds`` in all, until ``decided()``."""
        started, rnd = time.monotonic(), 0
        while rnd < self.rounds or (rnd < max_rounds and not decided()):
            if rnd >= self.rounds:
                log(f"  round {rnd + 1}: not decided yet")
            k = rnd % len(self.configs)
            for config in self.configs[k:] + self.configs[:k]:
                if self.quiet is not None:
                    self.quiet.wait()
                try:
                    result = measure(config, rnd)
                except (RuntimeError, TimeoutError) as error:
                    self.errors.append(f"{config}, round {rnd + 1}: {error}")
                    log(f"  FAILED {config} (round {rnd + 1}): {error}")
                    continue
                result["round"] = rnd
                self.results[config].append(result)
                log(f"[round {rnd + 1}/{self.rounds}, {time.monotonic() - started:4.0f} s] {config}: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if k.endswith("_ms")
                                     and isinstance(v, float)))
            rnd += 1
        self.rounds = rnd
        return self

    def finish(self) -> int:
        """Prints each failed measurement and the load warning; the exit status (1 if any failed)."""
        for error in self.errors:
            print(f"FAILED: {error}")
        warning = load_warning()
        if warning:
            print(warning)
        return 1 if self.errors else 0

    def per_round(self, config: str, key: str, *, clean: bool = False) -> dict[int, float]:
        return {r["round"]: r[key] for r in self.results.get(config, [])
                if r.get(key) is not None and not (clean and r.get("contended"))}

    def ratio(self, config: str, baseline: str, key: str, *, clean: bool = False) -> list[float]:
        """Per round in which both ran: ``config``'s value over ``baseline``'s (paired);
        ``clean``: only the rounds in which neither kept disturbed steps alone (``contended``)."""
        a, b = self.per_round(config, key, clean=clean), self.per_round(baseline, key, clean=clean)
        return [a[r] / b[r] for r in a if r in b and b[r]]


# ---------------------------------------------------------------- processes

def child_env(**extra: str) -> dict[str, str]:
    """This checkout first on PYTHONPATH; no cluster variables leaking in from our caller."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


class Processes:
    """Processes started for one measurement, each in its own session (process group).

    Leaving the ``with`` block -- normally, on an exception, on Ctrl-C -- ends every group
    still running: SIGTERM first for ``graceful`` ones (``stratagem launch`` stops its tasks on
    it), SIGKILL otherwise or 10 s later. Output goes to files, never to pipes that could fill.
    """

    def __init__(self) -> None:
        self.procs: dict[str, tuple[subprocess.Popen, Any, bool]] = {}

    def __enter__(self) -> "Processes":
        return self

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None,
              graceful: bool = False) -> subprocess.Popen:
        log = tempfile.TemporaryFile(mode="w+", errors="replace")
        proc = subprocess.Popen(list(cmd), env=env or child_env(), cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = (proc, log, graceful)
        return proc

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Wait for ``names`` to exit 0; raise RuntimeError (with their output) on a failure or
        when ``timeout`` passes. The ``with`` block's end then kills what is left."""
        deadline = time.monotonic() + timeout
        while True:
            bad = [n for n in names if self.procs[n][0].poll() not in (None, 0)]
            if bad:
                raise RuntimeError(f"{bad[0]} exited with status {self.procs[bad[0]][0].returncode}\n"
                                   + self.tails(names))
            if all(self.procs[n][0].poll() == 0 for n in names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not finished after {timeout:.0f} s\n" + self.tails(names))
            time.sleep(0.02)

    def output(self, name: str) -> str:
        log = self.procs[name][1]
        log.flush()
        log.seek(0)
        return log.read()

    def tails(self, names: Sequence[str], lines: int = 15) -> str:
        return "\n".join(f"--- {n} ---\n    " + "\n    ".join(self.output(n).strip().splitlines()[-lines:])
                         for n in names)

    def __exit__(self, *exc: Any) -> None:
        # a launcher puts its tasks in sessions of their own: note them before it can go
        family = {proc.pid: _descendants(proc.pid) for proc, _, _ in self.procs.values() if proc.poll() is None}
        for proc, _, graceful in self.procs.values():
            if proc.pid in family:
                _signal_groups([proc.pid], signal.SIGTERM if graceful else signal.SIGKILL)
        for proc, log, graceful in self.procs.values():
            try:
                proc.wait(timeout=10 if graceful else 5)
            except subprocess.TimeoutExpired:
                _signal_groups([proc.pid], signal.SIGKILL)
                proc.wait()
            _signal_groups(family.get(proc.pid, []), signal.SIGKILL)   # whatever outlived its parent
            log.close()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _signal_groups(pids: Sequence[int], sig: int) -> None:
    """Signal the process group of each pid, and the pid itself (a group we did not start)."""
    for pid in pids:
        for kill in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill()


def run_workers(script: str, argv: Sequence[str], *, world: int, timeout: float) -> list[dict]:
    """The ``world`` worker processes of one measurement (``script`` with ``argv`` and ``--rank R
    --port P``), each in its own session, with a deadline; the last JSON line of each, by rank.
    Every worker gets the TF_CONFIG of a loopback cluster (for the strategies) and ``P``, one more
    free loopback port (for torch's own process group, ``tcp://127.0.0.1:P``)."""
    from stratagem.testing import free_ports, local_cluster

    cluster, port = local_cluster(world), free_ports(1)[0]
    names = [f"rank {rank}" for rank in range(world)]
    with Processes() as procs:
        for rank, name in enumerate(names):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
            procs.start(name, [sys.executable, script, *argv, "--rank", str(rank), "--port", str(port)],
                        child_env(TF_CONFIG=tf_config))
        procs.wait(names, timeout)
        return [json.loads([ln for ln in procs.output(n).splitlines() if ln.startswith("{")][-1]) for n in names]


def run_json(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run one child to completion (with a deadline); return the last JSON line it printed."""
    with Processes() as procs:
        procs.start("child", cmd, env)
        procs.wait(["child"], timeout)
        lines = [ln for ln in procs.output("child").splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(cmd[1:])}: printed no result")
    return json.loads(lines[-1])


def emit(result: dict) -> None:
    """A child's result: one JSON line, the last of its stdout."""
    print(json.dumps(result), flush=True)


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that ``with Processes()`` blocks kill their children."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def as_child(args: Any, child: Callable[[Any], dict]) -> bool:
    """A script's two roles: with ``--child`` (``args.child`` set) run ``child(args)``, emit its
    result and return True; else (the parent) make SIGTERM end cleanly and return False."""
    if args.child:
        emit(child(args))
        return True
    exit_cleanly_on_sigterm()
    return False


# ---------------------------------------------------------------- profiling

class Profile:
    """``torch.profiler.profile`` over every thread of this process (replica threads, gRPC
    handler threads), as a context manager; :meth:`rows` gives what to print."""

    def __enter__(self) -> "Profile":
        import torch

        kwargs: dict = {"activities": [torch.profiler.ProfilerActivity.CPU]}
        config = getattr(torch.profiler, "_ExperimentalConfig", None)
        with contextlib.suppress(TypeError):   # older torch: the calling thread only
            kwargs["experimental_config"] = config(profile_all_threads=True)
        self._prof = torch.profiler.profile(**kwargs)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        self.events = [(e.key, e.count, e.cpu_time_total / 1e3, e.self_cpu_time_total / 1e3)
                       for e in self._prof.key_averages()]


def profile_table(events: Sequence[Sequence], steps: int, top: int = 12) -> str:
    """The ``stratagem.*`` ranges that occurred (all of them), then the top torch ops by self CPU
    time; ms per step. ``events``: (name, calls, total CPU ms, self CPU ms) as :class:`Profile` keeps."""
    ranges = sorted((e for e in events if e[0].startswith("stratagem.")), key=lambda e: -e[2])
    ops = sorted((e for e in events if not e[0].startswith("stratagem.")), key=lambda e: -e[3])[:top]

    def rows(chosen: Sequence[Sequence]) -> list[list[str]]:
        return [[name, f"{calls / steps:.2f}", f"{total / steps:.3f}", f"{own / steps:.3f}"]
                for name, calls, total, own in chosen]

    head = ["range / op", "calls/step", "CPU ms/step", "self ms/step"]
    text = format_table(head, rows(ranges)) if ranges else "(no stratagem.* ranges were recorded)"
    return text + (f"\ntop {top} ops by self CPU time:\n" + format_table(head, rows(ops)) if ops else "\n(no ops)")


# ---------------------------------------------------------------- tables

def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` is one 'l'/'r' per column (default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "stratagem"], capture_output=True, text=True,
                           cwd=REPO_ROOT).stdout.strip()
    return out.stdout.strip() + (" (+ local edits in stratagem/)" if dirty else "")


# ------------------------------------------------------------------ options

def add_timing_options(parser: Any) -> None:
    """The options of a benchmark that times steps in fresh processes, in interleaved rounds."""
    parser.add_argument("--steps", type=int, help="timed steps per measurement (default 40; --quick 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 10; --quick 2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="global batch sizes (default 128 512)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds, each configuration in a fresh process (default 5)")
    parser.add_argument("--distinct", type=int, default=8, help="distinct synthetic batches, cycled")
    parser.add_argument("--max-other-load", type=float, default=0.3,
                        help="set aside steps during which other processes kept more cores busy")
    parser.add_argument("--patience", type=float, help="seconds to go on timing to collect undisturbed steps (6)")
    parser.add_argument("--max-wait", type=float, help="seconds in all to wait for a quiet machine (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: batch 128, 1 round, 4 steps")
    parser.add_argument("--json", metavar="PATH", help="also write every raw measurement here")


def apply_timing_defaults(args: Any, parser: Any) -> None:
    """Fill what :func:`add_timing_options` left unset (the quick smoke test's values or the full
    run's), then check the counts (``parser.error`` exits with the message)."""
    defaults = (dict(steps=4, warmup=2, rounds=1, patience=0.0, max_wait=0.0, batch_sizes=[128]) if args.quick
                else dict(steps=40, warmup=10, rounds=5, patience=6.0, max_wait=60.0, batch_sizes=[128, 512]))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds, args.distinct) < 1 or args.warmup < 0:
        parser.error("--steps, --rounds and --distinct must be >= 1, --warmup >= 0")
