"""Placements: where a strategy's variables live and what its scope does to modules and optimizers.

Three folders, each answering one question:

- :mod:`~stratagem.placement.scope`: what a scope does while it is open -- the hooks that hand
  modules, optimizers and ``GradScaler`` s created there to the strategy's placement, the
  declared interface of a placement (:class:`~stratagem.placement.scope.base.Placement`), the
  checks of objects created outside every scope, clipping's routing, ``SyncBatchNorm``;
- :mod:`~stratagem.placement.layout`: where this process's tensors live -- a copy per local
  replica (the mirrored placement), a tensor-parallel plan, pipeline stages, FSDP2 units;
- :mod:`~stratagem.placement.data_axis`: what happens along the data axis -- every synchronous
  placement's second collaborator, its ``data_axis``: the gradient sync when backward ends, the
  step's order, and the update rules (mirrored, central storage, ZeRO, torch's own over the
  shards a process holds), the buffers averaged over the workers.

:mod:`~stratagem.placement.dtensor_state` is shared by the last two: the state of DTensor parameters
and their optimizers, whole outside, shards inside.

The parameter-server placement lives with the rest of parameter-server training, in
:mod:`stratagem.ps.placement`.
"""
