"""PipelinePlacement: a model created in scope, split into stages over a "pipe" axis.

Modules created in scope wait until ``finalize()``. Then every process checks that all
built the same modules and takes the chief's initial values (so that every process,
and every data-parallel group, starts alike), and each root ``nn.Sequential`` is cut
into stages (:class:`~stratagem.placement.layout.pipeline_plan.StageLayout`: at the split points, or evenly). A stage lives on
one process of the pipe axis: stage ``s`` on ``s % p`` ("loop" placement, also for the
interleaved schedules) or, for the V schedules, stages ``r`` and ``2p - 1 - r`` on
process ``r``. The children of the stages another process holds move to the ``meta``
device: this process keeps only its own stages' parameters and buffers. Any other model
is cut by torch's tracer at its first step (:mod:`stratagem.placement.layout.pipeline_trace`),
and its tensors of the stages held elsewhere become ``meta`` then (:meth:`keep_only`).

On a 3-D mesh (a ``model`` axis, or ``sharding=`` over the data axis), each process's stages
are then split by the tensor-parallel plan and sharded over data
(:class:`~stratagem.placement.layout.pipeline_mesh.MeshStages`): an ``nn.Sequential`` only.

Gradients: when ``forward_backward`` returns, each process's ``.grad`` holds the global batch's
gradient of its stages' parameters (shards), as ``backward()`` does under the data-parallel
strategies. The schedule's micro-batches accumulate this process's own part; when the schedule
ends, :meth:`PipelinePlacement.summing_gradients` sums it over the data axis, once per
``forward_backward`` (:class:`~stratagem.placement.data_axis.gradient_sync.GradientSync`, which keeps the
accumulation over several calls exact; ``strategy.no_sync()`` or DDP's
``require_backward_grad_sync = False`` skip the sum, the next call outside sums everything).
Under ``sharding="gradients"`` the gradients are reduce-scattered into each data rank's range
instead and ``.grad`` is None; under ``"parameters"`` FSDP2 sums them during the backward.

Optimizers created in scope update only this process's parameters
(:mod:`stratagem.placement.data_axis.pipeline_optimizers`): their parameter groups still list every
parameter of the model, those of other stages as meta placeholders; ``clip_grad_norm_`` clips
by the norm of the whole model's gradients.

State: a split model's ``state_dict()`` and its optimizer's read as the whole logical
model on every process (the pipe axis gathers the stages: a collective, so every process
calls them); ``load_state_dict`` takes the whole state and keeps this process's stages (and shards).
``sg.Checkpoint`` writes that logical copy (global rank 0; ``prepare_checkpoint`` gathers
it on the chief's pipeline, on every process under ZeRO), restorable into any layout, or a
plain model.
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
from stratagem.placement.scope import clipping
from stratagem.placement.layout.roots import RootsPlacement
from stratagem.placement.scope.hooks import placement_of
from stratagem.placement.layout.pipeline_balance import balance_layout
from stratagem.placement.layout.pipeline_mesh import MeshStages
from stratagem.placement.data_axis.pipeline_optimizers import StageOptimizers
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


class PipelinePlacement(RootsPlacement):
    """Stages of ``nn.Sequential`` models over the pipe axis; gradients summed over the data axis."""

    kind = "Pipeline"
    checks_loss_scaling = False   # forward_backward weighs the micro-batches' mean losses itself
    gathering = "Checkpoint.save (the whole state, over the mesh)"

    def __init__(self, strategy: Any, *, config: dict[str, Any], pipe_rank: int, pipe: Collective,
                 data: Collective, everyone: Collective, device: torch.device, mesh: MeshStages | None = None):
        self._strategy_ref = weakref.ref(strategy)
        self.config = config             # split_points, num_stages, pipe_size, schedule, num_microbatches
        self.pipe_rank = pipe_rank
        self.pipe = pipe                 # this process's pipeline (gathers the stages' state)
        self.data = data                 # this process's data-parallel peers (same stages)
        self.everyone = everyone         # every process (start-up agreement)
        self.device = device
        self.mesh = mesh                 # the model axis (tensor parallelism) and ZeRO over data, if any
        self.sharding = None if mesh is None else mesh.sharding
        # the data axis: each model's sum over it, no_sync, the step; its update rule the stages' optimizers
        self._start_roots(data, StageOptimizers(self, pipe=pipe, data=data, sharding=self.sharding,
                                                  on_mesh=mesh is not None))
        self.models: dict[int, SplitModel] = {}   # id(model) -> its split
        self._hooks: dict[int, list[int]] = {}     # id(traced model) -> its forward pre-hooks set here
        clipping.register(self)

    @property
    def strategy(self) -> Any:
        return self._strategy_ref()

    # ---------------------------------------------------------------- modules

    def finalize(self) -> None:
        for root in self.new_roots():
            layout = plan_stages(root, **self.config)
            root.register_state_dict_post_hook(functools.partial(_whole_state, weakref.ref(self)))
            root.register_load_state_dict_pre_hook(_own_state)
            if not isinstance(root, nn.Sequential):   # traced at the first step, when the inputs are known
                if self.mesh is not None and self.mesh.needs_sequential:
                    raise InvalidArgumentError(
                        f"a tensor-parallel plan or sharding= inside a PipelineStrategy's stages needs the model "
                        f"as an nn.Sequential (cut when it is placed), but got a {type(root).__name__} that "
                        f"the tracer would cut at its first step; write it as nn.Sequential(embedding, *blocks, "
                        f"head), or drop plan= / sharding=")
                stages = layout.stages_of(self.pipe_rank)
                self.models[id(root)] = SplitModel(layout, {}, TracedStages(
                    root, list(layout.points), num_stages=layout.num_stages, stages=stages, placement=self), root)
            elif layout.balance is not None:   # split_points="auto": cut once measured, at the first step
                self.models[id(root)] = SplitModel(layout, {}, model=root, waiting=layout.stages_of(self.pipe_rank))
            else:
                self._cut(root, layout)

    def _cut(self, root: nn.Sequential, layout: StageLayout, *, late: bool = False) -> None:
        """Cut an ``nn.Sequential`` into stages: the children of the stages held elsewhere become meta
        (``late``: after its optimizers were created, which then get meta placeholders too)."""
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
        self._forget_pending(local.values())   # the stage containers, created in scope
        if self.mesh is not None:
            self._replaced.update(self.mesh.place(root, local))
            self._forget_pending([*local.values(), *root.modules()])   # (re-registered by the mesh)

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
        for ref in self.update.refs:
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
        """While the tracer copies and runs ``model``: without this placement's forward hooks, and
        the modules it creates (in a scope) are no new models."""
        hidden = {i: model._forward_pre_hooks.pop(i) for i in self._hooks.get(id(model), [])
                  if i in model._forward_pre_hooks}
        pending = list(self._pending)
        try:
            yield
        finally:
            model._forward_pre_hooks.update(hidden)
            self._pending = pending

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

    def split_of(self, model: Any, batch: tuple[torch.Tensor, ...] | None = None) -> SplitModel:
        """The split of ``model``; given the step's ``batch``, a split that ``split_points="auto"`` still has
        to measure is measured on its first micro-batch and cut (every process at the same step)."""
        self.finalize()
        split = self.models.get(id(model))
        if split is None:
            raise InvalidArgumentError(
                f"forward_backward and predict need the model created in this PipelineStrategy's "
                f"scope (the one it split into stages), got a {type(model).__name__} it did not place; "
                f"create the model inside strategy.scope()")
        if split.layout.balance is not None and batch is not None:
            rows = -(-batch[0].shape[0] // self.config["num_microbatches"])
            layout = balance_layout(model, split.layout, tuple(x[:rows] for x in batch), placement=self)
            if split.traced is not None:
                split.layout, split.traced.points = layout, list(layout.points)
            else:
                self._cut(model, layout, late=True)
                split = self.models[id(model)]
        return split

    # -------------------------------------------------------------- gradients

    @contextlib.contextmanager
    def summing_gradients(self, model: nn.Module) -> Iterator[None]:
        """Around a step's schedule for ``model`` (every process): what its micro-batches accumulate
        is summed over the data axis when it ends (ZeRO-2: reduce-scattered into the ranges), unless
        in ``no_sync``; a sum from an earlier call of the step is set aside and added back."""
        if self.data.num_workers == 1 or self.sharding == "parameters":   # (FSDP2 sums in backward)
            yield
            return
        own = [p for p in model.parameters() if not p.is_meta]
        zeros = self.update.reduce_scattered(own)
        scattered = {id(p) for zero in zeros for _, _, p in zero.entries}
        params = [p for p in own if id(p) not in scattered]
        sync = self.data_axis.model_sync(id(model))
        sync.update(tuple(id(p) for p in params), [params], hooked=False)
        with sync.accumulating():
            yield
        if zeros and self.data_axis.requires_sync():
            for zero in zeros:
                zero.reduce()

    def gradient_buffers(self, model: nn.Module) -> list[torch.Tensor]:
        """What this process keeps of ``model``'s gradients besides ``.grad`` (for memory counts): the
        data axis's packs of sums (``.grad`` views them after a step), ZeRO-2's range of the sum."""
        sync = self.data_axis.syncs.get(id(model))
        zeros = self.update.reduce_scattered([p for p in model.parameters() if not p.is_meta])
        return (sync.buffers() if sync is not None else []) + [z.summed[0] for z in zeros if z.summed is not None]

    # ----------------------------------------------------------- optimizers
    # (the data axis's, with stratagem.placement.data_axis.pipeline_optimizers as its update rule; the
    # modules are placed before each call needs them)

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        self._take_replacements(optimizer)   # (the mesh's, for parameters taken before the model was placed)
        self.update.created(optimizer, self)

    def gradient_parts(self, params: list[torch.Tensor]) -> clipping.GradientParts:
        self.finalize()
        return super().gradient_parts(params)

    def norm_axes(self) -> tuple[Any, dict[str, int]]:
        """Clipping: the stages' parts summed over the pipe axis (a data group's gradients are its
        peers'), or over the whole mesh with the axes that replicate a part (:class:`MeshStages`)."""
        if self.mesh is None:
            return self.pipe.group, {}
        return self.everyone.group, self.mesh.norm_axes()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        gathered = self.gathered.get(id(optimizer))   # gathered already for the checkpoint being written
        if gathered is not None:
            return gathered
        self.finalize()
        return self.update.state_dict(optimizer)

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self.finalize()
        self.update.load_state_dict(optimizer, state_dict)

    # ---------------------------------------------------------- checkpoints

    def spread(self, obj: Any) -> bool:
        """A split model, or an optimizer over one (their state dicts gather the stages and shards)."""
        return id(obj) in self.models or (isinstance(obj, torch.optim.Optimizer) and placement_of(obj) is self)

    def gathers(self) -> bool:
        """The chief's pipeline gathers (the other data groups hold the same values); under ZeRO every
        process (collectives over data too)."""
        return self.data.worker_index == 0 or self.sharding is not None

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> Any:
        state = self.gathered.get(id(obj))
        if state is None and isinstance(obj, nn.Module) and \
                any(t.is_meta for t in obj.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)):
            raise InvalidArgumentError(
                f"{name!r} is part of a pipelined model whose other stages live on other processes; track the "
                f"whole model created in the PipelineStrategy's scope in sg.Checkpoint (one logical copy)")
        return None if state is None else (state, {})


def _whole_state(placement_ref: Any, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Fill the entries of stages held elsewhere (meta here) with their values, gathered over the pipe axis."""
    placement = placement_ref()   # a weak reference: a deep copy of the model copies it as is
    keys = [k for k in state_dict if k.startswith(prefix)]
    if placement is None or placement.pipe.num_workers == 1 or \
            any(isinstance(state_dict[k], nn.Parameter) for k in keys):   # keep_vars: the tensors themselves
        return
    gathered = placement.gathered.get(id(module))
    if gathered is not None:   # gathered already for the checkpoint being written
        state_dict.update(gathered)
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


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _not_whole(stages: list[int], module: nn.Module, args: Any) -> None:
    raise InvalidArgumentError(
        f"this process holds only stage(s) {stages} of the pipelined model (the others live on other "
        f"processes), so the model cannot be called directly: train it with "
        f"strategy.forward_backward(model, x, y), evaluate it with strategy.predict(model, x)")
