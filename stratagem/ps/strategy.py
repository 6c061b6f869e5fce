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

Making the strategy claims the parameter servers for this program (:mod:`stratagem.ps.tenure`):
one coordinator drives them at a time. A program started while another one drives them is
refused (``CoordinatorConflictError`` naming it); one started after the previous one ended --
cleanly, killed, or crashed -- takes them over: the old variables are dropped, its own are
created fresh, and it restores them from its checkpoint if it has one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stratagem.cluster.detect import resolve
from stratagem.cluster.joined import mark_joined
from stratagem.comm.cross_device_ops import HierarchicalCopyAllReduce
from stratagem.comm.replicas import ReplicaCollective
from stratagem.devices import Device, Topology
from stratagem.errors import ClusterConfigError, ContextError, InvalidArgumentError
from stratagem.ps.client import ParameterServerClient
from stratagem.ps.ownership import CoordinatorIdentity
from stratagem.ps.placement import STARTUP_TIMEOUT_SECONDS, ParameterServerPlacement
from stratagem.ps.tenure import Tenure
from stratagem.rpc.auth import cluster_token
from stratagem.strategies.base import Strategy

__all__ = ["ParameterServerCluster", "ParameterServerStrategy"]


@dataclass(frozen=True)
class ParameterServerCluster:
    """What a :class:`~stratagem.ClusterCoordinator` needs from its strategy: the tasks to
    reach, the token that proves cluster membership (never shown in ``repr``), and this
    program's tenure over the parameter servers (:class:`~stratagem.ps.tenure.Tenure`)."""

    worker_addresses: tuple[str, ...]
    ps_addresses: tuple[str, ...]
    ps_clients: tuple[ParameterServerClient, ...]
    token: str
    tenure: Tenure

    def __repr__(self) -> str:
        return (f"ParameterServerCluster(workers={list(self.worker_addresses)}, "
                f"ps={list(self.ps_addresses)})")


class ParameterServerStrategy(Strategy):
    """Asynchronous training: variables on parameter servers, steps scheduled onto workers.

    Configuration: one replica on the coordinator's CPU (its ``run`` is inline), a
    one-replica collective, and the :class:`~stratagem.ps.placement.ParameterServerPlacement`;
    steps run on the workers through :class:`~stratagem.ClusterCoordinator`. Without a
    ``cluster_resolver`` the cluster is the environment's (:func:`stratagem.cluster.resolve`:
    TF_CONFIG, a Slurm step with STRATAGEM_SLURM_JOBS naming its ps (docs/slurm.md), or a
    Kubernetes JobSet pod's variables, docs/kubernetes.md).

    Example (the coordinator script of ``stratagem launch --workers 2 --ps 2 train.py``)::

        # strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
        #                                       variable_partitioner=sg.MinSizePartitioner(max_shards=2))
        # coordinator = sg.ClusterCoordinator(strategy)
        # with strategy.scope():
        #     model = Net(); optimizer = torch.optim.Adam(model.parameters())
    """

    model_fit_loop_kind = "scheduled"   # sg.Model.fit schedules its steps (stratagem.ps.fit_loop)

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Callable | None = None):
        if cluster_resolver is None:  # the environment's: TF_CONFIG, a Slurm step, a Kubernetes pod
            cluster_resolver = resolve()
        if not callable(getattr(cluster_resolver, "cluster_spec", None)):
            raise InvalidArgumentError(
                f"ParameterServerStrategy needs a cluster resolver (an object with a "
                f"cluster_spec() method), got {cluster_resolver!r}; pass "
                f"sg.cluster.TFConfigClusterResolver() to read the cluster from TF_CONFIG (as "
                f"`stratagem launch --workers N --ps M script.py` sets it), or "
                f"sg.cluster.SimpleClusterResolver(sg.cluster.ClusterSpec({{...}})).")
        spec = cluster_resolver.cluster_spec()
        for job in ("ps", "worker"):
            if job not in spec.jobs or spec.num_tasks(job) == 0:
                raise ClusterConfigError(
                    f"ParameterServerStrategy needs {job!r} tasks in the cluster, but it has "
                    f"{sorted(spec.jobs) or 'none'}; start the cluster with `stratagem launch --workers N "
                    f"--ps M script.py`, list them in TF_CONFIG, or under srun name them in "
                    f"STRATAGEM_SLURM_JOBS (e.g. chief=1,worker=2,ps=1; docs/slurm.md)")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise InvalidArgumentError(
                f"variable_partitioner must be a partitioner such as sg.MinSizePartitioner(), got "
                f"{variable_partitioner!r}")
        self._resolver = cluster_resolver
        token = cluster_token()
        ps_addresses = tuple(spec.job_tasks("ps"))
        identity = CoordinatorIdentity.current()   # the requests that change a ps name it
        clients = tuple(ParameterServerClient(a, token, task=f"ps {i}", coordinator=identity.id)
                        for i, a in enumerate(ps_addresses))
        for client in clients:  # the ps tasks may still be starting: wait for them
            client.wait_ready(timeout=STARTUP_TIMEOUT_SECONDS)
        tenure = Tenure(identity, clients)
        tenure.take()   # this program drives them now (or a live coordinator does: refused)
        weakref.finalize(self, tenure.release)
        self.cluster = ParameterServerCluster(tuple(spec.job_tasks("worker")), ps_addresses, clients, token,
                                              tenure)
        if getattr(cluster_resolver, "task_type", None) == "chief":
            mark_joined("chief")   # (for stratagem launch's join timeout: the coordinator reached its servers)
        topology = Topology((Device("cpu", 0),))
        collective = ReplicaCollective.create(topology.devices, HierarchicalCopyAllReduce())
        self._configure(topology, collective, ParameterServerPlacement(self, clients, variable_partitioner))
        self._coordinator: Any = None
        self._coordinator_live: Callable[[], bool] = lambda: False

    def __reduce__(self) -> Any:  # a step function that mentions the strategy runs on a worker
        return (_WorkerStrategy, ())

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def coordinator(self) -> Any:
        """The :class:`~stratagem.ClusterCoordinator` of this strategy, or None before one is made."""
        return self._coordinator

    def attach_coordinator(self, coordinator: Any, live: Callable[[], bool]) -> None:
        """Called by :class:`~stratagem.ClusterCoordinator`: one live coordinator per strategy.
        ``live`` says whether ``coordinator`` still runs (False once it was shut down): a new
        one may replace it then."""
        if self._coordinator is not None and self._coordinator_live():
            raise InvalidArgumentError("this strategy already has a live ClusterCoordinator; use "
                                       "strategy.coordinator (ClusterCoordinator(strategy) returns it too)")
        self._coordinator, self._coordinator_live = coordinator, live

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy({len(self.cluster.worker_addresses)} workers, "
                f"{len(self.cluster.ps_addresses)} ps)")


class _WorkerStrategy:
    """What a ParameterServerStrategy mentioned by a step or dataset function is, on a worker.

    Read by the worker's :class:`~stratagem.ps.closures.ClosureUnpickler`, it is bound to that
    worker's :class:`~stratagem.ps.runtime.WorkerRuntime` (``runtime``); pickled any other way
    it has none. A worker runs one replica: ``run`` calls the function, ``reduce`` returns the
    value, ``distribute_datasets_from_function`` calls ``dataset_fn`` with this worker's
    :class:`~stratagem.InputContext` and ``experimental_distribute_dataset`` returns the
    dataset as is (TensorFlow's tutorial calls them inside the function given to
    ``coordinator.create_per_worker_dataset``). The strategy's other methods belong to the
    coordinator and raise :class:`~stratagem.errors.ContextError` here.
    """

    num_replicas_in_sync = 1

    def __init__(self, runtime: Any = None):
        self.runtime = runtime

    def __reduce__(self) -> Any:  # the runtime stays on its worker
        return (_WorkerStrategy, ())

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        return value

    def experimental_local_results(self, value: Any) -> tuple:
        return (value,)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        if not callable(dataset_fn):
            raise InvalidArgumentError(
                f"distribute_datasets_from_function takes a function dataset_fn(input_context) that "
                f"returns an iterable, got {dataset_fn!r}")
        if self.runtime is None:
            raise ContextError(
                "this copy of a ParameterServerStrategy was not made by a worker's closure reader, so "
                "it knows no worker; call distribute_datasets_from_function on the coordinator's "
                "strategy, or inside the function given to coordinator.create_per_worker_dataset")
        return dataset_fn(self.runtime.input_context())

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return dataset

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_") and hasattr(ParameterServerStrategy, name):
            raise ContextError(
                f"strategy.{name} is not available inside a function that runs on a parameter-server "
                f"worker; there the strategy offers only run, reduce, experimental_local_results, "
                f"num_replicas_in_sync, distribute_datasets_from_function and "
                f"experimental_distribute_dataset. Call strategy.{name} on the coordinator, outside "
                f"scheduled and per-worker dataset functions")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
