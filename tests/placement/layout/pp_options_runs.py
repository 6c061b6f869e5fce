"""Runs tests/placement/layout/pp_options_script.py on 2 processes through `stratagem launch`; plain PyTorch's history."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from . import pp_options_script as script

WORKERS = 2


def launch(out: Path, part: str, timeout: float = 200) -> tuple[list[dict], dict[int, list[str]]]:
    """Each process's results and its output lines (without the launcher's ``[worker R]`` prefix)."""
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", str(WORKERS), script.__file__, str(out),
               "--part", part]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    lines: dict[int, list[str]] = {rank: [] for rank in range(WORKERS)}
    for line in proc.stdout.splitlines():
        for rank in range(WORKERS):
            prefix = f"[worker {rank}] "
            if line.startswith(prefix):
                lines[rank].append(line[len(prefix):])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORKERS)], lines


def plain_history(model_name: str, kind: str, initial: dict) -> tuple[list[dict], torch.Tensor]:
    """Plain PyTorch on each whole batch (float64): the loss and parameters after every step, then
    the model's output for the script's predict batch (in eval mode)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = script.MODELS[model_name]()
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        optimizer = script.make_optimizer(kind, model.parameters())
        history = []
        for x, y in script.make_data():
            optimizer.zero_grad()
            loss = script.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            history.append({"loss": loss.item(), "params": {k: v.clone() for k, v in model.state_dict().items()}})
        with torch.no_grad():
            predicted = model.eval()(script.make_data((7,))[0][0])
        return history, predicted
    finally:
        torch.set_default_dtype(torch.float32)


def as_expected(history: list[dict]) -> list[dict]:
    """A script's history in the form ``assert_history_matches`` expects."""
    return [{"loss": h["loss"], "params": {k: torch.tensor(v, dtype=torch.float64) for k, v in h["params"].items()}}
            for h in history]
