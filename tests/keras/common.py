"""What the Model tests share: a small classifier, its data, and fit under a strategy."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import stratagem as sg

ROWS, FEATURES, CLASSES = 103, 5, 3   # 103 rows in batches of 10: the last batch has 3 rows


def data(rows: int = ROWS, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    weights = rng.uniform(0.5, 2.0, size=rows).astype(np.float32)
    return x, y, weights


def make_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def build(strategy: Any, optimizer: str = "adam", metrics: tuple = ("accuracy",)) -> sg.Model:
    with strategy.scope():
        model = sg.Model(make_module())
        model.compile(optimizer=optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=list(metrics))
    return model


def state(model: sg.Model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}


def fit(strategy: Any, **kwargs: Any) -> tuple[sg.Model, Any]:
    """Fit the classifier on ``data()`` with weights, shuffling, validation; seeded."""
    x, y, w = data()
    model = build(strategy)
    torch.manual_seed(123)   # the shuffling order
    history = model.fit(x, y, batch_size=10, epochs=3, sample_weight=w, validation_data=(x[:31], y[:31]),
                        verbose=0, **kwargs)
    return model, history
