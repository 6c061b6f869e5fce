"""Automatic parallelism: ``sg.experimental.plan`` chooses a model's layout over processes (docs/planning.md).

- :mod:`.memory`: per-process memory of a layout, counted exactly (parameters, gradients,
  optimizer state under each ZeRO stage);
- :mod:`.profile`: a short profile of the model on one device (per-block time and bytes);
- :mod:`.layouts`: the layouts a number of processes allows, each a ``PipelineStrategy``;
- :mod:`.cost`: predicted step time and memory from the profile and the measured network;
- :mod:`.trial`: what the processes run (profile, predict, measure);
- :mod:`.plan`: :func:`plan` and the :class:`Plan` it returns.
"""

from stratagem.experimental.planning.plan import Plan, PlanRow, plan

__all__ = ["Plan", "PlanRow", "plan"]
