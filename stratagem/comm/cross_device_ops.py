"""How the replicas of one process combine tensors (TensorFlow's cross-device ops).

These are configuration objects: a strategy turns the one it is given into the
:class:`~stratagem.comm.replicas.ReplicaCollective` that does the work (see there
for how each one sums). All give bit-identical results on CPU.

- :class:`HierarchicalCopyAllReduce` — every replica thread reduces a range of the
  flattened tensors for everyone. The default on CPU.
- :class:`ReductionToOneDevice` — one thread reduces on one device, then copies back.
- :class:`NcclAllReduce` — ``torch.cuda.nccl`` over the replicas' GPUs; the default
  between several GPUs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stratagem.devices import Device, parse_device
from stratagem.errors import InvalidArgumentError


class CrossDeviceOps:
    """Base class of the cross-device op configurations."""

    def validate(self, devices: Sequence[Device]) -> None:
        """Raise a clear error if this op cannot serve these devices."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_num_packs(num_packs: int) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
        raise InvalidArgumentError(f"num_packs must be a positive integer, got {num_packs!r}")
    return num_packs


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, reduce there, copy the result back.

    ``reduce_to_device`` defaults to the first replica's device.

    Example::

        import stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.ReductionToOneDevice())
    """

    def __init__(self, reduce_to_device: "str | torch.device | None" = None):
        self.reduce_to_device = None if reduce_to_device is None else parse_device(reduce_to_device)

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device and str(self.reduce_to_device)!r})"


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Each replica reduces one contiguous range of all tensors for everyone.

    The concatenation of every tensor is cut into ``num_packs`` packs of equal size,
    and each pack into one range per replica; the thread of replica ``r`` sums its
    ranges over all replicas (into replica 0's tensor, in replica order) and copies
    the sums to the other replicas. All threads work at once and no temporary buffer
    is allocated. More packs interleave the replicas' ranges more finely.

    Example::

        import stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.HierarchicalCopyAllReduce())
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _check_num_packs(num_packs)

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce over the replicas' GPUs with NCCL (``torch.cuda.nccl``).

    Tensors of one dtype are fused into ``num_packs`` flat buffers, one NCCL call
    each. CUDA devices only: on CPU devices the strategy raises a clear error.

    Example::

        import stratagem as sg
        # on a machine with 2 GPUs:
        # s = sg.MirroredStrategy(["cuda:0", "cuda:1"], cross_device_ops=sg.NcclAllReduce())
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _check_num_packs(num_packs)

    def validate(self, devices: Sequence[Device]) -> None:
        if any(not d.is_cuda for d in devices):
            raise InvalidArgumentError(
                f"NcclAllReduce needs CUDA devices, but the replicas are on "
                f"{[str(d) for d in devices]}; on CPU use sg.HierarchicalCopyAllReduce() "
                f"(the default) or sg.ReductionToOneDevice()")
        if len(devices) > 1 and not torch.cuda.nccl.is_available(
                [torch.empty(1, device=d.torch_device) for d in devices]):
            raise InvalidArgumentError("NCCL is not available for these CUDA devices; use "
                                       "sg.HierarchicalCopyAllReduce() instead")

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"


def default_cross_device_ops(devices: Sequence[Device]) -> CrossDeviceOps:
    """NCCL between several GPUs where it works, else the parallel hierarchical copy."""
    if len(devices) > 1 and all(d.is_cuda for d in devices):
        try:
            op = NcclAllReduce()
            op.validate(devices)
            return op
        except InvalidArgumentError:
            pass
    return HierarchicalCopyAllReduce()


def check_cross_device_ops(value: object, devices: Sequence[Device]) -> CrossDeviceOps:
    """The op a strategy was given (validated), or the default for ``devices``."""
    if value is None:
        return default_cross_device_ops(devices)
    if not isinstance(value, CrossDeviceOps):
        raise InvalidArgumentError(
            f"cross_device_ops must be sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice() "
            f"or sg.NcclAllReduce(), got {value!r}")
    value.validate(devices)
    return value
