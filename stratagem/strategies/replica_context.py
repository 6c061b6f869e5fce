"""ReplicaContext: what a replica's function sees, and the collectives among replicas.

Each collective validates its input here and hands over to one method of the
strategy's :class:`~stratagem.comm.collective.Collective`, so gradients and user
values are reduced the same way, whichever implementation carries them.

merge_call protocol (states per call):

1. every replica deposits ``(fn, args, kwargs)`` and waits (barrier 1);
2. replica 0's thread regroups the arguments into PerReplica values and runs
   ``fn(strategy, *args, **kwargs)`` in cross-replica context; the others wait;
3. replica 0 deposits the outcome (value or exception) and all meet (barrier 2);
4. every replica returns the result (its own component where the result is
   distributed). If ``fn`` raised, replica 0 raises it and the others stop with
   ``ReplicaAborted``, so ``run`` reports the error once. A replica that raised
   before reaching merge_call aborts the exchange: no replica is left waiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from stratagem import _context
from stratagem.comm import autograd
from stratagem.comm.collective import check_axis
from stratagem.comm.sync import ReplicaAborted
from stratagem.devices import Device
from stratagem.errors import InvalidArgumentError
from stratagem.values import DistributedValues, ReduceOp, flatten, pack_as, regroup, select_replica

if TYPE_CHECKING:  # pragma: no cover
    from stratagem.comm.collective import Collective


class ReplicaContext:
    """A replica's view of the strategy while its function runs inside ``strategy.run``.

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"])

        def fn():
            ctx = sg.get_replica_context()
            mine = torch.tensor([float(ctx.replica_id_in_sync_group)])
            return ctx.all_reduce("sum", mine), ctx.all_gather(mine, axis=0)

        total, gathered = s.run(fn)
        print(s.experimental_local_results(total))   # (tensor([1.]), tensor([1.]))
    """

    def __init__(self, strategy: Any, local_id: int, device: Device, collective: "Collective"):
        self._strategy = strategy
        self._replica_id = collective.replica_id(local_id)
        self._local_id = local_id
        self._device_spec = device
        self._device = device.torch_device
        self._collective = collective
        #: Rows of the global batch this step's inputs were cut from, when the inputs are a
        #: distributed batch (set by the strategy's runner for each ``run``); else None.
        self.global_batch_size: int | None = None

    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        return (str(self._device_spec),)

    @property
    def device(self) -> Device:
        """This replica's device."""
        return self._device_spec

    @property
    def local_replica_id(self) -> int:
        """This replica's index among this process's replicas."""
        return self._local_id

    def _exchange(self, value: Any, tag: str) -> list[Any]:
        return self._collective.exchange(self._local_id, value, tag)

    def _as_tensors(self, value: Any) -> tuple[list[torch.Tensor], list[bool]]:
        leaves = flatten(value)
        tensors, was_number = [], []
        for leaf in leaves:
            if isinstance(leaf, DistributedValues):
                raise InvalidArgumentError(
                    "a replica function received a distributed value inside a collective; pass "
                    "this replica's own tensors (strategy.run already unwraps its arguments)")
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
                was_number.append(False)
                continue
            try:
                tensor = torch.as_tensor(leaf, device=self._device)
            except (TypeError, ValueError, RuntimeError) as error:
                raise InvalidArgumentError(
                    f"collectives combine tensors and numbers, got a {type(leaf).__name__} leaf; "
                    f"pass tensors, numbers, or nested tuples/lists/dicts of them") from error
            tensors.append(tensor)
            was_number.append(tensor.dim() == 0)  # numbers come back as numbers, arrays as tensors
        return tensors, was_number

    # ------------------------------------------------------------ collectives

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any) -> Any:
        """Reduce ``value`` (a tensor, number or nested structure) over all replicas.

        Every replica gets the result on its own device; numbers come back as numbers.
        A MEAN of integers is a float, as in ``strategy.reduce`` (never truncated).
        Differentiable: the gradient is the same all-reduce of the output gradients.
        """
        op = ReduceOp.from_any(reduce_op)
        tensors, was_number = self._as_tensors(value)
        if op is ReduceOp.MEAN:
            tensors = [t if t.is_floating_point() or t.is_complex() else t.to(torch.get_default_dtype())
                       for t in tensors]
        tensors = [t.contiguous() for t in tensors]  # ops reduce flat ranges (e.g. of a transposed view)
        if self._differentiable(tensors, "all_reduce"):
            reduced = autograd.AllReduce.apply(self._collective, self._local_id, op, self._anchor(tensors), *tensors)
        else:
            reduced = self._collective.all_reduce(self._local_id, tensors, op)
        out = [t.item() if number else t for t, number in zip(reduced, was_number)]
        return pack_as(value, out)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's ``value`` along ``axis``, in replica order.

        The tensors may differ in length along ``axis`` (nothing else). Differentiable:
        each replica's gradient is its own slice of the summed output gradients.
        """
        tensors, _ = self._as_tensors(value)
        if self._differentiable(tensors, "all_gather"):
            return pack_as(value, autograd.AllGather.apply(self._collective, self._local_id, axis, self._anchor(tensors),
                                                                 *tensors))
        return pack_as(value, self._collective.all_gather(self._local_id, tensors, axis))

    def broadcast(self, value: Any, source_replica: int = 0) -> Any:
        """Every replica gets ``source_replica``'s value (copied to its own device).

        What the other replicas pass is ignored. Differentiable: the source's gradient
        is the sum of every replica's output gradient; the others' is zero.
        """
        self._check_replica(source_replica, "source_replica")
        tensors, _ = self._as_tensors(value)
        if self._differentiable(tensors, "broadcast"):
            return pack_as(value, autograd.Broadcast.apply(self._collective, self._local_id, source_replica,
                                                           self._anchor(tensors), *tensors))
        return pack_as(value, self._collective.broadcast(self._local_id, tensors, source_replica))

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, destination_replica: int = 0) -> Any:
        """Like ``all_reduce``, but only ``destination_replica`` gets the result; others get None.

        Not differentiable (use ``all_reduce`` inside a loss).
        """
        self._check_replica(destination_replica, "destination_replica")
        self._refuse_grad(value, "reduce", "all_reduce")
        op = ReduceOp.from_any(reduce_op)
        tensors, was_number = self._as_tensors(value)
        tensors = [t.contiguous() if op is ReduceOp.SUM or t.is_floating_point() or t.is_complex()
                   else t.to(torch.get_default_dtype()) for t in tensors]  # a MEAN is never truncated
        reduced = self._collective.reduce(self._local_id, tensors, op, destination_replica)
        if reduced is None:
            return None
        return pack_as(value, [t.item() if number else t for t, number in zip(reduced, was_number)])

    def reduce_scatter(self, reduce_op: "ReduceOp | str", value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Reduce over replicas, then keep this replica's slice along ``axis``.

        Slices are contiguous; when the length does not divide evenly, earlier
        replicas take one extra row (the input splitting rule). Differentiable: the
        gradient is the all-gather of the output gradients.
        """
        op = ReduceOp.from_any(reduce_op)
        tensors, _ = self._as_tensors(value)
        tensor = tensors[0]
        if op is ReduceOp.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.get_default_dtype())
        if self._collective.num_workers == 1:  # (across workers: after every worker said what it passes)
            check_axis(tensor, axis, "reduce_scatter")
        if self._differentiable([tensor], "reduce_scatter"):
            return autograd.ReduceScatter.apply(self._collective, self._local_id, op, axis, None,
                                                self._anchor([tensor]), tensor.contiguous())
        return self._collective.reduce_scatter(self._local_id, tensor.contiguous(), op, axis)

    def all_to_all(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Replica ``i`` sends ``values[j]`` to replica ``j``; returns what each replica sent here.

        The tensors may have any shapes. Differentiable: the gradients travel back the
        other way.
        """
        if len(values) != self.num_replicas_in_sync and self._collective.num_workers == 1:
            raise InvalidArgumentError(
                f"all_to_all needs one tensor per replica ({self.num_replicas_in_sync}), got {len(values)}")
        tensors, _ = self._as_tensors(list(values))
        if self._differentiable(tensors, "all_to_all"):
            return list(autograd.AllToAll.apply(self._collective, self._local_id, self._anchor(tensors), *tensors))
        return self._collective.all_to_all(self._local_id, tensors)

    def scatter(self, values: Sequence[torch.Tensor] | None, source_replica: int = 0) -> torch.Tensor:
        """``source_replica`` gives one tensor per replica; each replica gets its own (not differentiable)."""
        self._check_replica(source_replica, "source_replica")
        self._refuse_grad(values, "scatter", "all_to_all")
        if self._replica_id == source_replica:
            if (values is None or len(values) != self.num_replicas_in_sync) and self._collective.num_workers == 1:
                raise InvalidArgumentError(
                    f"the source replica of scatter must pass one tensor per replica "
                    f"({self.num_replicas_in_sync})")
            tensors, _ = self._as_tensors(list(values or []))
        else:
            tensors = []
        return self._collective.scatter(self._local_id, tensors, source_replica)

    def gather(self, value: torch.Tensor, axis: int = 0, destination_replica: int = 0) -> torch.Tensor | None:
        """Concatenation of every replica's value on ``destination_replica``; None elsewhere.

        Not differentiable (use ``all_gather`` inside a loss).
        """
        self._check_replica(destination_replica, "destination_replica")
        self._refuse_grad(value, "gather", "all_gather")
        tensors, _ = self._as_tensors(value)
        gathered = self._collective.gather(self._local_id, tensors, axis, destination_replica)
        return None if gathered is None else pack_as(value, gathered)

    # ------------------------------------------------------------ merge_call

    def merge_call(self, merge_fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Pause every replica and run ``merge_fn(strategy, *args, **kwargs)`` once.

        ``merge_fn`` runs in cross-replica context; arguments that differ between
        replicas arrive as PerReplica values. Its result is returned to every replica
        (each replica's own component where the result is distributed).
        """
        kwargs = {} if kwargs is None else kwargs
        strategy = self._strategy
        everyone = self._exchange((tuple(args), kwargs), "merge_call")
        if self._local_id == 0:
            merged_args, merged_kwargs = regroup(everyone, strategy)
            _context.push(strategy, None)
            try:
                outcome = (True, merge_fn(strategy, *merged_args, **merged_kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to every replica below
                outcome = (False, error)
            finally:
                _context.pop()
        else:
            outcome = None
        ok, result = self._exchange(outcome, "merge_call:result")[0]
        if not ok:
            if self._local_id == 0:
                raise result
            raise ReplicaAborted()
        return select_replica(self._local_id, result)

    def _differentiable(self, tensors: list[torch.Tensor], name: str) -> bool:
        """Whether to record the collective for autograd (grad mode on, an input requires grad).

        Every replica must decide alike (each backward is a collective): with several local
        replicas they agree here (any input that requires grad makes every replica record
        it); across workers each decides alone, so every worker must pass inputs that
        require grad, or none (the message before the collective says which; every worker
        refuses a mismatch).
        """
        if not torch.is_grad_enabled() or not any(t.is_floating_point() or t.is_complex() for t in tensors):
            return False  # (integers never require grad: a count costs no extra meeting)
        wanted = any(t.requires_grad for t in tensors)
        if self._collective.num_local > 1:
            wanted = any(self._exchange(wanted, f"{name} (gradient check)"))
        return wanted

    @staticmethod
    def _anchor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """A leaf that makes the outputs require grad when another replica's inputs do and ours don't."""
        return None if any(t.requires_grad for t in tensors) else torch.zeros((), requires_grad=True)

    @staticmethod
    def _refuse_grad(value: Any, name: str, instead: str) -> None:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flatten(value)):
            raise InvalidArgumentError(
                f"{name} is not differentiable (the replicas that receive nothing could not take part "
                f"in the backward), but its input requires grad; use {instead} inside a loss, or pass "
                f"value.detach()")

    def _check_replica(self, replica: int, name: str) -> None:
        if not isinstance(replica, int) or not 0 <= replica < self.num_replicas_in_sync:
            raise InvalidArgumentError(
                f"{name} must be a replica id in [0, {self.num_replicas_in_sync}), got {replica!r}")

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class CrossReplicaCollectives:
    """The collectives (all_reduce, all_gather, broadcast, ...) on PerReplica values, from cross-replica context.

    Each method runs the replica-side collective through ``strategy.run``, so results
    are identical to calling it inside a replica function.

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        v = s.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor([1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1))
        print(s.collectives.all_reduce("sum", v))    # each replica: tensor([3., 6.])
    """

    def __init__(self, strategy: Any):
        self._strategy = strategy

    def _each(self, method: str, *args: Any, **kwargs: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            return getattr(_context.get_replica_context(), method)(*a, **kw)
        return self._strategy.run(call, args=args, kwargs=kwargs)

    def all_reduce(self, reduce_op, value):
        return self._each("all_reduce", reduce_op, value)

    def all_gather(self, value, axis):
        return self._each("all_gather", value, axis)

    def broadcast(self, value, source_replica=0):
        return self._each("broadcast", value, source_replica=source_replica)

    def reduce(self, reduce_op, value, destination_replica=0):
        return self._each("reduce", reduce_op, value, destination_replica=destination_replica)

    def reduce_scatter(self, reduce_op, value, axis=0):
        return self._each("reduce_scatter", reduce_op, value, axis=axis)

    def all_to_all(self, values):
        return self._each("all_to_all", values)

    def scatter(self, values, source_replica=0):
        return self._each("scatter", values, source_replica=source_replica)

    def gather(self, value, axis=0, destination_replica=0):
        return self._each("gather", value, axis=axis, destination_replica=destination_replica)
