"""A user's :class:`~stratagem.CrossDeviceOps` subclass, carrying the replicas' collectives.

TensorFlow lets a program pass its own ``CrossDeviceOps`` to ``MirroredStrategy``; so does
stratagem. :class:`PluginCollective` is the Collective that calls it:

- gradient sums (``optimizer.step()``) and replica-context all-reduces: after the
  replicas exchanged their tensors, local replica 0's thread calls
  ``ops.batch_reduce(op, [(PerReplica(components of tensor i), devices), ...])`` once
  and writes each result into the replicas' tensors, while the others wait;
- ``strategy.reduce``: ``ops.reduce(SUM, PerReplica(components), first device)``;
- replica-context ``broadcast``: ``ops.broadcast(source tensor, devices)`` per tensor.

The other collectives (all-gather, reduce-scatter, all-to-all, scatter, gather) move
tensors without reducing them, or reduce slices, and are carried as for the built-in ops.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.comm.cross_device_ops import CrossDeviceOps, result_components
from stratagem.comm.replicas import ReplicaCollective
from stratagem.values import PerReplica, ReduceOp


class PluginCollective(ReplicaCollective):
    """Replica threads of one process, reduced by a user's ``CrossDeviceOps``."""

    serves = CrossDeviceOps  # every subclass that is not exactly one of stratagem's own

    def _destinations(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.devices)

    def reduce_in_place(self, local_id, everyone, op, copy_back):
        if local_id != 0:  # the others wait at the "done" exchange
            return
        n = len(everyone)
        destinations = self._destinations()
        pairs = [(PerReplica([e[i] for e in everyone]), destinations) for i in range(len(everyone[0]))]
        with torch.no_grad():
            results = self.options.batch_reduce(op, pairs)
            if len(results) != len(pairs):
                raise ValueError(
                    f"{type(self.options).__name__}.batch_reduce returned {len(results)} results "
                    f"for {len(pairs)} (value, destinations) pairs; it must return one per pair")
            for i, result in enumerate(results):
                parts = result_components(result, n, "batch_reduce")
                for r in range(n) if copy_back else range(1):
                    if parts[r] is not everyone[r][i]:
                        everyone[r][i].copy_(parts[r])

    def broadcast(self, local_id: int, tensors: list[torch.Tensor], source: int) -> list[torch.Tensor]:
        everyone = self.exchange_all(local_id, tensors, "broadcast")
        copies = None
        if local_id == 0:
            with torch.no_grad():
                copies = [result_components(self.options.broadcast(t, self._destinations()), self.num_local,
                                            "broadcast") for t in everyone[source]]
        copies = self.sync.exchange(local_id, copies, "broadcast:result")[0]
        device = self.devices[local_id].torch_device
        return [c[local_id].to(device, copy=True) for c in copies]  # each replica owns its result

    def local_sum(self, components: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(components) == 1:
            return components[0].clone()
        with torch.no_grad():
            result = self.options.reduce(ReduceOp.SUM, PerReplica(list(components)), str(self.devices[0]))
        return result_components(result, 1, "reduce")[0]
