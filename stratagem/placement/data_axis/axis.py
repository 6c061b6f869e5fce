"""A mesh's data axis as the collective of the gradient sync.

The placements that take whole models (tensor parallel, pipeline:
:class:`~stratagem.placement.layout.roots.RootsPlacement`) keep one replica per process and sum
its gradients over the mesh's data axis with a
:class:`~stratagem.placement.data_axis.gradient_sync.GradientSync` whose collective is
:class:`DataAxis`, as the mirrored placement sums over its workers with the strategy's collective.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.comm.collective import Collective
from stratagem.placement.data_axis.gradient_sync import GradientSync


class DataAxis:
    """A mesh's data axis as the collective of a
    :class:`~stratagem.placement.data_axis.gradient_sync.GradientSync`: one replica per process, whose
    gradients (a DTensor gradient's local shard) are summed over the axis in packs that leave
    while backward still runs (:mod:`stratagem.comm.gradients`, as across the workers of
    ``MultiWorkerMirroredStrategy``), finished when it ends. So under tensor and pipeline
    parallelism, too, ``.grad`` holds the global batch's gradient when ``backward()``
    (``forward_backward``) returns, and ``optimizer.step()`` sums nothing.

    Example::

        import torch
        from stratagem.placement.data_axis.axis import DataAxis

        class Alone:   # a data axis of one process: nothing to sum
            num_workers = 1

        axis = DataAxis(Alone())
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.full((2,), 3.0)
        axis.sum_over_workers([p])
        assert p.grad.tolist() == [3.0, 3.0] and not axis.overlaps_backward
        assert DataAxis.gradient_sync(object(), Alone()) is None
    """

    num_local = 1

    def __init__(self, axis: Collective):
        self.axis = axis
        self.num_workers = axis.num_workers

    @classmethod
    def gradient_sync(cls, placement: Any, axis: Collective) -> GradientSync | None:
        """The gradient sync of ``placement`` over ``axis`` (None: an axis of one process, nothing to sum)."""
        if axis.num_workers == 1:
            return None
        sync = GradientSync(placement, cls(axis))
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
