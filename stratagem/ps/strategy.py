"""ParameterServerStrategy: asynchronous data parallelism with parameter servers.

Variables (parameters and buffers of modules created in scope) live on the ps tasks:
whole variables round-robin over the tasks, or split along dim 0 by the
``variable_partitioner`` into shards spread round-robin too; an ``nn.Embedding`` table
is row-sparse (steps read and update only the rows they use). Optimizers created in
scope keep their state beside each shard and apply updates there. Where variables live
and what scope does to modules and optimizers is :class:`~stratagem.ps.placement.Placement`;
this class answers the strategy's questions (run, reduce, optimizer hooks) with it.

On the coordinator (the user's program) a scoped module still reads as one model:
its tensors are refreshed from the ps when read after steps have run, ``state_dict()``
is one logical copy, and ``load_state_dict()`` pushes values back (re-creating them on a
fresh ps), as do the optimizer's ``state_dict()`` / ``load_state_dict()``.
Steps run on workers through :class:`~stratagem.ClusterCoordinator`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from stratagem import _context
from stratagem.devices import Device
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.ps.client import ParameterServerClient
from stratagem.ps.placement import STARTUP_TIMEOUT_SECONDS, Placement
from stratagem.rpc.auth import cluster_token
from stratagem.strategies.base import Strategy
from stratagem.strategies.mirroring import install_hooks
from stratagem.strategies.replica_context import ReplicaContext

__all__ = ["ParameterServerStrategy"]


class ParameterServerStrategy(Strategy):
    """Asynchronous training: variables on parameter servers, steps scheduled onto workers.

    Example (the coordinator script of ``stratagem launch --workers 2 --ps 2 train.py``)::

        # strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
        #                                       variable_partitioner=sg.MinSizePartitioner(max_shards=2))
        # coordinator = sg.ClusterCoordinator(strategy)
        # with strategy.scope():
        #     model = Net(); optimizer = torch.optim.Adam(model.parameters())
    """

    def __init__(self, cluster_resolver: Any, variable_partitioner: Callable | None = None):
        spec = cluster_resolver.cluster_spec()
        for job in ("ps", "worker"):
            if job not in spec.jobs or spec.num_tasks(job) == 0:
                raise ClusterConfigError(
                    f"ParameterServerStrategy needs {job!r} tasks in the cluster, but it has "
                    f"{sorted(spec.jobs) or 'none'}; start the cluster with `stratagem launch --workers N "
                    f"--ps M script.py` or list them in TF_CONFIG")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise InvalidArgumentError(
                f"variable_partitioner must be a partitioner such as sg.MinSizePartitioner(), got "
                f"{variable_partitioner!r}")
        super().__init__((Device("cpu", 0),))
        install_hooks()
        self._resolver = cluster_resolver
        self._token = cluster_token()
        self._ps_addresses = list(spec.job_tasks("ps"))
        self._worker_addresses = list(spec.job_tasks("worker"))
        self._ps_clients = [ParameterServerClient(a, self._token, task=f"ps {i}")
                            for i, a in enumerate(self._ps_addresses)]
        for client in self._ps_clients:  # the ps tasks may still be starting: wait for them
            client.wait_ready(timeout=STARTUP_TIMEOUT_SECONDS)
        self._placement = Placement(self, self._ps_clients, variable_partitioner)
        self._contexts = [ReplicaContext(self, 0, 0, None)]
        self._coordinator: Any = None

    def __reduce__(self) -> Any:  # a step function that mentions the strategy runs on a worker
        return (_WorkerStrategy, ())

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    # --------------------------------------------------------------- run

    def _run_replicas(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        args, kwargs = per_replica_args[0]
        ctx = self._contexts[0]
        ctx._global_batch_size = global_batch_size
        _context.push(self, ctx)
        try:
            return [fn(*args, **kwargs)]
        finally:
            _context.pop()

    def _replica_exchange(self, ctx: ReplicaContext, tensors: list, tag: str) -> list:
        return [tensors]

    def _replica_all_reduce(self, ctx: ReplicaContext, op: Any, tensors: list) -> list:
        return [t.clone() for t in tensors]

    def _replica_all_gather(self, ctx: ReplicaContext, tensors: list, axis: int) -> list:
        return [t.clone() for t in tensors]

    def _sync_before_schedule(self) -> None:
        self._placement.finalize()
        self._placement.sync_hyperparameters()

    # -------------------------------------------------------- optimizers

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> None:
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported in parameter-server training")
        self._placement.push_gradients(optimizer)

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer._sg_base.zero_grad(optimizer, set_to_none)

    def _optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        optimizer._sg_base.add_param_group(optimizer, param_group)
        self._placement.attach_optimizer(optimizer)

    def _reduce_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        # A scheduled function carries it to a worker by reference (stratagem.ps.closures);
        # there is no other copy of an optimizer whose state lives on the parameter servers.
        raise TypeError(
            f"a {optimizer._sg_base.__name__} created in the scope of {self!r} cannot be pickled or "
            f"deep-copied outside a scheduled function; save its state_dict() instead (one logical copy)")

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return self._placement.optimizer_state_dict(optimizer)

    def _optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self._placement.load_optimizer_state_dict(optimizer, state_dict)

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy({len(self._worker_addresses)} workers, "
                f"{len(self._ps_addresses)} ps)")


class _WorkerStrategy:
    """What a ParameterServerStrategy mentioned by a step function is, on a worker."""

    num_replicas_in_sync = 1

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        return value
