"""Shared by the model-parallel tests: plain PyTorch's training history, and a process's checked against it
(also with gradient clipping: :func:`check_clipping`)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from ..._support import clips


def assert_history_matches(history: list[dict], expected: list[dict], where: str) -> None:
    """Every step's loss and parameters (lists, as a script printed them) equal ``expected`` to 1e-12."""
    assert len(history) == len(expected), f"{where}: {len(history)} steps, expected {len(expected)}"
    for step, (got, want) in enumerate(zip(history, expected)):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12), f"{where}, step {step}"
        for name, value in want["params"].items():
            torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value,
                                       rtol=1e-12, atol=1e-12, msg=lambda m: f"{where}, step {step}, {name}: {m}")


def plain_history(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, loss_fn) -> list[dict]:
    """Plain PyTorch on each whole batch: the loss and the parameters after every step (float64)."""
    history = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        history.append({"loss": loss.item(), "params": {k: v.clone() for k, v in model.state_dict().items()}})
    return history


def check_clipping(out: dict, make_model: Callable, make_optimizer: Callable, batches, loss_fn, where: str) -> None:
    """A script's steps of clips.STEPS (its initial parameters, each step's norm or error and parameters)
    against plain PyTorch's same steps on the whole batches (float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = make_model()
        model.load_state_dict({k: torch.tensor(v) for k, v in out["initial"].items()})
        optimizer = make_optimizer(model.parameters())
        want, params = [], []
        for how, (x, y) in zip(clips.STEPS, batches):
            want.append(clips.train_step(how, lambda scale: (scale * loss_fn(model(x), y)).backward(), model, optimizer))
            params.append({k: v.clone() for k, v in model.state_dict().items()})
    finally:
        torch.set_default_dtype(torch.float32)
    clips.check(out["steps"], want, where)
    for step, (got, expected, how) in enumerate(zip(out["steps"], params, clips.STEPS)):
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value, rtol=1e-12,
                                       atol=1e-12, msg=lambda m: f"{where}, clipping step {step}, {name}: {m}")
