"""Run a tutorial port as its own process(es) and read the report it writes to OUT/report.pt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from stratagem.testing import run_task

HERE = Path(__file__).parent


def listing(directory: Path) -> list[str]:
    """The names in ``directory``, without the hidden ones (a checkpoint writer's ``.<series>.lock``)."""
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def run_port(script: str, out: Path, *args: str, timeout: float = 200) -> dict[str, Any]:
    """``python tests/tutorials/<script> OUT args...``: one process, as the tutorial runs (forked from
    the test fork server: torch imported once)."""
    proc = run_task([sys.executable, str(HERE / script), str(out), *args], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return {**torch.load(out / "report.pt", weights_only=False), "output": proc.stdout + proc.stderr}


def launch(script: str, out: Path, *args: str, workers: int, ps: int = 0, max_restarts: int = 0,
           timeout: float = 200) -> str:
    """``stratagem launch --workers N [--ps M] [--max-restarts K] tests/tutorials/<script> OUT args...``;
    what the tasks printed."""
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", str(workers),
               "--ps", str(ps), "--max-restarts", str(max_restarts)]
    proc = subprocess.run([*command, str(HERE / script), str(out), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def launch_port(script: str, out: Path, *args: str, workers: int, ps: int = 0,
                timeout: float = 200) -> dict[str, Any]:
    """:func:`launch`, then the report the coordinator wrote to OUT/report.pt."""
    output = launch(script, out, *args, workers=workers, ps=ps, timeout=timeout)
    return {**torch.load(out / "report.pt", weights_only=False), "output": output}
