"""Activation recomputation in pipeline stages (GPipe's re-materialisation), on torch.utils.checkpoint.

``PipelineStrategy(recompute=...)`` drops the activations of a region after its forward and
recomputes them in its backward: the region runs under ``torch.utils.checkpoint.checkpoint``
(non-reentrant), which keeps only the region's inputs, saves the random generators' state
with them, and replays the region's forward with that state when the backward first needs a
saved tensor. So dropout draws the same masks again, and the gradients are those of the run
without recomputation. The regions:

- ``True`` (or ``"stage"``): each stage's whole forward, for every micro-batch; a stage then
  holds one input per micro-batch in flight, and recomputes its forward once per micro-batch
  (also under the zero-bubble schedules, whose backward runs in two passes);
- a list of module names (as in ``named_modules()``: ``["blocks.0", "blocks.3"]``): each named
  module's forward; the name of an ``nn.ModuleList`` (or ``ModuleDict``), which ``forward``
  never calls itself, stands for each of its entries (``["blocks"]``: every block).

Nothing here touches a model before its stages are built: :func:`apply` is given the modules
the schedule trains (:class:`~torch.distributed.pipelining.PipelineStage`'s ``submod``) and
makes their forward (the stage module's own, or the named modules' inside it) checkpointed.
The stage modules are stratagem's own (an ``nn.Sequential`` of the model's children, or a
traced stage graph); a named module of an ``nn.Sequential`` model is the model's own module,
whose ``forward`` is then checkpointed wherever it is called with gradients enabled (under
``torch.no_grad()``, ``predict``, it runs as it is).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stratagem.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What each stage recomputes: its whole forward, or the named modules' (the model's names)."""

    whole_stage: bool = False
    names: tuple[str, ...] = ()


def check_recompute(value: Any) -> Recompute | None:
    """``PipelineStrategy``'s ``recompute=`` option, checked; None: nothing is recomputed."""
    if value is None or value is False:
        return None
    if value is True or value == "stage":
        return Recompute(whole_stage=True)
    if isinstance(value, (list, tuple)) and value and all(isinstance(n, str) and n for n in value) \
            and len(set(value)) == len(value):
        return Recompute(names=tuple(value))
    raise InvalidArgumentError(
        f"recompute must be True or 'stage' (each stage's forward is recomputed in its backward), a list of "
        f"distinct module names (['blocks.0', 'blocks.3']; a ModuleList's name stands for its entries), or False; "
        f"got {value!r}")


def expand_names(model: nn.Module, recompute: Recompute | None) -> Recompute | None:
    """``recompute`` with its names checked against ``model`` and each container's name replaced by its entries."""
    if recompute is None or recompute.whole_stage:
        return recompute
    modules = dict(model.named_modules())
    names: list[str] = []
    for name in recompute.names:
        module = modules.get(name)
        if module is None or module is model:
            raise InvalidArgumentError(
                f"recompute names {name!r}, which is no submodule of the {type(model).__name__}; name modules as in "
                f"named_modules() (e.g. {_example(model)!r}), or give recompute=True for whole stages")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):   # never called itself: its entries are
            names += [f"{name}.{child}" for child, _ in module.named_children()]
        else:
            names.append(name)
    return Recompute(names=tuple(dict.fromkeys(names)))


class CheckpointedForward:
    """A module's ``forward`` run under a non-reentrant checkpoint whenever gradients are enabled.

    Stored as the module's ``forward`` attribute (``nn.Module.__call__`` calls ``self.forward``):
    the module keeps its class, its hooks, its names and its state dict. It holds the module and
    the function its ``forward`` was bound to, so a deep copy of the module calls the copy.
    """

    def __init__(self, module: nn.Module):
        forward = module.forward
        bound = getattr(forward, "__self__", None) is module
        self.module = module if bound else None
        self.function = forward.__func__ if bound else forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is not None:
            args = (self.module, *args)
        if not torch.is_grad_enabled():
            return self.function(*args, **kwargs)
        if _OBSERVERS:
            return checkpoint(self.function, *args, use_reentrant=False, context_fn=_observed, **kwargs)
        return checkpoint(self.function, *args, use_reentrant=False, **kwargs)


#: what replays a recomputed region under (:func:`observing`)
_OBSERVERS: list[Any] = []


def _observed() -> tuple[Any, Any]:
    return contextlib.nullcontext(), _OBSERVERS[-1]()


@contextlib.contextmanager
def observing(context: Any) -> Iterator[None]:
    """While it is active, each recomputed region's replay (in backward) runs inside ``context()``: how
    ``sg.experimental.plan`` counts what the replay saves."""
    _OBSERVERS.append(context)
    try:
        yield
    finally:
        _OBSERVERS.remove(context)


def apply(modules: dict[int, nn.Module], recompute: Recompute | None, model: nn.Module, *,
          check_over: Any = None) -> None:
    """Make the recomputed regions of this process's stage ``modules`` checkpointed (idempotent).

    A traced model's names are looked up in its stage graphs (which keep the model's names); an
    ``nn.Sequential``'s are the model's own modules, found in the stage that holds them.
    ``check_over`` (the pipe axis's Collective, for a traced model): every named module must be
    in some stage of the pipeline (a module the traced forward never calls is not), else every
    process raises alike.
    """
    if recompute is None:
        return
    if recompute.whole_stage:
        for module in modules.values():
            _checkpoint_forward(module)
        return
    found = set()
    for stage in modules.values():
        inside = {id(m) for m in stage.modules()}
        for name in recompute.names:
            module = model.get_submodule(name)
            if id(module) not in inside:    # a traced stage graph: its own module under the model's name
                try:
                    module = stage.get_submodule(name)
                except AttributeError:
                    continue
            _checkpoint_forward(module)
            found.add(name)
    if check_over is None:
        return
    every = [found] if check_over.num_workers == 1 else \
        [set(f) for f in check_over.all_gather_object(sorted(found), "forward_backward (the modules to recompute)")]
    missing = [name for name in recompute.names if not any(name in f for f in every)]
    if missing:
        raise InvalidArgumentError(
            f"recompute names {missing}, which no stage of the {type(model).__name__} calls as a module (the traced "
            f"forward never calls them, or calls them inside another module's code); name modules that forward "
            f"calls, or give recompute=True for whole stages")


def _checkpoint_forward(module: nn.Module) -> None:
    if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
        module.forward = CheckpointedForward(module)


def _example(model: nn.Module) -> str:
    names = [name for name, _ in model.named_modules() if name]
    return names[min(1, len(names) - 1)] if names else "0"
