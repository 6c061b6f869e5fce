"""Stages: the layout part that cuts a model created in scope into stages over a mesh's pipe axis.

A pipeline's first layout part in mesh order (:class:`~stratagem.placement.layout.pipeline.PipelinePlacement`
composes the tensor-parallel plan and FSDP2's units after it, on this process's stages). For each
model it decides which stages this process holds and cuts the model, the same on every process:

- an ``nn.Sequential`` is cut between its children at once
  (:class:`~stratagem.placement.layout.pipeline_plan.StageLayout`: at the split points, or evenly); the
  children of the stages another process holds move to the ``meta`` device, so this process keeps only
  its own stages' parameters and buffers;
- any other model is cut by torch's tracer at its first step
  (:mod:`stratagem.placement.layout.pipeline_trace`), and its tensors of the stages held elsewhere
  become ``meta`` then (:meth:`Stages.keep_only`), in its optimizers too;
- ``split_points="auto"``: an ``nn.Sequential`` is cut at the first step, where its blocks' measured
  costs are balanced (:meth:`Stages.balance`, :mod:`stratagem.placement.layout.pipeline_balance`).

A split model's ``state_dict()`` reads as the whole logical model on every process (the pipe axis
gathers the stages' entries: a collective), and ``load_state_dict`` keeps this process's stages.
Calling the model directly (not through the strategy's schedule) is refused where other processes
hold some of its stages.

Clipping (:meth:`Stages.norm_axes`): each stage is held on one process of the pipe axis, so no axis
of the pipeline replicates a part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.pipeline_balance import balance_layout
from stratagem.placement.layout.pipeline_plan import StageLayout, plan_stages
from stratagem.placement.layout.pipeline_trace import TracedStages


@dataclasses.dataclass
class SplitModel:
    """One model created in scope, cut into stages; ``local`` are this process's stage modules."""

    layout: StageLayout
    local: dict[int, nn.Sequential]          # stage index -> its children (shared with the model)
    traced: TracedStages | None = None       # a model that is not an nn.Sequential: its stage graphs
    model: nn.Module | None = None           # the model itself (the names recompute= gives)
    waiting: list[int] | None = None         # an nn.Sequential that split_points="auto" cuts at the first step

    @property
    def stages(self) -> list[int]:
        """The stage indices this process holds."""
        if self.waiting is not None:
            return list(self.waiting)
        return sorted(self.local) if self.traced is None else list(self.traced.stages)

    def mode(self) -> Any:
        """What besides the input shapes the stage modules depend on (a traced model's train/eval flags)."""
        return None if self.traced is None else self.traced.mode()

    def modules_for(self, sample: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
        """This process's stage modules for inputs shaped as ``sample`` (a micro-batch, or a whole batch)."""
        return self.local if self.traced is None else self.traced.modules_for(sample)


class Stages:
    """A layout part: models cut into stages over a mesh's pipe axis, this process keeping its own (see
    the module doc). ``owner`` is the placement that composes it (held weakly): the optimizers created
    in its scope (``owner.update.refs``) and its pending modules (``owner.keeping_pending``)."""

    def __init__(self, owner: Any, config: dict[str, Any], *, pipe_rank: int, pipe: Collective,
                 everyone: Collective, device: torch.device, gathered: dict[int, dict], sequential_only: bool):
        self._owner = weakref.ref(owner)
        self.config = config             # split_points, num_stages, pipe_size, schedule, num_microbatches, ...
        self.pipe_rank = pipe_rank
        self.pipe = pipe                 # this process's pipeline (gathers the stages' state)
        self.everyone = everyone         # every process (split_points="auto" measures on the first)
        self.device = device
        self.gathered = gathered         # id(model) -> its whole state, gathered already for a checkpoint
        self.sequential_only = sequential_only   # parts after the stages need them cut at placement
        self.models: dict[int, SplitModel] = {}   # id(model) -> its split
        self._hooks: dict[int, list[int]] = {}     # id(traced model) -> its forward pre-hooks set here

    def place(self, root: nn.Module) -> dict[int, nn.Sequential] | None:
        """Lay ``root`` out in stages: this process's stage modules where it is cut now, else None (cut at
        its first step: traced, or measured)."""
        layout = plan_stages(root, **self.config)
        root.register_state_dict_post_hook(functools.partial(_whole_state, weakref.ref(self)))
        root.register_load_state_dict_pre_hook(_own_state)
        if not isinstance(root, nn.Sequential):   # traced at the first step, when the inputs are known
            if self.sequential_only:
                raise InvalidArgumentError(
                    f"a tensor-parallel plan or sharding= inside a PipelineStrategy's stages needs the model "
                    f"as an nn.Sequential (cut when it is placed), but got a {type(root).__name__} that "
                    f"the tracer would cut at its first step; write it as nn.Sequential(embedding, *blocks, "
                    f"head), or drop plan= / sharding=")
            stages = layout.stages_of(self.pipe_rank)
            self.models[id(root)] = SplitModel(layout, {}, TracedStages(
                root, list(layout.points), num_stages=layout.num_stages, stages=stages, part=self), root)
            return None
        if layout.balance is not None:   # split_points="auto": cut once measured, at the first step
            self.models[id(root)] = SplitModel(layout, {}, model=root, waiting=layout.stages_of(self.pipe_rank))
            return None
        return self.cut(root, layout)

    def cut(self, root: nn.Sequential, layout: StageLayout, *, late: bool = False) -> dict[int, nn.Sequential]:
        """Cut an ``nn.Sequential`` into stages: the children of the stages held elsewhere become meta
        (``late``: after its optimizers were created, which then get meta placeholders too). Returns
        this process's stage modules (containers created here, around the model's children)."""
        children = list(root.children())
        local = {s: nn.Sequential(*children[a:b]) for s, (a, b) in enumerate(layout.bounds)
                 if layout.rank_of(s) == self.pipe_rank}
        mine = {id(m) for stage in local.values() for m in stage.modules()}
        named = list(root.named_children())
        elsewhere = [child for _, child in named if id(child) not in mine]
        if late:
            tensors = [(f"{name}.{n}", child) for name, child in named
                       for n, _ in [*child.named_parameters(remove_duplicate=False),
                                    *child.named_buffers(remove_duplicate=False)]]
            self.keep_only(root, {n for n, child in tensors if id(child) in mine}, {n for n, _ in tensors},
                           sorted(local))
        else:
            for child in elsewhere:
                child.to("meta")     # another process holds it
            if elsewhere:
                root.register_forward_pre_hook(functools.partial(_not_whole, sorted(local)))
        self.models[id(root)] = SplitModel(layout, local, model=root)
        return local

    def keep_only(self, model: nn.Module, held: set[str], used: set[str], stages: list[int]) -> None:
        """A traced model's first trace: its tensors that other stages use (``used`` but not ``held``)
        become meta here, in the model and in its optimizers (whose state for them is dropped)."""
        mine = {id(_tensor(model, name)) for name in held}
        theirs = {id(_tensor(model, name)) for name in used} - mine
        swapped: dict[int, nn.Parameter] = {}
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            if id(tensor) not in theirs:
                continue
            prefix, _, leaf = name.rpartition(".")
            owner = model.get_submodule(prefix)
            if isinstance(tensor, nn.Parameter):
                meta = swapped.get(id(tensor))
                if meta is None:
                    meta = swapped[id(tensor)] = nn.Parameter(tensor.detach().to("meta"), tensor.requires_grad)
                owner._parameters[leaf] = meta
            else:
                owner._buffers[leaf] = tensor.to("meta")
        for ref in self._owner().update.refs:
            optimizer = ref()
            if optimizer is None:
                continue
            for group in optimizer.param_groups:
                for i, p in enumerate(group["params"]):
                    if id(p) in swapped:
                        optimizer.state.pop(p, None)
                        group["params"][i] = swapped[id(p)]
        if self.pipe.num_workers > 1:
            handle = model.register_forward_pre_hook(functools.partial(_not_whole, stages))
            self._hooks.setdefault(id(model), []).append(handle.id)

    @contextlib.contextmanager
    def tracing(self, model: nn.Module) -> Iterator[None]:
        """While the tracer copies and runs ``model``: without the forward hooks set here, and the
        modules it creates (in a scope) are no new models."""
        hidden = {i: model._forward_pre_hooks.pop(i) for i in self._hooks.get(id(model), [])
                  if i in model._forward_pre_hooks}
        try:
            with self._owner().keeping_pending():
                yield
        finally:
            model._forward_pre_hooks.update(hidden)

    def agree_on_trace(self, error: Exception | None) -> None:
        """Every process of the pipeline raises if one could not trace (none waits for the others)."""
        failed = error is not None
        if self.pipe.num_workers > 1:
            flag = torch.tensor([int(failed)], device=self.pipe.group.device)
            failed = bool(self.pipe.group.all_reduce(flag, "forward_backward (tracing the model)").item())
        if error is not None:
            raise error
        if failed:
            raise InvalidArgumentError(
                "another process of the pipeline could not trace the model (its error says why); make the "
                "model's forward torch.export-compatible, or write it as nn.Sequential(embedding, *blocks, head)")

    def split_of(self, model: Any) -> SplitModel:
        """The split of ``model``, refused for a model this part did not place."""
        split = self.models.get(id(model))
        if split is None:
            raise InvalidArgumentError(
                f"forward_backward and predict need the model created in this PipelineStrategy's "
                f"scope (the one it split into stages), got a {type(model).__name__} it did not place; "
                f"create the model inside strategy.scope()")
        return split

    def balance(self, model: nn.Module, split: SplitModel, batch: tuple[torch.Tensor, ...]
                ) -> dict[int, nn.Sequential] | None:
        """``split_points="auto"``: measure ``model`` on the first micro-batch of ``batch`` and cut it (every
        process at the same step); this process's stage modules where an ``nn.Sequential`` was cut now."""
        rows = -(-batch[0].shape[0] // self.config["num_microbatches"])
        layout = balance_layout(model, split.layout, tuple(x[:rows] for x in batch), part=self)
        if split.traced is not None:
            split.layout, split.traced.points = layout, list(layout.points)
            return None
        return self.cut(model, layout, late=True)

    #: each stage's state lives on the pipe axis alone (the data groups hold the same values)
    spread_over_data = False

    def spreads(self, obj: Any) -> bool:
        """Whether ``obj`` is a split model (its state dict gathers the stages over the pipe axis)."""
        return id(obj) in self.models

    def norm_axes(self) -> dict[str, int]:
        """Clipping: each stage lives on one process of the pipe axis (no axis replicates a part)."""
        return {}


def _whole_state(stages_ref: Any, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Fill the entries of stages held elsewhere (meta here) with their values, gathered over the pipe axis."""
    stages = stages_ref()   # a weak reference: a deep copy of the model copies it as is
    keys = [k for k in state_dict if k.startswith(prefix)]
    if stages is None or stages.pipe.num_workers == 1 or \
            any(isinstance(state_dict[k], nn.Parameter) for k in keys):   # keep_vars: the tensors themselves
        return
    gathered = stages.gathered.get(id(module))
    if gathered is not None:   # gathered already for the checkpoint being written
        state_dict.update(gathered)
        return
    pipe, device = stages.pipe, stages.device
    mine = {k: state_dict[k].detach().cpu() for k in keys
            if isinstance(state_dict[k], torch.Tensor) and not state_dict[k].is_meta}
    for part in pipe.all_gather_object(mine, "model.state_dict (the stages of the pipeline)"):
        for key, value in part.items():
            if state_dict[key].is_meta:
                state_dict[key] = value.to(device)


def _own_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Entries of stages held elsewhere (meta here) load as meta: this process keeps its own."""
    held = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))
    held.update(module.named_buffers(prefix=prefix.rstrip("."), remove_duplicate=False))
    for key, tensor in held.items():
        if tensor.is_meta and key in state_dict and isinstance(state_dict[key], torch.Tensor):
            state_dict[key] = state_dict[key].to("meta")


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _not_whole(stages: list[int], module: nn.Module, args: Any) -> None:
    raise InvalidArgumentError(
        f"this process holds only stage(s) {stages} of the pipelined model (the others live on other "
        f"processes), so the model cannot be called directly: train it with "
        f"strategy.forward_backward(model, x, y), evaluate it with strategy.predict(model, x)")
