"""Which steps ``sg.Model`` runs under a strategy: the strategy declares a kind, this picks the class.

The core does not know the Keras layer: a strategy only says how its step is shaped
(:attr:`Strategy.model_steps_kind <stratagem.Strategy.model_steps_kind>`), and the steps
for that shape live here, beside the loops that run them.
"""

from __future__ import annotations

from typing import Any, Callable

from stratagem.errors import InvalidArgumentError
from stratagem.keras.pipeline_steps import PipelineSteps
from stratagem.keras.steps import ModelSteps

__all__ = ["steps_for"]

_KINDS: dict[str, Callable[[Any], ModelSteps]] = {
    "replica": lambda strategy: ModelSteps(),
    "pipeline": PipelineSteps,
}


def steps_for(strategy: Any) -> ModelSteps:
    """The train / test / predict steps ``sg.Model`` runs under ``strategy``."""
    kind = getattr(strategy, "model_steps_kind", "replica")
    make = _KINDS.get(kind)
    if make is None:
        raise InvalidArgumentError(f"{type(strategy).__name__}.model_steps_kind is {kind!r}; sg.Model knows "
                                   f"{sorted(_KINDS)}")
    return make(strategy)
