"""Experimental strategies: model parallelism (their API may still change).

- :class:`TensorParallelStrategy`: layers split over a ``{"data": d, "model": t}`` mesh of
  processes with torch's ``parallelize_module``, data parallel over ``d``
  (docs/tensor_parallel.md).
- :class:`Timeline`: a Chrome/Perfetto trace of every step of the job (docs/observability.md).
- :class:`PipelineStrategy`: an ``nn.Sequential`` cut into stages over a ``{"data": d, "pipe": p}``
  mesh of processes, run with torch's pipeline schedules (docs/pipeline.md).

``stratagem.experimental`` itself is imported only when first used (``sg.experimental``).
"""

from stratagem.strategies.tensor_parallel import TensorParallelStrategy
from stratagem.strategies.pipeline import PipelineStrategy
from stratagem.experimental.timeline import Timeline

__all__ = ["TensorParallelStrategy"]
__all__ += ["PipelineStrategy"]
__all__ += ["Timeline"]
