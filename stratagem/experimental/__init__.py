"""Experimental strategies: model parallelism (their API may still change).

- :class:`TensorParallelStrategy`: layers split over a ``{"data": d, "model": t}`` mesh of
  processes with torch's ``parallelize_module``, data parallel over ``d``
  (docs/tensor_parallel.md).
- :class:`Timeline`: a Chrome/Perfetto trace of every step of the job (docs/observability.md).
- :class:`PipelineStrategy`: an ``nn.Sequential`` cut into stages over a ``{"data": d, "pipe": p}``
  mesh of processes, run with torch's pipeline schedules (docs/pipeline.md).
- :func:`plan`: the layout of a model over processes (data x pipe x model, ZeRO stage,
  recomputation, micro-batches, schedule) chosen by prediction and measurement; it returns a
  :class:`Plan` whose ``strategy()`` builds it (docs/planning.md).

``stratagem.experimental`` itself is imported only when first used (``sg.experimental``), and
its planner (``stratagem.experimental.planning``, which starts processes) when ``plan`` is.
"""

from stratagem.strategies.tensor_parallel import TensorParallelStrategy
from stratagem.strategies.pipeline import PipelineStrategy
from stratagem.experimental.timeline import Timeline

__all__ = ["TensorParallelStrategy"]
__all__ += ["PipelineStrategy"]
__all__ += ["Timeline"]
__all__ += ["Plan", "plan"]


def __getattr__(name: str):
    # the planner starts processes (stratagem.testing): loaded when first used, not with the strategies
    if name in ("Plan", "plan"):
        from stratagem.experimental import planning
        return getattr(planning, name)
    raise AttributeError(f"module 'stratagem.experimental' has no attribute {name!r}")
