"""PipelinePlacement: a model created in scope, split into stages over a "pipe" axis.

Modules created in scope wait until ``finalize()``. Then every process checks that all
built the same modules and takes the chief's initial values (so that every process,
and every data-parallel group, starts alike), and the layout's first part,
:class:`~stratagem.placement.layout.stages.Stages`, cuts each model into stages over the pipe axis,
each process keeping only its own (an ``nn.Sequential`` at once; any other model by torch's tracer
at its first step).

On a 3-D mesh ``{"data": d, "pipe": p, "model": t}`` the layout's parts follow in mesh order, as
torchtitan composes PyTorch's engines on one ``DeviceMesh``, on this process's stages of an
``nn.Sequential`` (cut at placement):

1. :class:`~stratagem.placement.layout.tensor_parallel.TensorParallel`: the tensor-parallel plan
   (module names relative to the whole model, as ``TensorParallelStrategy`` takes them) is resolved
   over the whole model, the same on every process: an entry that names no module of any stage is
   refused; the entries that name modules of this process's stages go to torch's
   ``parallelize_module`` over the ``model`` axis (with ``t = 1`` the layers stay whole);
2. with ``sharding="parameters"``, :class:`~stratagem.placement.layout.fully_sharded.FullyShard`: each
   stage becomes FSDP2 ``fully_shard`` units over the ``data`` axis (each child holding parameters,
   containers looked through, then the stage itself, which torch's ``PipelineStage`` needs as the
   FSDP root): a parameter that the plan split is sharded over both axes (``data`` then ``model``).
   Gradients are summed, not averaged, over ``data`` (each data group's loss already carries its
   share of the batch).

Clipping (:meth:`~stratagem.placement.layout.roots.RootsPlacement.norm_axes`): every gradient part
counts toward the global norm on exactly one process of the whole mesh -- a part replicated along an
axis (a layer the plan left whole, along ``model``; a gradient summed over ``data`` before the step,
along ``data``) counts on that axis's rank 0 -- and the p-th powers are summed over every process.

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
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping
from stratagem.placement.layout.roots import RootsPlacement
from stratagem.placement.dtensor_state import replacing
from stratagem.placement.layout.fully_sharded import FullyShard
from stratagem.placement.layout.tensor_parallel import TensorParallel
from stratagem.placement.data_axis.pipeline_optimizers import StageOptimizers
from stratagem.placement.layout.stages import SplitModel, Stages


class PipelinePlacement(RootsPlacement):
    """Stages of ``nn.Sequential`` models over the pipe axis; gradients summed over the data axis."""

    kind = "Pipeline"
    checks_loss_scaling = False   # forward_backward weighs the micro-batches' mean losses itself
    gathering = "Checkpoint.save (the whole state, over the mesh)"

    def __init__(self, strategy: Any, *, config: dict[str, Any], pipe_rank: int, pipe: Collective,
                 data: Collective, everyone: Collective, device: torch.device, mesh: DeviceMesh,
                 plan: dict[str, Any] | None = None, sharding: str | None = None):
        self.pipe = pipe                 # this process's pipeline (gathers the stages' state)
        self.data = data                 # this process's data-parallel peers (same stages)
        self.everyone = everyone         # every process (start-up agreement)
        self.device = device
        self.mesh = mesh                 # (data, pipe, model)
        self.sharding = sharding         # ZeRO over the data axis: None, "optimizer", "gradients" or "parameters"
        # the data axis: each model's sum over it, no_sync, the step; its update rule the stages' optimizers
        self._start_roots(strategy, data, StageOptimizers(self, pipe=pipe, data=data, sharding=sharding))
        #: the layout's first part: the models cut into stages over the pipe axis, this process keeping its own
        self.stages = Stages(self, config, pipe_rank=pipe_rank, pipe=pipe, everyone=everyone, device=device,
                             gathered=self.gathered, sequential_only=plan is not None or sharding is not None)
        #: the layout's parts in mesh order: the stages over pipe, the plan's layers over model (a model axis of
        #: one keeps them whole), with sharding="parameters" FSDP2's units over data
        self.parts: tuple[Any, ...] = (self.stages, TensorParallel(plan, mesh["model"], alone=False))
        if sharding == "parameters":
            self.parts += (FullyShard(mesh["data"], "sharding='optimizer'"),)
        #: clipping: the parts over the whole mesh, each naming the axes that replicate a tensor, the data
        #: axis too (RootsPlacement.norm_axes)
        self.norm_group, self.norm_spans_data = everyone.group, True

    # ---------------------------------------------------------------- modules

    def finalize(self) -> None:
        for root in self.new_roots():
            local = self.stages.place(root)
            if local is not None:
                self._place_stages(root, local)

    def _place_stages(self, root: nn.Sequential, local: dict[int, nn.Sequential]) -> None:
        """This process's stages of ``root``, just cut: the layout parts after the stages place them."""
        self._forget_pending(local.values())   # the stage containers, created in scope
        _, split, *shard = self.parts
        mine = {id(m) for stage in local.values() for m in stage.modules()}
        (styles,) = split.resolve([root], f"no stage of the pipelined {type(root).__name__} has a module of "
                                          f"that name (names are relative to the whole model)", mine)
        with replacing(root, self._replaced):
            split.place(root, styles)
            for part in shard:   # (each stage itself a unit: torch's PipelineStage drives FSDP through it)
                part.place(list(local.values()), "this process's stages have")
        self._forget_pending([*local.values(), *root.modules()])   # (re-registered by the parts)

    def split_of(self, model: Any, batch: tuple[torch.Tensor, ...] | None = None) -> SplitModel:
        """The split of ``model``; given the step's ``batch``, a split that ``split_points="auto"`` still has
        to measure is measured on its first micro-batch and cut (every process at the same step)."""
        self.finalize()
        split = self.stages.split_of(model)
        if split.layout.balance is not None and batch is not None:
            local = self.stages.balance(model, split, batch)
            if local is not None:
                self._place_stages(model, local)
                split = self.stages.split_of(model)
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
    # (RootsPlacement's spread and gathers: a split model, or an optimizer over one; the chief's pipeline
    # gathers, every process under ZeRO)

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> Any:
        state = self.gathered.get(id(obj))
        if state is None and isinstance(obj, nn.Module) and \
                any(t.is_meta for t in obj.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)):
            raise InvalidArgumentError(
                f"{name!r} is part of a pipelined model whose other stages live on other processes; track the "
                f"whole model created in the PipelineStrategy's scope in sg.Checkpoint (one logical copy)")
        return None if state is None else (state, {})
