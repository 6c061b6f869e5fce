"""CentralStorageStrategy: synchronous training whose variables live once, on one device.

Configuration: the compute devices; a :class:`~stratagem.comm.replicas.ReplicaCollective`
with the default cross-device op for them (it carries the replicas' exchanges and the
collectives of ``sg.get_replica_context()``); a
:class:`~stratagem.placement.layout.mirrored.MirroredPlacement` whose update rule is
:class:`~stratagem.placement.data_axis.central.CentralUpdate` on the parameter device; replica threads
(inline with one compute device).
"""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.comm.cross_device_ops import default_cross_device_ops
from stratagem.comm.replicas import ReplicaCollective
from stratagem.devices import Device, Topology, default_devices, parse_device, parse_devices
from stratagem.placement.data_axis.central import CentralUpdate
from stratagem.placement.layout.mirrored import MirroredPlacement
from stratagem.strategies.base import Strategy


class CentralStorageStrategy(Strategy):
    """Parameters and optimizer state once on the parameter device; computation on every compute device.

    Each step, every compute replica computes with the current parameters (a copy on its
    device, or the parameters themselves where the devices share memory), the replicas'
    gradients are summed onto the parameter device, and the optimizer applies the update
    there once. Results are those of plain PyTorch on the global batch, like
    ``MirroredStrategy``; what differs is where the memory goes: the optimizer state (and,
    between steps, the parameters' one logical copy) exists once, not once per GPU.

    ``compute_devices=None`` takes every visible GPU, else one CPU device.
    ``parameter_device=None`` takes the CPU, or the one compute device when there is
    only one (then this is ``OneDeviceStrategy``). Logical CPU devices
    (``"cpu:0"``, ``"cpu:1"``) give several replicas on a CPU-only host; their copies
    share the parameters' memory.

    Example::

        import torch, stratagem as sg
        strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.Adam(model.parameters())
        print(strategy.num_replicas_in_sync, strategy.parameter_device)     # 2 cpu
    """

    def __init__(self, compute_devices: Sequence["str | torch.device"] | None = None,
                 parameter_device: "str | torch.device | None" = None):
        devices = default_devices() if compute_devices is None else parse_devices(compute_devices)
        if parameter_device is not None:
            home = parse_device(parameter_device)
        else:
            home = devices[0] if len(devices) == 1 else Device("cpu", 0)
        topology = Topology(devices)
        collective = ReplicaCollective.create(devices, default_cross_device_ops(devices))
        self._parameter_device = home
        placement = MirroredPlacement(self, topology, collective, update=CentralUpdate(home))
        self._configure(topology, collective, placement)

    @property
    def parameter_device(self) -> str:
        """Where parameters and optimizer state live (``"cpu"`` or ``"cuda:N"``)."""
        return str(self._parameter_device.torch_device)

    def __repr__(self) -> str:
        return (f"CentralStorageStrategy(compute_devices={list(self.worker_devices)}, "
                f"parameter_device={self.parameter_device!r})")
