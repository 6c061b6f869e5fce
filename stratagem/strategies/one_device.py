"""OneDeviceStrategy: everything on one device, inputs moved there."""

from __future__ import annotations

import torch

from stratagem.devices import parse_device
from stratagem.strategies.local import LocalStrategy


class OneDeviceStrategy(LocalStrategy):
    """Place every module created in scope, and every ``run``, on one device.

    Useful to switch code written for a distributed strategy to a single device
    without changing it.

    Example::

        import torch, stratagem as sg
        strategy = sg.OneDeviceStrategy("cpu")      # or "cuda:0", "/gpu:0"
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
        print(strategy.run(model, args=(torch.ones(2, 3),)).shape)   # torch.Size([2, 1])
    """

    def __init__(self, device: "str | torch.device"):
        super().__init__((parse_device(device),))

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self.worker_devices[0]!r})"
