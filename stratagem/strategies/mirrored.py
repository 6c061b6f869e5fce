"""MirroredStrategy: synchronous data parallelism over the devices of one process."""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.comm.cross_device_ops import CrossDeviceOps
from stratagem.devices import default_devices, parse_devices
from stratagem.strategies.local import LocalStrategy


class MirroredStrategy(LocalStrategy):
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
        chosen = default_devices() if devices is None else parse_devices(devices)
        super().__init__(chosen, cross_device_ops)

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(self.worker_devices)})"
