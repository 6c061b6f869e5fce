"""OneDeviceStrategy: everything on one device, inputs moved there."""

from __future__ import annotations

import torch

from stratagem.comm.cross_device_ops import HierarchicalCopyAllReduce
from stratagem.comm.replicas import ReplicaCollective
from stratagem.devices import Topology, parse_device
from stratagem.placement.layout.mirrored import MirroredPlacement
from stratagem.strategies.base import Strategy


class OneDeviceStrategy(Strategy):
    """Place every module created in scope, and every ``run``, on one device.

    Useful to switch code written for a distributed strategy to a single device
    without changing it. Configuration: one device, a one-replica collective, the
    mirrored placement (which, with one device, only moves tensors there), inline runs.

    Example::

        import torch, stratagem as sg
        strategy = sg.OneDeviceStrategy("cpu")      # or "cuda:0", "/gpu:0"
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
        print(strategy.run(model, args=(torch.ones(2, 3),)).shape)   # torch.Size([2, 1])
    """

    def __init__(self, device: "str | torch.device"):
        topology = Topology((parse_device(device),))
        collective = ReplicaCollective.create(topology.devices, HierarchicalCopyAllReduce())
        self._configure(topology, collective, MirroredPlacement(self, topology, collective))

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self.worker_devices[0]!r})"
