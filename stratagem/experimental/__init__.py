"""Experimental strategies: model parallelism (their API may still change).

- :class:`TensorParallelStrategy`: layers split over a ``{"data": d, "model": t}`` mesh of
  processes with torch's ``parallelize_module``, data parallel over ``d``
  (docs/tensor_parallel.md).

``stratagem.experimental`` itself is imported only when first used (``sg.experimental``).
"""

from stratagem.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["TensorParallelStrategy"]
