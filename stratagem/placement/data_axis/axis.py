"""The data axis: a synchronous placement's second collaborator.

A synchronous placement answers two questions. Where this process's tensors live -- a copy per
local replica, a tensor-parallel plan, pipeline stages, FSDP2 units -- is its layout (the
placement classes of :mod:`stratagem.placement.layout`). What happens along the data axis is one
:class:`DataAxis`, the same class under every synchronous strategy:

- ``collective``: whom the gradients are summed over (the replica threads and the workers; a
  mesh's data axis, :class:`AxisCollective`);
- ``gradients``: the gradient sync that sums them when backward ends (:mod:`.gradient_sync`;
  None with nothing to sum, or where FSDP2 or a pipeline's schedule sums them), and
  ``syncs``, one more per pipelined model (:meth:`DataAxis.model_sync`);
- ``no_sync()`` and DistributedDataParallel's ``require_backward_grad_sync`` (:meth:`DataAxis.requires_sync`);
- ``buffers``: the floating buffers averaged over the workers at each step (:mod:`.buffers`);
- ``update``: the update rule (mirrored, central storage, ZeRO 1/2 over whatever group the axis
  is, torch's own over the shards a process holds: :mod:`.update_rule`, :mod:`.local_update`);
- ``step``: the one order of an optimizer step (:mod:`.step`), and the optimizer's other methods,
  handed to the rule;
- ``gradient_parts``: what clipping measures where no process holds a whole gradient, one rule
  for every layout (which names the norm's group and the axes that replicate its tensors) and
  update rule (whose ZeRO-2 ranges are pieces too).

The placement (:class:`~stratagem.placement.scope.base.Placement`) hands its optimizer methods and
``no_sync`` to its ``data_axis``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from stratagem.comm.collective import Collective
from stratagem.values import is_dtensor
from stratagem.placement.data_axis.gradient_sync import GradientSync
from stratagem.placement.scope import clipping
from stratagem.placement.data_axis.step import synchronous_step


class DataAxis:
    """A synchronous placement's data axis: the gradient sync, the one step, the update rule.

    Example::

        import torch
        from stratagem.placement.scope.hooks import adopt
        from stratagem.placement.data_axis.axis import DataAxis
        from stratagem.placement.data_axis.local_update import LocalUpdate

        class OneProcess:   # a layout of one process, nothing to place
            kind = "Local"
            def __init__(self):
                self.data_axis = DataAxis(self, None, LocalUpdate(self))
                self.optimizer_step = self.data_axis.step
            def finalize(self): pass
            def own_replica_context(self): return None
            def record_updates(self): return []
            def synced_models(self): return []

        p = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([p], lr=0.5)
        adopt(optimizer, OneProcess())
        p.grad = torch.ones(2)
        optimizer.step()
        assert p.tolist() == [0.5, 0.5] and type(optimizer).__name__ == "LocalSGD"
    """

    def __init__(self, placement: Any, collective: Any, update: Any, *, num_replicas: int = 1):
        # its replica context, the copies it watches (the step), and its models, whose DDP attribute
        # require_backward_grad_sync counts (held as the gradient hooks on the models hold this axis)
        self.placement = placement
        self.collective = collective
        self.update = update             # the update rule
        self.num_replicas = num_replicas  # this process's replicas
        #: sums the gradients when backward ends (None: nothing to sum, or summed elsewhere)
        self.gradients: GradientSync | None = None
        #: one more sum per pipelined model, over the same axis (:meth:`model_sync`)
        self.syncs: dict[int, GradientSync] = {}
        #: averages the floating buffers over the workers at each step (None: nothing to average)
        self.buffers: Any = None
        self._unsynced = 0   # inside no_sync(), where no gradient sync holds the flag per replica

    #: one logical step (placement/data_axis/step.py): the placement's ``optimizer_step``
    step = synchronous_step

    def own_replica_context(self) -> Any:
        return self.placement.own_replica_context()

    def record_updates(self) -> list[str]:
        return self.placement.record_updates()

    # -------------------------------------------------------------- gradients

    def model_sync(self, key: int) -> GradientSync:
        """The gradient sync of one pipelined model (``key``) over a mesh's data axis of several
        processes (the caller sums nothing over one): made at first use."""
        sync = self.syncs.get(key)
        if sync is None:
            sync = AxisCollective.gradient_sync(self, self.collective)
            if sync is None:
                raise AssertionError("a data axis of one process has no gradient sync")
            self.syncs[key] = sync
        return sync

    def requires_sync(self) -> bool:
        """False inside :meth:`no_sync` (where no gradient sync keeps it per replica), or while a user set
        DistributedDataParallel's ``require_backward_grad_sync = False`` on a model created in scope
        (nanoGPT's accumulation idiom)."""
        return not self._unsynced and all(m.__dict__.get("require_backward_grad_sync", True)
                                          for m in self.placement.synced_models())

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``strategy.no_sync()``: backward passes inside skip the exchange (on this replica's thread)."""
        if self.gradients is None:
            return self._counted_no_sync()
        ctx = self.own_replica_context()
        return self.gradients.no_sync(None if ctx is None else ctx.local_replica_id)

    @contextlib.contextmanager
    def _counted_no_sync(self) -> Iterator[None]:
        self._unsynced += 1
        try:
            yield
        finally:
            self._unsynced -= 1

    # -------------------------------------------------------------- clipping

    def gradient_parts(self, params: list[torch.Tensor]) -> clipping.GradientParts:
        """Clipping's parts of the whole gradients of ``params`` (:mod:`~stratagem.placement.scope.clipping`),
        one rule under every layout and update rule: the pieces of this process's range of the sum
        where the update rule keeps one (ZeRO-2: ``reduce_scattered``; its own along the data axis),
        else the local part of each ``.grad``; each counts on rank 0 of every axis that replicates
        it. The layout names the norm's group and its replicating axes (``norm_axes``)."""
        group, axes = self.placement.norm_axes()
        own = {k: rank for k, rank in axes.items() if k != "data"}   # a range is this data rank's own
        params = [p for p in params if not p.is_meta]   # (a pipeline's stages held elsewhere)
        tensors, counted, held = [], [], set()
        for ranges in self.update.reduce_scattered(params):
            for param, piece in ranges.pieces([p for p in params if id(p) not in held]):
                tensors.append(piece)
                if clipping.counts_here(param, own):
                    counted.append(piece)
            held.update(id(p) for p in ranges.params)
        for p in params:
            grad = p.grad
            if grad is None or id(p) in held:
                continue
            local = grad.to_local() if is_dtensor(grad) else grad
            tensors.append(local)
            if clipping.counts_here(grad, axes):
                counted.append(local)
        return clipping.GradientParts(tensors, counted, group)

    # ---------------------------------------------------- the optimizer's other methods

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if self.syncs:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for sync in self.syncs.values():
                sync.forget(params)
        self.update.zero_grad(optimizer, set_to_none)

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.update.state_dict(optimizer)

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self.update.load_state_dict(optimizer, state_dict)

    def add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        self.update.add_param_group(optimizer, param_group)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return self.update.state_bytes(optimizer)


class AxisCollective:
    """A mesh's data axis as the collective of a
    :class:`~stratagem.placement.data_axis.gradient_sync.GradientSync`: one replica per process, whose
    gradients (a DTensor gradient's local shard) are summed over the axis in packs that leave
    while backward still runs (:mod:`stratagem.comm.gradients`, as across the workers of
    ``MultiWorkerMirroredStrategy``), finished when it ends. So under tensor and pipeline
    parallelism, too, ``.grad`` holds the global batch's gradient when ``backward()``
    (``forward_backward``) returns, and ``optimizer.step()`` sums nothing.

    Example::

        import torch
        from stratagem.placement.data_axis.axis import AxisCollective

        class Alone:   # a data axis of one process: nothing to sum
            num_workers = 1

        axis = AxisCollective(Alone())
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.full((2,), 3.0)
        axis.sum_over_workers([p])
        assert p.grad.tolist() == [3.0, 3.0] and not axis.overlaps_backward
        assert AxisCollective.gradient_sync(object(), Alone()) is None
    """

    num_local = 1

    def __init__(self, axis: Collective):
        self.axis = axis
        self.num_workers = axis.num_workers

    @classmethod
    def gradient_sync(cls, data_axis: Any, axis: Collective) -> GradientSync | None:
        """The gradient sync of ``data_axis`` (its ``requires_sync``) over the mesh's ``axis`` (None: an
        axis of one process, nothing to sum)."""
        if axis.num_workers == 1:
            return None
        sync = GradientSync(data_axis, cls(axis))
        sync.in_run = True   # every backward here is this process's one replica's: its packs leave early
        return sync

    @property
    def overlaps_backward(self) -> bool:
        return self.num_workers > 1

    def gradient_packs(self, params: list[torch.Tensor]) -> Any:
        return self.axis.gradient_packs(params) if self.num_workers > 1 else None

    def sum_gradients(self, local_id: int, params: list[torch.Tensor]) -> None:
        self.sum_over_workers(params)

    def sum_over_workers(self, params: list[torch.Tensor]) -> None:
        packs = self.gradient_packs(params)
        if packs is not None:
            packs.finish()
