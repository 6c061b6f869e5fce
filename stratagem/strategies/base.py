"""The :class:`Strategy` base class: the public API every strategy shares.

A public method validates its input and hands over to one hook that subclasses
implement. The hooks:

- ``_run_replicas(fn, per_replica_args)`` — call ``fn`` once per local replica.
- ``_placement`` — a :class:`~stratagem.strategies.mirroring.Placement` that decides
  what happens to modules and optimizers created in scope.
- ``_cross_worker_sum(tensor)`` — add a tensor over workers (identity in one process).
- ``_cross_worker_gather(tensor, axis)`` — concatenate over workers in worker order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from stratagem import _context
from stratagem.devices import Device
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.values import (DistributedValues, PerReplica, ReduceOp, flatten, map_structure,
                              pack_as, regroup)


class Strategy:
    """A way of distributing computation: one API for every topology.

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = strategy.experimental_distribute_dataset([(torch.randn(8, 4), torch.randn(8, 1))])

        def step(batch):
            x, y = batch
            loss = sg.nn.compute_average_loss(((model(x) - y) ** 2).squeeze(1))
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            return loss.detach()

        for batch in data:
            print(strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None))
    """

    _is_default = False

    def __init__(self, devices: Sequence[Device]):
        self._devices = tuple(devices)
        self._scope_depth = _ScopeDepth()

    # -------------------------------------------------------------- topology

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, over all workers."""
        return self._num_workers * len(self._devices)

    @property
    def extended(self) -> "Strategy":
        """TensorFlow keeps advanced methods on ``strategy.extended``; here they are on the strategy."""
        return self

    @property
    def _num_workers(self) -> int:
        return 1

    @property
    def _worker_index(self) -> int:
        return 0

    @property
    def _num_local_replicas(self) -> int:
        return len(self._devices)

    @property
    def _first_replica_id(self) -> int:
        return self._worker_index * self._num_local_replicas

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This process's replica devices, in replica order."""
        return tuple(str(d) for d in self._devices)

    # ----------------------------------------------------------------- scope

    def scope(self) -> contextlib.AbstractContextManager["Strategy"]:
        """Enter this strategy's scope: modules and optimizers created inside are distributed.

        Re-entering the same strategy is fine; entering a different strategy's scope
        inside this one is an error.
        """
        return self._scope()

    @contextlib.contextmanager
    def _scope(self) -> Iterator["Strategy"]:
        frame = _context.current_frame()
        if frame is not None and frame.strategy is not self:
            raise ContextError(
                f"cannot enter the scope of {self!r} while the scope of {frame.strategy!r} is "
                f"active on this thread: mixing strategies is not supported. Leave the first "
                f"scope, or create everything under one strategy")
        replica_context = frame.replica_context if frame is not None else None
        _context.push(self, replica_context)
        self._scope_depth.value += 1
        try:
            yield self
        finally:
            self._scope_depth.value -= 1
            _context.pop()
            if self._scope_depth.value == 0:
                self._placement.finalize()

    def _enter_cross_replica(self, method: str) -> contextlib.AbstractContextManager:
        """Enter the scope for a cross-replica method, refusing replica context."""
        frame = _context.current_frame()
        if frame is not None and frame.replica_context is not None:
            raise ContextError(
                f"strategy.{method}() must be called in cross-replica context (outside "
                f"strategy.run), but it was called inside a replica function. Inside run use "
                f"sg.get_replica_context().all_reduce(...) / all_gather(...) instead")
        return self.scope()

    # ------------------------------------------------------------------- run

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` once per local replica, in replica context.

        Distributed values among the arguments (at any depth) are replaced by each
        replica's component; a module created in scope computes with that replica's
        copy of its parameters. Returns a :class:`PerReplica` per leaf of the result
        (the value itself with one local replica). An exception raised in a replica
        is re-raised here with the replica named in a note.
        """
        if not callable(fn):
            raise InvalidArgumentError(f"strategy.run needs a callable, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise InvalidArgumentError(
                f"args must be a tuple or list of positional arguments, got {type(args).__name__}; "
                f"write args=(x,) for a single argument")
        kwargs = {} if kwargs is None else kwargs
        with self._enter_cross_replica("run"):
            self._check_owned((args, kwargs), "run")
            self._placement.before_run()
            per_replica_args = [self._select_replica(i, (tuple(args), kwargs))
                                for i in range(self._num_local_replicas)]
            batch_size = _global_batch_size_of((args, kwargs))
            results = self._run_replicas(fn, per_replica_args, batch_size)
            self._placement.after_run()
        if self._num_local_replicas == 1:
            return results[0]
        return regroup(results, self)

    def _select_replica(self, local_id: int, structure: Any) -> Any:
        copies = self._placement.replica_copy
        def pick(leaf: Any) -> Any:
            if isinstance(leaf, DistributedValues):
                return leaf._values[local_id]
            if isinstance(leaf, torch.Tensor):
                return copies(leaf, local_id)
            return leaf
        return map_structure(pick, structure)

    def _run_replicas(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        raise NotImplementedError

    # ---------------------------------------------------- cross-replica API

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, axis: int | None = None) -> Any:
        """Reduce a (nested) value over all replicas of all workers.

        A value that is not distributed counts as the same on every replica. With
        ``axis``, each component is also reduced along that dimension; MEAN then
        weighs every element equally, also when components differ in length.

        Example::

            import torch, stratagem as sg
            s = sg.MirroredStrategy(["cpu:0", "cpu:1"])
            v = s.experimental_distribute_values_from_function(
                lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1))
            assert s.reduce("sum", 1.0, axis=None).item() == 2.0
            assert s.reduce("mean", v, axis=0).item() == 1.0
        """
        op = ReduceOp.from_any(reduce_op)
        if axis is not None and not isinstance(axis, int):
            raise InvalidArgumentError(f"axis must be an int or None, got {axis!r}")
        with self._enter_cross_replica("reduce"):
            self._check_owned(value, "reduce")
            return map_structure(lambda leaf: self._reduce_leaf(op, leaf, axis), value)

    def _result_device(self, value: Any) -> torch.device | None:
        """Where reduce/gather put their result: the first local replica's device."""
        return self._devices[0].torch_device

    def _local_tensors(self, leaf: Any) -> tuple[list[torch.Tensor], torch.device | None]:
        components = self.experimental_local_results(leaf)
        target = self._result_device(components[0])
        try:
            tensors = [torch.as_tensor(c, device=target) for c in components]
        except (TypeError, ValueError, RuntimeError) as error:
            raise InvalidArgumentError(
                f"reduce and gather combine tensors and numbers, but got a "
                f"{type(components[0]).__name__} leaf; leave such values out of the structure "
                f"you reduce or gather") from error
        if not isinstance(leaf, DistributedValues):
            tensors = tensors * self._num_local_replicas
        return tensors, target

    def _reduce_leaf(self, op: ReduceOp, leaf: Any, axis: int | None) -> torch.Tensor:
        components, target = self._local_tensors(leaf)
        if axis is None:
            total = components[0].clone() if len(components) == 1 else _ordered_sum(components)
            count = self.num_replicas_in_sync
        else:
            for c in components:
                if c.dim() == 0 or not -c.dim() <= axis < c.dim():
                    raise InvalidArgumentError(
                        f"cannot reduce along axis {axis} a component of shape {tuple(c.shape)}; "
                        f"use axis=None for scalars")
            total = _ordered_sum([c.sum(dim=axis) for c in components])
            count = sum(c.shape[axis] for c in components)
            if self._num_workers > 1:
                count = int(self._cross_worker_sum(torch.tensor(count, device=target)).item())
        total = self._cross_worker_sum(total)
        if op is ReduceOp.MEAN:
            if not (total.is_floating_point() or total.is_complex()):
                total = total.to(torch.get_default_dtype())
            total = total / count if count else torch.full_like(total, float("nan"))
        return total

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the components of every replica (all workers) along ``axis``."""
        if not isinstance(axis, int):
            raise InvalidArgumentError(f"gather needs an integer axis, got {axis!r}")
        with self._enter_cross_replica("gather"):
            self._check_owned(value, "gather")
            return map_structure(lambda leaf: self._gather_leaf(leaf, axis), value)

    def _gather_leaf(self, leaf: Any, axis: int) -> torch.Tensor:
        components, _ = self._local_tensors(leaf)
        for c in components:
            if c.dim() == 0:
                raise InvalidArgumentError(
                    "gather concatenates along an axis, so components need at least one "
                    "dimension; got a scalar. Use reduce(...) for scalars, or x.reshape(1)")
        local = torch.cat(components, dim=axis)
        return self._cross_worker_gather(local, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this process's replicas (a 1-tuple for a plain value).

        For a parameter or buffer of a module created in scope, the per-replica copies.
        """
        if isinstance(value, DistributedValues):
            self._check_owned(value, "experimental_local_results")
            return value._values
        if isinstance(value, torch.Tensor):
            self._placement.finalize()  # a module created in a scope that is still open
            copies = self._placement.all_copies(value)
            if copies is not None:
                return copies
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """Call ``value_fn(sg.ValueContext)`` once per local replica; return a PerReplica."""
        from stratagem.data.input import ValueContext

        if not callable(value_fn):
            raise InvalidArgumentError("value_fn must be callable: value_fn(ctx) -> value")
        values = [value_fn(ValueContext(self._first_replica_id + i, self.num_replicas_in_sync))
                  for i in range(self._num_local_replicas)]
        return PerReplica(values, self)

    def experimental_distribute_dataset(self, dataset: Iterable, options: Any = None) -> Any:
        """Distribute an iterable of *global* batches: each replica gets its slice (SPEC §5)."""
        from stratagem.data.input import DistributedDataset

        with self._enter_cross_replica("experimental_distribute_dataset"):
            return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Call ``dataset_fn(sg.InputContext)`` per worker; it returns per-replica batches."""
        from stratagem.data.input import DistributedDatasetsFromFunction

        with self._enter_cross_replica("distribute_datasets_from_function"):
            return DistributedDatasetsFromFunction(self, dataset_fn, options)

    @property
    def collectives(self) -> "Any":
        """Collectives of §12 applied to PerReplica values from cross-replica context."""
        from stratagem.strategies.replica_context import CrossReplicaCollectives

        return CrossReplicaCollectives(self)

    # --------------------------------------------------------------- hooks

    def _cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _broadcast_from_chief(self, value: Any) -> Any:
        """The chief's ``value`` on every worker (a picklable object)."""
        return value

    def _on_modules_placed(self, modules: list) -> None:
        """Modules created in scope were just placed (multi-worker: check and broadcast)."""

    def _cross_worker_gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return tensor

    def _check_owned(self, structure: Any, method: str) -> None:
        for leaf in flatten(structure):
            if isinstance(leaf, DistributedValues):
                if leaf._strategy is not None and leaf._strategy is not self:
                    raise InvalidArgumentError(
                        f"strategy.{method}() got a {type(leaf).__name__} produced by another "
                        f"strategy ({leaf._strategy!r}); distributed values can only be used with "
                        f"the strategy that made them")
                if len(leaf._values) != self._num_local_replicas:
                    raise InvalidArgumentError(
                        f"strategy.{method}() got a {type(leaf).__name__} with {len(leaf._values)} "
                        f"components, but this strategy has {self._num_local_replicas} local replicas")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self.worker_devices)})"


class _ScopeDepth:
    """Per-thread count of open scopes of one strategy (finalize on the outermost exit)."""

    def __init__(self) -> None:
        import threading

        self._local = threading.local()

    @property
    def value(self) -> int:
        return getattr(self._local, "depth", 0)

    @value.setter
    def value(self, depth: int) -> None:
        self._local.depth = depth


def _ordered_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t  # in replica order, like the cross-device ops
    return total


def _global_batch_size_of(structure: Any) -> int | None:
    for leaf in flatten(structure):
        if isinstance(leaf, DistributedValues) and leaf._global_batch_size is not None:
            return leaf._global_batch_size
    return None
