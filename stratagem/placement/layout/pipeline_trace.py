"""Stages of a model with its own ``forward`` (not an ``nn.Sequential``), cut by torch's tracer.

torch's ``pipeline()`` traces a model with ``torch.export`` on an example micro-batch and cuts
the graph before each module named as a split point; each stage is a ``GraphModule`` that
holds the very parameter objects of the module it traced, under their original names.

Here the tracer never sees the user's model: it traces a copy on the ``meta`` device (no
memory, no values; every process, whatever it holds), then the stage modules of this
process get the model's own parameters and buffers back, by name. So a stage trains the
model's tensors, the optimizer created in scope updates them, and state dicts keep the
model's names and order. The graphs have the traced shapes baked in: one trace per
micro-batch shape (and train/eval modes), cached.

Which stage holds a parameter is known only after the first trace (at the first
``forward_backward`` or ``predict``): until then every process holds the whole model. Then
the parameters and buffers of the stages held elsewhere become ``meta`` placeholders here,
in the model and in the parameter groups of its optimizers (their state for those
parameters is dropped), as the ``nn.Sequential`` path does at placement.
"""

from __future__ import annotations

import collections
import copy
import warnings
from typing import Any

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError

#: traced shapes kept per model (each holds its stage graphs)
MAX_TRACES = 8


def traced_split_points(model: nn.Module, split_points: list[str] | None, count: int) -> list[str]:
    """The module names where stages 1.. begin: checked, or derived evenly over the longest ModuleList."""
    if split_points is not None:
        modules = dict(model.named_modules())
        for point in split_points:
            if not point or point not in modules:
                raise InvalidArgumentError(
                    f"the split point {point!r} names no module of the {type(model).__name__}; split points "
                    f"name the modules where a stage begins, as in named_modules() (e.g. 'blocks.2')")
        if len(set(split_points)) != len(split_points):
            raise InvalidArgumentError(f"split points must name distinct modules, got {split_points}")
        return list(split_points)
    if count == 1:
        return []
    name, blocks = longest_list(model)
    if count > len(blocks):
        raise InvalidArgumentError(
            f"the pipeline needs {count} stages, but the longest nn.ModuleList of the {type(model).__name__} "
            f"({name!r}) has only {len(blocks)} modules to split; give split_points, fewer stages, or a schedule "
            f"with one stage per process")
    return [f"{name}.{i}" for i in even_edges(len(blocks), count)[1:-1]]


def longest_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's blocks: its longest ``nn.ModuleList`` (the first of the longest) and its name."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise InvalidArgumentError(
            f"the {type(model).__name__} is not an nn.Sequential and has no nn.ModuleList to split evenly: give "
            f"split_points=['blocks.2', ...] (the modules where stages begin), or write the model as "
            f"nn.Sequential(embedding, *blocks, head)")
    return max(lists, key=lambda item: len(item[1]))


def even_edges(length: int, count: int) -> list[int]:
    """Where ``count`` runs of ``length`` items as even as possible begin, and the end (the first runs get one more)."""
    size, extra = divmod(length, count)
    edges = [0]
    for s in range(count):
        edges.append(edges[-1] + size + (1 if s < extra else 0))
    return edges


class TracedStages:
    """The stage graphs of one model for each traced input shape; this process's held tensors."""

    def __init__(self, model: nn.Module, points: list[str], *, num_stages: int, stages: list[int],
                 part: Any):
        self.model = model
        self.points = points
        self.num_stages = num_stages
        self.stages = stages               # the stage indices this process holds
        self.part = part                   # the Stages part: pipe group, device, what to hide from the tracer
        self.names: list[set[str]] | None = None   # per stage: the model's tensors it uses (first trace)
        self._traced: collections.OrderedDict[Any, dict[int, nn.Module]] = collections.OrderedDict()

    def modules_for(self, sample: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
        """This process's stage modules for inputs shaped as ``sample`` (traced on first sight)."""
        key = (tuple((tuple(x.shape), x.dtype) for x in sample), self.mode())
        modules = self._traced.get(key)
        if modules is None:
            error = None
            try:
                with self.part.tracing(self.model):
                    modules = self._trace(sample)
            except Exception as e:   # raised below, once the other processes know
                error = e
            self.part.agree_on_trace(error)   # every process of the pipeline raises, or none
            self._traced[key] = modules
            if len(self._traced) > MAX_TRACES:
                self._traced.popitem(last=False)
        self._traced.move_to_end(key)
        return modules

    def mode(self) -> tuple[bool, ...]:
        """The train/eval flags of the model's modules: the traced graphs depend on them."""
        return tuple(m.training for m in self.model.modules())

    def _trace(self, sample: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
        pipe, origin = trace(self.model, self.points, sample)
        if pipe.replicated_params:
            shared = sorted({origin.get(id(getattr(pipe.split_gm, stage).get_parameter(name)), name)
                             for use in pipe.replicated_params for stage, name in use.items()})
            raise InvalidArgumentError(
                f"the parameters {shared} are used by several stages (tied weights, e.g. an embedding shared "
                f"with the head); PipelineStrategy cannot split a parameter across processes: untie them, or "
                f"choose split points that keep their users in one stage")
        names = []
        for s in range(self.num_stages):
            stage = pipe.get_stage_module(s)
            tensors = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
            names.append({origin[id(t)] for _, t in tensors if id(t) in origin})
        if self.names is None:
            self.names = names
            self.part.keep_only(self.model, set().union(*(names[s] for s in self.stages)), set().union(*names),
                                     self.stages)
        elif names != self.names:
            raise InvalidArgumentError(
                f"tracing the {type(self.model).__name__} for inputs of shapes {[tuple(x.shape) for x in sample]} "
                f"put its parameters in other stages than the first trace did; the model's forward must call the "
                f"same modules for every input shape")
        held = {}
        for s in self.stages:
            held[s] = stage_module(pipe, s, self.model, origin, self.part.device)
        return held


def trace(model: nn.Module, points: list[str], sample: tuple[torch.Tensor, ...]) -> tuple[Any, dict[int, str]]:
    """torch's ``Pipe`` of a ``meta`` copy of ``model`` cut before each of ``points``, traced for inputs
    shaped as ``sample``, and the id of each of the copy's tensors -> the model's name for it."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    shadow, origin = _meta_copy(model)
    example = tuple(torch.empty_like(x, device="meta") for x in sample)
    try:
        with warnings.catch_warnings():   # torch's own deprecations inside pipeline() (pytree)
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(shadow, example, split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:   # torch.export's errors: data-dependent control flow, unsupported ops, ...
        raise InvalidArgumentError(
            f"PipelineStrategy could not trace the {type(model).__name__} with torch.export to cut it "
            f"at {points} ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); make its "
            f"forward torch.export-compatible (no Python branches on tensor values), or write the model "
            f"as nn.Sequential(embedding, *blocks, head), which needs no tracing") from e
    if pipe.num_stages != len(points) + 1:
        raise InvalidArgumentError(
            f"cutting the {type(model).__name__} before {points} gave {pipe.num_stages} stages, "
            f"not {len(points) + 1}: every split point must name a module that forward calls, once (a "
            f"container such as a whole ModuleList is never called)")
    return pipe, origin


def stage_module(pipe: Any, stage: int, model: nn.Module, origin: dict[int, str], device: torch.device) -> nn.Module:
    """Stage ``stage``'s graph of a :func:`trace`, computing with ``model``'s own tensors on ``device``."""
    module = pipe.get_stage_module(stage)
    _give_back_tensors(module, model, origin)
    _move_device_arguments(module, device)
    return module


def _meta_copy(model: nn.Module) -> tuple[nn.Module, dict[int, str]]:
    """A copy of the model on ``meta``, and the id of each of its tensors -> the model's name for it."""
    memo: dict[int, Any] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            names[id(memo[id(p)])] = name
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
            names[id(memo[id(b)])] = name
    shadow = copy.deepcopy(model, memo)
    for hooks in (shadow._state_dict_hooks, shadow._load_state_dict_pre_hooks):
        hooks.clear()   # the whole-model gather over the pipe axis is the model's, not the tracer's
    return shadow, names


def _give_back_tensors(stage: nn.Module, model: nn.Module, origin: dict[int, str]) -> None:
    """The stage graph's (meta) parameters and buffers become the model's own, by the model's names."""
    for kind, getter in (("_parameters", model.get_parameter), ("_buffers", model.get_buffer)):
        for module in stage.modules():
            table = getattr(module, kind)
            for leaf, tensor in list(table.items()):
                if tensor is not None and id(tensor) in origin:
                    table[leaf] = getter(origin[id(tensor)])


def _move_device_arguments(stage: nn.Module, device: torch.device) -> None:
    """Factory calls traced on ``meta`` (``torch.arange(..., device=x.device)``) run on this device."""
    for module in stage.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            where = node.kwargs.get("device")
            if isinstance(where, (str, torch.device)) and torch.device(where).type == "meta":
                node.update_kwarg("device", device)
                changed = True
        if changed:
            module.recompile()
