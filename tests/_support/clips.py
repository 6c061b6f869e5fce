"""Gradient clipping in the multi-process scripts: the steps they take, the same under a strategy
and in plain PyTorch (the oracle).

Each entry of :data:`STEPS` is one training step: backward, one clipping call, the update.
Every ``max_norm`` but one clips (the gradients' norms are larger). ``"first"``: only the first
layer's parameters are clipped; ``"api"``: ``sg.nn.clip_grad_norm_``, or torch's
``clip_grad_value_`` imported (bound) before any strategy existed; ``"nonfinite"``: the loss
times inf, so ``clip_grad_norm_(error_if_nonfinite=True)`` raises torch's RuntimeError on every
process and the step is skipped; ``"again"`` (last): half the loss is back-propagated once more
after the clip, adding to the clipped gradient before the step, as in plain PyTorch.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.nn.utils import clip_grad_value_ as clip_grad_value_bound_early   # still routed by stratagem

import stratagem as sg

STEPS: tuple[dict, ...] = (
    {"max_norm": 0.05},
    {"max_norm": 0.02, "norm_type": math.inf, "api": "sg.nn"},
    {"clip_value": 0.01, "api": "early"},
    {"max_norm": 100.0, "foreach": False},   # does not clip
    {"max_norm": 0.03, "norm_type": 1.0, "first": True},
    {"max_norm": 1.0, "nonfinite": True},
    {"max_norm": 0.05, "foreach": True, "again": True},
)


def clip(model: torch.nn.Module, how: dict) -> float | None:
    """One step's clipping of ``model``'s gradients: the norm returned (None for clip_grad_value_)."""
    params = list(model.parameters())[:2] if how.get("first") else model.parameters()
    if "clip_value" in how:
        fn = clip_grad_value_bound_early if how.get("api") == "early" else torch.nn.utils.clip_grad_value_
        fn(params, how["clip_value"])
        return None
    fn = sg.nn.clip_grad_norm_ if how.get("api") == "sg.nn" else torch.nn.utils.clip_grad_norm_
    norm = fn(params, how["max_norm"], how.get("norm_type", 2.0), error_if_nonfinite=bool(how.get("nonfinite")),
              foreach=how.get("foreach"))
    assert type(norm) is torch.Tensor, type(norm)   # a plain tensor, the same on every process
    return norm.item()


def train_step(how: dict, backward: Callable[[float], Any], model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> dict:
    """One entry of STEPS; ``backward(scale)`` back-propagates ``scale`` times the step's loss.
    Returns the norm, or the error that skipped the step (its message)."""
    optimizer.zero_grad()
    try:
        backward(math.inf if how.get("nonfinite") else 1.0)
        norm = clip(model, how)
        if how.get("again"):
            backward(0.5)
        optimizer.step()
    except (RuntimeError, ValueError) as error:   # the refusals the schedule provokes (the test checks them)
        optimizer.zero_grad()
        return {"norm": None, "error": f"{type(error).__name__}: {error}"}
    return {"norm": norm, "error": None}


def check(got: list[dict], want: list[dict], where: str) -> None:
    """Every step's norm as plain PyTorch's (rel 1e-12), at least one above its max_norm; errors only
    where expected."""
    assert len(got) == len(want) == len(STEPS), (len(got), len(want))
    for step, (g, w, how) in enumerate(zip(got, want, STEPS)):
        if how.get("nonfinite"):
            assert g["error"] and "non-finite" in g["error"] and g["error"] == w["error"], (where, step, g)
        else:
            assert g["error"] is None, (where, step, g["error"])
            if w["norm"] is None:
                assert g["norm"] is None, (where, step)
            else:
                assert math.isclose(g["norm"], w["norm"], rel_tol=1e-12), (where, step, g["norm"], w["norm"])
    assert any(w["norm"] is not None and w["norm"] > how["max_norm"] for w, how in zip(want, STEPS)), want
