"""Helpers shared by the benchmarks: statistics, CPU-contention and memory probes,
synthetic data, running one measurement in a fresh subprocess, and tables.

Nothing here imports torch: the parent process of a benchmark stays light and
every measurement runs in its own interpreter.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from typing import Any, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ------------------------------------------------------------------ statistics

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


# --------------------------------------------------------- contention, memory

class CpuWindow:
    """How much CPU *other* processes used while a block of this process ran.

    Reads the machine-wide busy time from ``/proc/stat`` (user, nice, system, irq,
    softirq and steal; steal counts because a hypervisor taking our core is
    contention too) and subtracts this process's own user+system time
    (``getrusage``). The result, ``foreign_cores``, is the average number of cores
    that something else kept busy: 0 on a quiet machine, ~2 when another
    benchmark with two threads runs beside us on two cores. Resolution is one
    clock tick (10 ms), so use it on windows of a second or more. ``None`` where
    ``/proc/stat`` is missing.
    """

    def __enter__(self) -> "CpuWindow":
        self._start = _cpu_sample()
        self.foreign_cores: float | None = None
        self.own_cores: float | None = None
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        end = _cpu_sample()
        self.seconds = end[2] - self._start[2]
        if self._start[0] is None or end[0] is None or self.seconds <= 0:
            return
        machine = end[0] - self._start[0]
        own = end[1] - self._start[1]
        self.own_cores = own / self.seconds
        self.foreign_cores = max(0.0, (machine - own) / self.seconds)


def _cpu_sample() -> tuple[float | None, float, float]:
    now = time.monotonic()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    own = usage.ru_utime + usage.ru_stime
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None, own, now
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    busy = user + nice + system + irq + softirq + steal
    return busy / _CLK_TCK, own, now


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (``ru_maxrss``; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def loadavg() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------- data

def synthetic_batches(batch_size: int, distinct: int, features: int = 784, classes: int = 10,
                      seed: int = 0):
    """``distinct`` batches of (float32 inputs, int64 labels) as numpy arrays.

    Made with numpy so that the PyTorch and TensorFlow measurements train on
    bit-identical data; shapes ``(distinct, batch_size, features)`` and
    ``(distinct, batch_size)``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((distinct, batch_size, features), dtype=np.float32)
    y = rng.integers(0, classes, size=(distinct, batch_size), dtype=np.int64)
    return x, y


# ------------------------------------------------------------ subprocess runs

class WorkerFailed(RuntimeError):
    pass


def run_worker(script: str, argv: Sequence[str], timeout: float) -> dict:
    """Run ``python script argv...`` in a fresh interpreter; return the JSON it prints last.

    The child inherits the environment unchanged except that the repository root is
    put first on ``PYTHONPATH`` (so that this checkout's ``stratagem`` is measured,
    whether or not it is installed).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, script, *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as error:
        raise WorkerFailed(f"{' '.join(argv)}: timed out after {timeout:.0f} s") from error
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise WorkerFailed(f"{' '.join(argv)}: exit code {proc.returncode}\n    " + "\n    ".join(tail))
    return json.loads(lines[-1])


def emit(result: dict) -> None:
    """Print a worker's result as the last line of its stdout."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------- tables

def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` is one 'l'/'r' per column (default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def git_state() -> dict:
    """The checkout being measured: commit and whether ``stratagem/`` has local edits."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--", "stratagem")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "stratagem_modified_files": None if status is None else len([l for l in status.splitlines() if l])}
