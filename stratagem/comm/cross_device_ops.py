"""How the replicas of one process combine tensors (TensorFlow's cross-device ops).

These are configuration objects: a strategy turns the one it is given into the
:class:`~stratagem.comm.replicas.ReplicaCollective` that does the work (see there
for how each one sums). All give bit-identical results on CPU.

- :class:`HierarchicalCopyAllReduce` — every replica thread reduces a range of the
  flattened tensors for everyone. The default on CPU.
- :class:`ReductionToOneDevice` — one thread reduces on one device, then copies back.
- :class:`NcclAllReduce` — ``torch.cuda.nccl`` over the replicas' GPUs; the default
  between several GPUs.
- :class:`RingAllReduce` — the bandwidth-optimal ring: a reduce-scatter then an
  all-gather, ``N - 1`` neighbour steps each, over one chunk per replica. Sums in ring
  order, so with 3 or more replicas its floating-point results differ from the others'
  in the last bits (within rounding); bit-identical with 1 or 2 replicas and for integers.

**The plug-in point.** Any other subclass of :class:`CrossDeviceOps` (one that is not
exactly one of the classes above) is a user's implementation: the strategy calls its
``batch_reduce`` to sum gradients and to all-reduce in replica context, its ``reduce``
in ``strategy.reduce``, and its ``broadcast`` for replica-context broadcasts. The base
class gives reference implementations of all three (sum in replica order), so a
subclass overrides only what it changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stratagem.devices import Device, parse_device
from stratagem.errors import InvalidArgumentError
from stratagem.values import DistributedValues, PerReplica, ReduceOp

#: What ``destinations`` may be: one device, several (one result component each), or a
#: distributed value (the result is placed like its components).
Destinations = Any


class CrossDeviceOps:
    """Base class of the cross-device ops, and TensorFlow's plug-in point.

    ``reduce``, ``batch_reduce`` and ``broadcast`` have the signatures of
    ``tf.distribute.CrossDeviceOps``; the implementations here are the reference (a sum
    in replica order on the destination's device, MEAN dividing once). A subclass that is
    not one of stratagem's own ops is *used* by ``MirroredStrategy(cross_device_ops=...)``:
    ``batch_reduce`` for gradient sums and replica-context all-reduces, ``reduce`` for
    ``strategy.reduce``, ``broadcast`` for replica-context broadcasts. A result may be one
    tensor (copied to each destination) or one tensor per destination (a PerReplica, list
    or tuple).

    ``destinations`` is a device string, a tuple of device strings, or a distributed
    value whose components' devices are the destinations.

    Example::

        import torch, stratagem as sg

        class Counting(sg.CrossDeviceOps):
            calls = 0
            def batch_reduce(self, reduce_op, value_destination_pairs):
                Counting.calls += 1
                return super().batch_reduce(reduce_op, value_destination_pairs)

        s = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Counting())
        total = s.run(lambda: sg.get_replica_context().all_reduce("sum", 1.0))
        print(s.experimental_local_results(total))   # (2.0, 2.0)
        assert Counting.calls == 1
    """

    def validate(self, devices: Sequence[Device]) -> None:
        """Raise a clear error if this op cannot serve these devices."""

    def reduce(self, reduce_op: "ReduceOp | str", per_replica_value: Any, destinations: Destinations) -> Any:
        """Reduce the components of ``per_replica_value`` to ``destinations``."""
        op = ReduceOp.from_any(reduce_op)
        components = [torch.as_tensor(c) for c in _components(per_replica_value)]
        targets = destination_devices(destinations, components)
        total = components[0].to(targets[0], copy=True)
        for c in components[1:]:
            total.add_(c.to(total.device))
        if op is ReduceOp.MEAN:
            total = total / len(components) if total.is_floating_point() or total.is_complex() \
                else total.to(torch.get_default_dtype()) / len(components)
        return self.broadcast(total, destinations) if len(targets) > 1 else total

    def batch_reduce(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple[Any, Destinations]]
                     ) -> list[Any]:
        """``reduce`` of each ``(per_replica_value, destinations)`` pair, in order."""
        return [self.reduce(reduce_op, value, destinations) for value, destinations in value_destination_pairs]

    def broadcast(self, tensor: torch.Tensor, destinations: Destinations) -> Any:
        """A copy of ``tensor`` on each destination (one tensor for one destination)."""
        targets = destination_devices(destinations, [tensor])
        copies = [tensor.to(d, copy=True) for d in targets]
        return copies[0] if len(copies) == 1 else PerReplica(copies)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _components(value: Any) -> list[Any]:
    if isinstance(value, DistributedValues):
        return list(value.values)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def destination_devices(destinations: Destinations, like: Sequence[torch.Tensor]) -> list[torch.device]:
    """The torch devices that ``destinations`` names (see :class:`CrossDeviceOps`)."""
    if destinations is None:
        return [like[0].device]
    if isinstance(destinations, DistributedValues):
        return [torch.as_tensor(c).device for c in destinations.values]
    if isinstance(destinations, (str, torch.device, Device)):
        destinations = (destinations,)
    return [d.torch_device if isinstance(d, Device) else parse_device(d).torch_device for d in destinations]


def result_components(result: Any, count: int, what: str) -> list[torch.Tensor]:
    """A plug-in's result as ``count`` tensors (one tensor stands for every destination)."""
    parts = _components(result)
    if len(parts) == 1:
        parts = parts * count
    if len(parts) != count or not all(isinstance(p, torch.Tensor) for p in parts):
        raise InvalidArgumentError(
            f"the cross_device_ops' {what} must return one tensor, or one tensor per destination "
            f"({count}), got {type(result).__name__} with {len(_components(result))} components")
    return parts


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


class RingAllReduce(CrossDeviceOps):
    """The bandwidth-optimal ring among the replicas of one process.

    Every tensor list is cut into one chunk per replica. In ``N - 1`` steps each
    replica adds its left neighbour's partial sum of one chunk into its own (a
    reduce-scatter: replica ``r`` ends holding the full sum of chunk ``r + 1``), then in
    ``N - 1`` more steps each copies the finished chunk its neighbour holds (an
    all-gather). Each replica moves ``2 (N - 1) / N`` of the data, whatever ``N``. The
    sums run in ring order, so with 3 or more replicas floating-point results differ
    from the other ops' in the last bits; with 1 or 2 replicas (and for integers)
    they are identical.

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=sg.RingAllReduce())
        total = s.run(lambda: sg.get_replica_context().all_reduce("sum", torch.ones(5)))
        print(s.experimental_local_results(total)[0])   # tensor([3., 3., 3., 3., 3.])
    """


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
            f"cross_device_ops must be sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice(), "
            f"sg.NcclAllReduce(), sg.RingAllReduce() or a subclass of sg.CrossDeviceOps, got {value!r}")
    value.validate(devices)
    return value
