"""Tensor parallelism and ZeRO-3 inside the stages of a pipeline: the model and data axes of a 3-D mesh.

A ``PipelineStrategy`` whose mesh is ``{"data": d, "pipe": p, "model": t}`` cuts its model into
stages over ``pipe`` (:mod:`stratagem.placement.layout.pipeline`); :class:`MeshStages` then places each
of this process's stages on the other two axes, as torchtitan composes PyTorch's engines on one
``DeviceMesh``:

1. the tensor-parallel plan (module names relative to the whole model, as
   ``TensorParallelStrategy`` takes them) is resolved over the whole model, the same on every
   process: an entry that names no module of any stage is refused; the entries that name
   modules of this process's stages go to torch's ``parallelize_module`` over the ``model``
   axis (with ``t = 1`` the layers stay whole);
2. with ``sharding="parameters"``, each stage becomes FSDP2 ``fully_shard`` units over the
   ``data`` axis (each child holding parameters, containers looked through, then the stage
   itself, which torch's ``PipelineStage`` needs as the FSDP root): a parameter that the plan
   split is sharded over both axes (``data`` then ``model``). Gradients are summed, not
   averaged, over ``data`` (each data group's loss already carries its share of the batch).

Clipping (:meth:`MeshStages.norm_axes`): every gradient part counts toward the global norm on
exactly one process of the whole mesh -- a part replicated along an axis (a layer the plan left
whole, along ``model``; a gradient summed over ``data`` before the step, along ``data``) counts
on that axis's rank 0 -- and the p-th powers are summed over every process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from stratagem.placement.dtensor_state import replacing
from stratagem.placement.layout.fully_sharded import FullyShard
from stratagem.placement.layout.tensor_parallel import TensorParallel


class MeshStages:
    """A pipelined model's stages placed on the ``model`` and ``data`` axes of a 3-D mesh: the layout
    parts :class:`~stratagem.placement.layout.tensor_parallel.TensorParallel`, then (``sharding="parameters"``)
    :class:`~stratagem.placement.layout.fully_sharded.FullyShard`, composed in mesh order."""

    def __init__(self, mesh: DeviceMesh, plan: dict[str, Any] | None, sharding: str | None):
        self.mesh = mesh
        self.plan = plan               # checked by check_plan, or None
        self.sharding = sharding       # None, "optimizer", "gradients" or "parameters"
        #: the layout parts after the stages, in mesh order (a model axis of one keeps the layers whole)
        self.split = TensorParallel(plan, mesh["model"], alone=False)
        self.shard = FullyShard(mesh["data"], "sharding='optimizer'") if sharding == "parameters" else None

    @property
    def needs_sequential(self) -> bool:
        """Whether the model must be an nn.Sequential (cut at placement): a plan, or ZeRO over data."""
        return self.plan is not None or self.sharding is not None

    def place(self, root: nn.Module, local: dict[int, nn.Sequential]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Split this process's stages of ``root`` by the plan and shard them over data; returns
        id(parameter replaced) -> (it, its replacement)."""
        mine = {id(m) for stage in local.values() for m in stage.modules()}
        (styles,) = self.split.resolve([root], f"no stage of the pipelined {type(root).__name__} has a module of "
                                               f"that name (names are relative to the whole model)", mine)
        replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with replacing(root, replaced):
            self.split.place(root, styles)
            if self.shard is not None:   # (each stage itself a unit: torch's PipelineStage drives FSDP through it)
                self.shard.place(list(local.values()), "this process's stages have")
        return replaced

    def norm_axes(self) -> dict[str, int]:
        """The axes along which this process's stages hold a plain tensor the same everywhere (a layer
        the plan left whole, along ``model``; a gradient summed over ``data``), with its rank along
        each: clipping counts a part on rank 0 of each (a DTensor's placements say so for its own mesh)."""
        return {**self.split.norm_axes(), "data": self.mesh.get_local_rank("data")}
