"""Shared by the model-parallel tests: plain PyTorch's training history, and a process's checked against it."""

from __future__ import annotations

import pytest
import torch


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
