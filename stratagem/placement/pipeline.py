"""PipelinePlacement: an ``nn.Sequential`` created in scope, split into stages over a "pipe" axis.

Modules created in scope wait until ``finalize()``. Then every process checks that all
built the same modules and takes the chief's initial values (so that every process,
and every data-parallel group, starts alike), and each root ``nn.Sequential`` is cut
into stages (:class:`StageLayout`: at the split points, or evenly). A stage lives on
one process of the pipe axis: stage ``s`` on ``s % p`` ("loop" placement, also for the
interleaved schedules) or, for the V schedules, stages ``r`` and ``2p - 1 - r`` on
process ``r``. The children of the stages another process holds move to the ``meta``
device: this process keeps only its own stages' parameters and buffers.

Optimizers created in scope keep only this process's parameters (the others are
dropped from their parameter groups); their ``step`` first sums the gradients over the
data axis (each data group's loss is already weighted by its share of the global batch).

State: a split model's ``state_dict()`` reads as the whole logical model on every
process (the pipe axis gathers the stages: a collective, so every process calls it);
``load_state_dict`` takes the whole model and keeps this process's stages. An
optimizer's state dict holds this process's parameters only. ``sg.Checkpoint`` is
refused for now.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
from torch import nn

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.base import Placement
from stratagem.placement.hooks import adopt, run_hooks, step_hooks, unhooked_step

#: schedule name -> (torch class name, stage placement: "loop" or "v", stages per process or None: any)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved": ("ScheduleInterleaved1F1B", "loop", None),
    "looped_bfs": ("ScheduleLoopedBFS", "loop", None),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop", None),
    "zero_bubble": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
}


def check_schedule(schedule: Any) -> str:
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise InvalidArgumentError(
            f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    return schedule.lower()


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """How one model is cut: ``bounds[s]`` is stage ``s``'s range of the model's children."""

    bounds: tuple[tuple[int, int], ...]
    pipe_size: int
    style: str                       # "loop" or "v"

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def rank_of(self, stage: int) -> int:
        """The pipe-axis process that holds ``stage``."""
        p = self.pipe_size
        if self.style == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]


def plan_stages(model: nn.Module, *, split_points: list[str] | None, num_stages: int | None,
                pipe_size: int, schedule: str, num_microbatches: int) -> StageLayout:
    """Validate the split of ``model`` for ``schedule`` and return its layout (same on every process)."""
    if not isinstance(model, nn.Sequential):
        raise InvalidArgumentError(
            f"PipelineStrategy splits an nn.Sequential created in its scope, but got a "
            f"{type(model).__name__}; write the model as nn.Sequential(embedding, *blocks, head) "
            f"(each child may be any module with one tensor in and one tensor out)")
    names = [name for name, _ in model.named_children()]
    _, style, per_rank = SCHEDULES[schedule]
    if split_points is not None:
        starts = []
        for point in split_points:
            if point not in names:
                raise InvalidArgumentError(
                    f"the split point {point!r} names no child of the model; split points name the "
                    f"children where a stage begins, among {names}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or 0 in starts:
            raise InvalidArgumentError(
                f"split points must name distinct children in model order, none of them the first "
                f"({names[0]!r}, where stage 0 always begins); got {split_points}")
        edges = [0, *starts, len(names)]
    else:
        count = num_stages if num_stages is not None else pipe_size * (per_rank or 2)
        if count > len(names):
            raise InvalidArgumentError(
                f"the pipeline needs {count} stages ({_why(num_stages, pipe_size, schedule)}), but the "
                f"model has only {len(names)} children to split; give a model with more layers, "
                f"fewer stages, or a schedule with one stage per process")
        size, extra = divmod(len(names), count)
        edges = [0]
        for s in range(count):
            edges.append(edges[-1] + size + (1 if s < extra else 0))
    bounds = tuple(zip(edges[:-1], edges[1:]))
    layout = StageLayout(bounds, pipe_size, style)
    stages = layout.num_stages
    if stages % pipe_size or (per_rank is not None and stages != per_rank * pipe_size):
        want = f"{per_rank * pipe_size}" if per_rank else f"a multiple of {pipe_size}"
        raise InvalidArgumentError(
            f"the {schedule!r} schedule on {pipe_size} pipeline processes needs {want} stages "
            f"({per_rank or 'the same number of'} per process), but the split gives {stages}; "
            f"change split_points / num_stages")
    if schedule in ("1f1b", "dualpipev") and num_microbatches < stages:
        raise InvalidArgumentError(
            f"the {schedule!r} schedule needs at least as many micro-batches as stages: "
            f"num_microbatches={num_microbatches} but {stages} stages; raise num_microbatches")
    rounds = max(1, num_microbatches // pipe_size)
    if schedule in ("interleaved", "interleaved_zero_bubble") and num_microbatches % rounds:
        raise InvalidArgumentError(
            f"the {schedule!r} schedule runs num_microbatches in rounds of {pipe_size} (the pipeline "
            f"processes): num_microbatches={num_microbatches} must be below {pipe_size} or a multiple "
            f"of {rounds}; e.g. {rounds * pipe_size}")
    return layout


def _why(num_stages: int | None, pipe_size: int, schedule: str) -> str:
    if num_stages is not None:
        return f"num_stages={num_stages}"
    return f"{SCHEDULES[schedule][2] or 2} per process for {schedule!r} on {pipe_size} processes"


@dataclasses.dataclass
class SplitModel:
    """One model created in scope, cut into stages; ``local`` are this process's stage modules."""

    layout: StageLayout
    local: dict[int, nn.Sequential]          # stage index -> its children (shared with the model)


class PipelinePlacement(Placement):
    """Stages of ``nn.Sequential`` models over the pipe axis; gradients summed over the data axis."""

    kind = "Pipeline"

    def __init__(self, strategy: Any, *, config: dict[str, Any], pipe_rank: int, pipe: Collective,
                 data: Collective, everyone: Collective, device: torch.device):
        self._strategy_ref = weakref.ref(strategy)
        self.config = config             # split_points, num_stages, pipe_size, schedule, num_microbatches
        self.pipe_rank = pipe_rank
        self.pipe = pipe                 # this process's pipeline (gathers the stages' state)
        self.data = data                 # this process's data-parallel peers (same stages)
        self.everyone = everyone         # every process (start-up agreement)
        self.device = device
        self._pending: list[nn.Module] = []
        self._placed: list[nn.Module] = []
        self.models: dict[int, SplitModel] = {}   # id(model) -> its split
        self._optimizers: list[torch.optim.Optimizer] = []

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    # ---------------------------------------------------------------- modules

    def on_module_registered(self, module: nn.Module) -> None:
        if not any(m is module for m in self._pending):
            self._pending.append(module)

    on_submodule_registered = on_module_registered

    def finalize(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        inside = {id(child) for m in pending for child in m.modules() if child is not m}
        inside.update(id(m) for root in self._placed for m in root.modules())
        roots = [m for m in pending if id(m) not in inside and any(True for _ in m.parameters())]
        if not roots:
            return
        for root in roots:
            root.to(self.device)
        self.everyone.agree_on_modules([m for root in roots for m in root.modules()])
        for root in roots:
            layout = plan_stages(root, **self.config)
            children = list(root.children())
            local = {s: nn.Sequential(*children[a:b]) for s, (a, b) in enumerate(layout.bounds)
                     if layout.rank_of(s) == self.pipe_rank}
            mine = {id(m) for stage in local.values() for m in stage.modules()}
            for child in children:
                if id(child) not in mine:
                    child.to("meta")     # another process holds it
            root.register_state_dict_post_hook(functools.partial(_whole_state, weakref.ref(self)))
            root.register_load_state_dict_pre_hook(_own_state)
            self.models[id(root)] = SplitModel(layout, local)
            self._placed.append(root)
        # the stage containers were created in scope, and so were the modules moved to meta: not new models
        self._pending = [m for m in self._pending if not any(m is stage for split in self.models.values()
                                                             for stage in split.local.values())]

    def split_of(self, model: Any) -> SplitModel:
        self.finalize()
        split = self.models.get(id(model))
        if split is None:
            raise InvalidArgumentError(
                f"forward_backward needs the nn.Sequential created in this PipelineStrategy's scope (the "
                f"one it split into stages), got a {type(model).__name__} it did not place; create the "
                f"model inside strategy.scope()")
        return split

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> Any:
        raise InvalidArgumentError(
            "sg.Checkpoint does not support PipelineStrategy yet; save model.state_dict() (the whole "
            "model, called on every process) with torch.save on the chief, and each process's "
            "optimizer.state_dict() (its own stages) in a file of its own")

    def read_checkpoint_state(self, obj: Any, skeleton: Any, directory: Any, name: str) -> Any:
        return self.write_checkpoint_state(obj, directory, name)

    # ----------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not p.is_meta]
        adopt(optimizer, self)
        self._optimizers.append(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        self.finalize()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.data.num_workers > 1:
            sum_over(self.data, params)
        pre, post = step_hooks(optimizer)
        run_hooks(pre, optimizer)
        result = unhooked_step(optimizer._sg_base)(optimizer, closure)
        run_hooks(post, optimizer)
        return result

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer._sg_base.zero_grad(optimizer, set_to_none)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer._sg_base.state_dict(optimizer)

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        optimizer._sg_base.load_state_dict(optimizer, state_dict)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        optimizer._sg_base.add_param_group(optimizer, {**param_group, "params": [p for p in params if not p.is_meta]})


def sum_over(axis: Collective, params: list[torch.Tensor]) -> None:
    """Sum the gradients of ``params`` over ``axis`` in place (zeros where a peer has none)."""
    group = axis.group
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    group.all_reduce(present, "optimizer.step (which gradients exist on the data axis)")
    for p, count in zip(params, present.tolist()):
        if count and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = group.all_reduce(torch.cat([g.reshape(-1) for g in same]), "optimizer.step (gradients over the data axis)")
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))


def _whole_state(placement_ref: Any, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Fill the entries of stages held elsewhere (meta here) with their values, gathered over the pipe axis."""
    placement = placement_ref()   # a weak reference: a deep copy of the model copies it as is
    keys = [k for k in state_dict if k.startswith(prefix)]
    if placement is None or placement.pipe.num_workers == 1:
        return
    pipe, device = placement.pipe, placement.device
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
