"""Experimental strategies: model parallelism (their API may still change).

- :class:`TensorParallelStrategy`: layers split over a ``{"data": d, "model": t}`` mesh of
  processes with torch's ``parallelize_module``, data parallel over ``d``
  (docs/tensor_parallel.md).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "TensorParallelStrategy": "stratagem.strategies.tensor_parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'stratagem.experimental' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
