"""The :class:`Strategy` base class: the public API every strategy shares.

A strategy is a configuration of three collaborators, each answering one question
(``docs/architecture.md`` shows how a step flows through them):

- a replica **runner** (:mod:`stratagem.strategies.runner`): how the local replicas
  execute the function given to ``run`` — inline, or on persistent replica threads;
- a **Collective** (:mod:`stratagem.comm`): how bytes move among replicas — between
  replica threads, between processes, or both;
- a **Placement** (:mod:`stratagem.placement`): where variables live, and what the
  scope does to modules and optimizers created in it.

A public method validates its input, then hands over to one of them. The
:class:`~stratagem.devices.Topology` says where this process's replicas are.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from stratagem import _context
from stratagem._profiling import label
from stratagem.comm.collective import Collective
from stratagem.data.from_function import DistributedDatasetsFromFunction
from stratagem.data.input import DistributedDataset, ValueContext
from stratagem.devices import Topology
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.nn import loss_watch
from stratagem.observe.report import step_report
from stratagem.placement.scope import hooks
from stratagem.placement.scope.base import Placement
from stratagem.placement.scope.unscoped import unscoped_check
from stratagem.strategies.set_strategy import mixing_refusal
from stratagem.strategies.replica_context import CrossReplicaCollectives, ReplicaContext
from stratagem.strategies.runner import InlineRunner, ThreadRunner
from stratagem.values import (DistributedValues, PerReplica, ReduceOp, check_owned, flatten, global_batch_size_of,
                              map_structure, pack_as, regroup)


class Runner(Protocol):
    """How local replicas execute: ``run`` returns one result per local replica."""

    def run(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list: ...


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

    #: True only for the default strategy (what sg.get_strategy() returns outside every scope).
    is_default = False
    #: How ``sg.Model``'s steps are shaped under this strategy, for the Keras layer to pick them
    #: (:func:`stratagem.keras.step_kinds.steps_for`): ``"replica"`` -- the forward, then
    #: ``loss.backward()``, in each replica; ``"pipeline"`` -- a schedule of micro-batches.
    model_steps_kind = "replica"
    #: How ``sg.Model.fit`` runs epochs: ``"replicated"`` (each step by ``run`` here, ``keras/epochs.py``)
    model_fit_loop_kind = "replicated"   # or "scheduled": onto workers by a ClusterCoordinator (ps/fit_loop.py)

    def _configure(self, topology: Topology, collective: Collective, placement: Placement) -> None:
        """Set the collaborators (each strategy's ``__init__`` calls this once).

        The runner follows from the topology: one local replica runs inline, several on threads.
        """
        self._topology = topology
        self._collective = collective
        self._placement = placement
        contexts = [ReplicaContext(self, i, device, collective) for i, device in enumerate(topology.devices)]
        self._runner: Runner = ThreadRunner(contexts, collective) if len(contexts) > 1 else \
            InlineRunner(contexts, name_errors=not self.is_default)
        self._outside_context = ReplicaContext(self, 0, topology.devices[0], collective) \
            if len(contexts) == 1 else None
        loss_watch.act_outside_run(self)
        if self.num_replicas_in_sync > 1:   # parameters no replica agreed on are refused at forward
            unscoped_check.watch_modules()
        self._scope_depth = threading.local()

    def outside_replica_context(self) -> ReplicaContext | None:
        """The replica that code outside ``run``, in the scope, acts as (a step written without
        ``run``, as under DistributedDataParallel): this process's one replica, else None.

        Example::

            import stratagem as sg
            strategy = sg.OneDeviceStrategy("cpu")
            assert strategy.outside_replica_context().num_replicas_in_sync == 1
            assert sg.MirroredStrategy(["cpu:0", "cpu:1"]).outside_replica_context() is None
        """
        return self._outside_context

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, over all workers."""
        return self._topology.num_replicas_in_sync

    @property
    def topology(self) -> Topology:
        """Where the replicas are: this worker's devices, the number of workers, this worker's index."""
        return self._topology

    @property
    def placement(self) -> Placement:
        """Where this strategy keeps variables (advanced use; see ``stratagem.placement``)."""
        return self._placement

    @property
    def collective(self) -> Collective:
        """How this strategy moves bytes between replicas (advanced use; see ``stratagem.comm``)."""
        return self._collective

    @property
    def checkpoint_collective(self) -> Collective:
        """The processes that save checkpoints and write files together (advanced use).

        Every one of them calls ``Checkpoint.save`` / ``restore``; the one whose
        ``worker_index`` is 0 writes (checkpoints, logs, summaries). The workers'
        ``collective`` here; a strategy whose data-parallel worker spans several processes
        (tensor parallelism) gives the collective over all of them.
        """
        return self._collective

    @property
    def extended(self) -> "Strategy":
        """TensorFlow keeps advanced methods on ``strategy.extended``; here they are on the strategy."""
        return self

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This process's replica devices, in replica order."""
        return tuple(str(d) for d in self._topology.devices)

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
            raise mixing_refusal(self, frame.strategy)
        replica_context = frame.replica_context if frame is not None else None
        _context.push(self, replica_context)
        depth = getattr(self._scope_depth, "value", 0)
        self._scope_depth.value = depth + 1
        if not self.is_default:
            hooks.scope_opened()
        try:
            yield self
        finally:   # (a scope left open for good, by experimental_set_strategy, may be collected at exit)
            if not sys.is_finalizing():
                if not self.is_default:
                    hooks.scope_closed()
                self._scope_depth.value = depth
                _context.pop()
                if depth == 0:
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
        with self._enter_cross_replica("run"), label("stratagem.run"), loss_watch.watching(self):
            self._check_owned((args, kwargs), "run")
            placement = self._placement
            placement.before_run()
            try:
                per_replica_args = [self._select_replica(i, (tuple(args), kwargs))
                                    for i in range(self._topology.num_local_replicas)]
                results = self._runner.run(fn, per_replica_args, global_batch_size_of((args, kwargs)))
            except BaseException:
                placement.after_run(failed=True)
                raise
            placement.after_run()
        if len(results) == 1:
            return results[0]
        return regroup(results, self)

    def _select_replica(self, local_id: int, structure: Any) -> Any:
        copy_for = self._placement.replica_copy

        def pick(leaf: Any) -> Any:
            if isinstance(leaf, DistributedValues):
                return leaf.values[local_id]
            if isinstance(leaf, torch.Tensor):
                return copy_for(leaf, local_id)
            return leaf
        return map_structure(pick, structure)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside skip the gradient exchange (accumulation without waste).

        DistributedDataParallel's ``no_sync()``: inside it ``.grad`` holds this replica's own
        accumulation; the next ``backward()`` outside it sums everything accumulated since over
        every replica and worker (k micro-steps, one exchange; ``.grad`` is then the global
        batch's). Every replica must do the same. ``model.require_backward_grad_sync = False``
        on a model created in scope (DDP's attribute, nanoGPT's idiom) does the same.

        Example::

            import torch, stratagem as sg
            strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
            with strategy.scope():
                model = torch.nn.Linear(4, 1)

            def step(x):
                with strategy.no_sync():
                    sg.nn.compute_average_loss(model(x).pow(2).sum(1)).backward()  # own part
                sg.nn.compute_average_loss(model(x).pow(2).sum(1)).backward()      # one exchange
                return model.weight.grad

            strategy.run(step, args=(torch.ones(8, 4),))
        """
        return self._placement.no_sync()

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
            pairs = [self._local_reduce(leaf, axis) for leaf in flatten(value)]
            totals, counts = [t for t, _ in pairs], [c for _, c in pairs]
            exchanged_counts = axis is not None and self._collective.num_workers > 1 and bool(totals)
            if exchanged_counts:  # how many rows every worker reduced, in the same exchange
                totals.append(torch.tensor(counts, dtype=torch.int64, device=totals[0].device))
            detail = f"with '{op.value.lower()}'" + ("" if axis is None else f" along axis {axis}")
            summed = self._collective.worker_sums(totals, "strategy.reduce", detail)
            if exchanged_counts:
                counts = summed.pop().tolist()
            if op is ReduceOp.MEAN:
                summed = [_mean(total, count) for total, count in zip(summed, counts)]
            return pack_as(value, summed)

    def _result_device(self, value: Any) -> torch.device | None:
        """Where reduce/gather put their result: the first local replica's device."""
        return self._topology.devices[0].torch_device

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
            tensors = tensors * self._topology.num_local_replicas
        return tensors, target

    def _local_reduce(self, leaf: Any, axis: int | None) -> tuple[torch.Tensor, int]:
        """This process's sum of ``leaf`` (along ``axis`` too), and how many replicas or rows it holds."""
        components, _ = self._local_tensors(leaf)
        if axis is None:  # (local_sum: a user's CrossDeviceOps' reduce())
            return self._collective.local_sum(components), self.num_replicas_in_sync
        for c in components:
            if c.dim() == 0 or not -c.dim() <= axis < c.dim():
                raise InvalidArgumentError(
                    f"cannot reduce along axis {axis} a component of shape {tuple(c.shape)}; "
                    f"use axis=None for scalars")
        return self._collective.local_sum([c.sum(dim=axis) for c in components]), sum(c.shape[axis] for c in components)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the components of every replica (all workers) along ``axis``."""
        if not isinstance(axis, int):
            raise InvalidArgumentError(f"gather needs an integer axis, got {axis!r}")
        with self._enter_cross_replica("gather"):
            self._check_owned(value, "gather")
            local = [self._local_gather(leaf, axis) for leaf in flatten(value)]
            return pack_as(value, self._collective.worker_gathers(local, axis))

    def _local_gather(self, leaf: Any, axis: int) -> torch.Tensor:
        components, _ = self._local_tensors(leaf)
        for c in components:
            if c.dim() == 0:
                raise InvalidArgumentError(
                    "gather concatenates along an axis, so components need at least one "
                    "dimension; got a scalar. Use reduce(...) for scalars, or x.reshape(1)")
        return torch.cat(components, dim=axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this process's replicas (a 1-tuple for a plain value).

        For a parameter or buffer of a module created in scope, the per-replica copies.
        """
        if isinstance(value, DistributedValues):
            self._check_owned(value, "experimental_local_results")
            return value.values
        if isinstance(value, torch.Tensor):
            self._placement.finalize()  # a module created in a scope that is still open
            copies = self._placement.all_copies(value)
            if copies is not None:
                return copies
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """Call ``value_fn(sg.ValueContext)`` once per local replica; return a PerReplica."""
        if not callable(value_fn):
            raise InvalidArgumentError("value_fn must be callable: value_fn(ctx) -> value")
        topology = self._topology
        values = [value_fn(ValueContext(topology.first_replica_id + i, topology.num_replicas_in_sync))
                  for i in range(topology.num_local_replicas)]
        return PerReplica(values, self)

    def experimental_distribute_dataset(self, dataset: Iterable, options: Any = None) -> Any:
        """Distribute an iterable of *global* batches: each replica gets its own slice of each."""
        with self._enter_cross_replica("experimental_distribute_dataset"):
            return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Call ``dataset_fn(sg.InputContext)`` per worker; it returns per-replica batches."""
        with self._enter_cross_replica("distribute_datasets_from_function"):
            return DistributedDatasetsFromFunction(self, dataset_fn, options)

    @property
    def collectives(self) -> CrossReplicaCollectives:
        """The collectives (broadcast, all_reduce, ...) applied to PerReplica values from cross-replica context."""
        return CrossReplicaCollectives(self)

    def experimental_step_report(self) -> str:
        """The straggler table of the steps so far; every worker calls it (``observe/report.py``)."""
        return step_report(self)

    def _check_owned(self, structure: Any, method: str) -> None:
        check_owned(self, self._topology.num_local_replicas, structure, method)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self.worker_devices)})"


def _mean(total: torch.Tensor, count: int) -> torch.Tensor:
    total = total if total.is_floating_point() or total.is_complex() else total.to(torch.get_default_dtype())
    return total / count if count else torch.full_like(total, float("nan"))
