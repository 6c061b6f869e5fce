"""MirroredStrategy: synchronous data parallelism over the devices of one process.

Configuration: the local devices; a :class:`~stratagem.comm.replicas.ReplicaCollective`
carrying the chosen cross-device op; a :class:`~stratagem.placement.layout.mirrored.MirroredPlacement`;
replica threads (inline with one device).
"""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.comm.cross_device_ops import CrossDeviceOps, check_cross_device_ops
from stratagem.comm.replicas import ReplicaCollective
from stratagem.devices import Topology, default_devices, parse_devices
from stratagem.placement.layout.mirrored import MirroredPlacement
from stratagem.strategies.base import Strategy


class MirroredStrategy(Strategy):
    """One replica per device; every parameter mirrored; gradients summed every step.

    ``devices=None`` takes every visible CUDA device, else one CPU device. Logical
    CPU devices (``"cpu:0"``, ``"cpu:1"``) give several replicas on a CPU-only host.
    ``cross_device_ops`` picks how replicas combine values (default:
    :class:`~stratagem.NcclAllReduce` between GPUs, else
    :class:`~stratagem.HierarchicalCopyAllReduce`).

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        print(strategy.num_replicas_in_sync)     # 2
    """

    def __init__(self, devices: Sequence["str | torch.device"] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None):
        topology = Topology(default_devices() if devices is None else parse_devices(devices))
        collective = ReplicaCollective.create(topology.devices,
                                              check_cross_device_ops(cross_device_ops, topology.devices))
        self._configure(topology, collective, MirroredPlacement(self, topology, collective))

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(self.worker_devices)})"
