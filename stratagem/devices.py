"""Device names: PyTorch spellings, TensorFlow spellings, and logical CPU devices.

``"cpu:0"``, ``"cpu:1"``, … are *logical CPU devices*: distinct replicas that all
compute on the host CPU (TensorFlow's logical devices), so that multi-replica
code runs on a machine without accelerators.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

from stratagem.errors import InvalidDeviceError


@dataclass(frozen=True)
class Device:
    """A replica's device: a canonical name and the torch device that computes."""

    kind: str   # "cpu" or "cuda"
    index: int  # the logical index for CPU, the CUDA ordinal for CUDA

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class Topology:
    """Where a strategy's replicas are: this worker's devices and its place among the workers.

    Replica ids count over all workers: worker ``w``'s local replica ``i`` is replica
    ``w * len(devices) + i``.

    Example::

        from stratagem.devices import Device, Topology
        t = Topology((Device("cpu", 0), Device("cpu", 1)), num_workers=3, worker_index=1)
        assert (t.num_replicas_in_sync, t.first_replica_id) == (6, 2)
    """

    devices: tuple[Device, ...]
    num_workers: int = 1
    worker_index: int = 0

    @property
    def num_local_replicas(self) -> int:
        return len(self.devices)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers * len(self.devices)

    @property
    def first_replica_id(self) -> int:
        return self.worker_index * len(self.devices)

    @property
    def torch_devices(self) -> tuple[torch.device, ...]:
        return tuple(d.torch_device for d in self.devices)


_TF_FULL = re.compile(r"^(/job:[^/]+)?(/replica:\d+)?(/task:\d+)?/device:(?P<kind>[A-Za-z]+):(?P<index>\d+)$")
_SHORT = re.compile(r"^/?(device:)?(?P<kind>[A-Za-z]+)(:(?P<index>\d+))?$")
_KINDS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def available_devices() -> list[str]:
    names = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return names + ["cpu:N (logical CPU devices, any N >= 0)"]


def parse_device(spec: "str | torch.device | Device") -> Device:
    """Parse one device name into a :class:`Device`, checking that it exists.

    Example::

        from stratagem.devices import parse_device
        assert str(parse_device("/job:worker/replica:0/task:1/device:CPU:1")) == "cpu:1"
        assert str(parse_device("cpu")) == "cpu:0"
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, torch.device):
        kind, index = spec.type, spec.index
    elif isinstance(spec, str):
        text = spec.strip()
        match = _TF_FULL.match(text) or _SHORT.match(text)
        if match is None:
            raise InvalidDeviceError(
                f"cannot parse device {spec!r}: use a PyTorch name ('cuda:0', 'cpu:1'), a "
                f"TensorFlow name ('/gpu:0', 'GPU:0', '/job:worker/task:0/device:CPU:0') or a "
                f"torch.device; available: {', '.join(available_devices())}")
        kind = match.group("kind").lower()
        index = int(match.group("index")) if match.group("index") is not None else None
    else:
        raise InvalidDeviceError(
            f"a device must be a string or torch.device, got {type(spec).__name__} {spec!r}")
    if kind not in _KINDS:
        raise InvalidDeviceError(
            f"unknown device kind {kind!r} in {spec!r}; stratagem runs on CPU and CUDA devices. "
            f"Available: {', '.join(available_devices())}")
    kind = _KINDS[kind]
    index = 0 if index is None else index
    if kind == "cuda":
        count = torch.cuda.device_count()
        if index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count)) or "none (this machine has no CUDA device)"
            raise InvalidDeviceError(
                f"device {spec!r} is not available: visible CUDA devices are {have}. Use "
                f"logical CPU devices ('cpu:0', 'cpu:1', ...) to run several replicas without a GPU")
    return Device(kind, index)


def parse_devices(specs: Iterable["str | torch.device | Device"]) -> tuple[Device, ...]:
    """Parse a device list: non-empty, no duplicates, not mixing CPU and CUDA."""
    if isinstance(specs, (str, torch.device, Device)):
        specs = [specs]
    devices = tuple(parse_device(s) for s in specs)
    if not devices:
        raise InvalidDeviceError(
            "the device list is empty: give at least one device, e.g. devices=['cpu:0', 'cpu:1'], "
            "or devices=None to use every visible GPU (or one CPU)")
    seen: set[Device] = set()
    for device in devices:
        if device in seen:
            raise InvalidDeviceError(
                f"device {device} appears twice in {[str(d) for d in devices]}: each replica needs "
                f"its own device; use distinct logical CPU devices ('cpu:0', 'cpu:1') for several "
                f"CPU replicas")
        seen.add(device)
    if len({d.kind for d in devices}) > 1:
        raise InvalidDeviceError(
            f"devices {[str(d) for d in devices]} mix CPU and CUDA; replicas of one strategy must "
            f"all be CPU or all be CUDA devices")
    return devices


def default_devices() -> tuple[Device, ...]:
    count = torch.cuda.device_count()
    if count:
        return tuple(Device("cuda", i) for i in range(count))
    return (Device("cpu", 0),)
