"""Metrics (Keras's names) whose value is the global one: over replicas, workers and
parameter-server workers, exactly the metric computed on all predictions at once.

Create a metric in the strategy's scope, update it anywhere a step runs (inside
``strategy.run``, in a function scheduled onto parameter-server workers, or outside any
run), read ``result()`` outside ``run``. States are torchmetrics metrics, combined with the
reductions torchmetrics declares for them (:mod:`stratagem.metrics.base`).

Example::

    import torch, stratagem as sg
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mae = sg.metrics.get("mae")
    y, p = torch.arange(5.0), torch.arange(5.0) + torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0])
    for batch in strategy.experimental_distribute_dataset([(y, p)]):
        strategy.run(mae.update_state, args=batch)
    assert abs(mae.result().item() - 0.6) < 1e-6
"""

from __future__ import annotations

import importlib
from typing import Any

from stratagem.metrics.base import Metric, results

__all__ = ["AUC", "Accuracy", "BinaryAccuracy", "CategoricalAccuracy", "Mean", "MeanAbsoluteError",
           "MeanMetricWrapper", "MeanSquaredError", "Metric", "SparseCategoricalAccuracy", "TorchMetric", "get",
           "results"]

# PEP 562: the metric classes load torchmetrics (~0.5 s); the base class does not, so that the
# parameter-server closure code can recognise metrics without loading it.
_LAZY = {name: "stratagem.metrics.keras" for name in __all__ if name not in ("Metric", "get", "results")}
_LAZY["get"] = "stratagem.metrics.resolve"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stratagem.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
