"""TorchrunClusterResolver: the cluster described by torchrun's environment variables.

``torchrun --nnodes 2 --nproc-per-node 4 train.py`` starts every process with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set.
In TensorFlow's terms every such process is a worker: task ``("worker", RANK)``, rank 0 being
the chief (there is no separate chief job), and ``MASTER_ADDR:MASTER_PORT`` being where the
collective meets.

Example::

    >>> from stratagem.cluster import TorchrunClusterResolver
    >>> env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    ...        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    >>> resolver = TorchrunClusterResolver(environment=env)
    >>> resolver.task_type, resolver.task_id, resolver.local_rank
    ('worker', 5, 1)
    >>> resolver.num_workers, resolver.worker_rank, resolver.is_chief, resolver.chief_address
    (8, 5, False, '10.0.0.1:29500')
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from stratagem.cluster.pytorchjob import check_operator_variables
from stratagem.cluster.resolver import ClusterResolver
from stratagem.cluster.spec import ClusterSpec, validate_address
from stratagem.errors import ClusterConfigError

__all__ = ["TorchrunClusterResolver", "TORCHRUN_VARIABLES"]

#: Every variable torchrun sets for its processes (besides ``TORCHELASTIC_*``); the resolver
#: reads the first six. ``stratagem launch`` removes the inherited ones from its tasks' environment
#: and sets the first four from each task's TF_CONFIG (``stratagem.launch.tasks.torchrun_variables``).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")


def _read_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    text = env.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise ClusterConfigError(
            f"torchrun variables: {name}={text!r} is not an integer; unset it or set it to "
            f"an integer >= {minimum} (torchrun sets it for you).") from None
    if value < minimum:
        raise ClusterConfigError(
            f"torchrun variables: {name}={value} must be >= {minimum}.")
    return value


def _rendezvous_address(env: Mapping[str, str], world_size: int) -> str | None:
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if host is None and port is None and world_size == 1:
        return None  # a single process needs no rendezvous
    if host is None or port is None:
        missing = "MASTER_ADDR" if host is None else "MASTER_PORT"
        raise ClusterConfigError(
            f"torchrun variables: {missing} is not set (WORLD_SIZE={world_size}); every "
            "process needs MASTER_ADDR and MASTER_PORT, the host and port of rank 0 where "
            "the processes meet -- launch with torchrun, or set both.")
    host = host.strip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 MASTER_ADDR
    return validate_address(f"{host}:{port.strip()}", where="torchrun MASTER_ADDR:MASTER_PORT")


class TorchrunClusterResolver(ClusterResolver):
    """A resolver reading the variables torchrun sets (``environment`` replaces os.environ).

    Every process is task ``("worker", RANK)`` of ``WORLD_SIZE`` workers; rank 0 is the
    chief. ``LOCAL_RANK`` defaults to 0 and ``LOCAL_WORLD_SIZE`` to unknown (None), as when
    a process was started by hand, one per host; ``MASTER_ADDR``/``MASTER_PORT`` may be left
    out only when ``WORLD_SIZE`` is 1.

    **No cluster spec.** torchrun does not tell a process the addresses of the other
    processes: they meet at ``MASTER_ADDR:MASTER_PORT`` and torch.distributed's rendezvous
    owns the rest. So :meth:`cluster_spec` raises ClusterConfigError saying so, rather than
    return a table with invented addresses that a caller might dial; ``num_workers``,
    ``worker_rank``, ``is_chief`` and ``chief_address`` -- all a synchronous multi-worker
    strategy needs -- are answered from the variables. Clusters whose tasks must reach each
    other by address (parameter-server training) are described with TF_CONFIG instead.

    Kubeflow's PyTorchJob sets the same variables for one process per pod (the master rank 0,
    ``MASTER_ADDR`` its Service); a PyTorchJob whose values only torchrun can use
    (``nprocPerNode`` above 1 in a process torchrun did not start) is refused with the fix
    (``pytorchjob.py``).

    ``num_accelerators()`` follows torchrun's convention of one process per GPU:
    ``{"GPU": 1}`` when a CUDA device is visible (the process's is ``cuda:LOCAL_RANK``, or
    its only visible one), else ``{}``.
    """

    def __init__(self, *, environment: Mapping[str, str] | None = None) -> None:
        env = os.environ if environment is None else environment
        world_size = _read_int(env, "WORLD_SIZE", minimum=1)
        rank = _read_int(env, "RANK", minimum=0)
        if rank is None or world_size is None:
            missing = "RANK" if rank is None else "WORLD_SIZE"
            raise ClusterConfigError(
                f"torchrun variables: {missing} is not set, but "
                f"{'WORLD_SIZE' if rank is None else 'RANK'} is; set both (torchrun does), or "
                "neither to run as a single process.")
        if rank >= world_size:
            raise ClusterConfigError(
                f"torchrun variables: RANK={rank} is out of range for WORLD_SIZE={world_size}; "
                f"ranks go from 0 to {world_size - 1}.")
        check_operator_variables(env, rank=rank, world_size=world_size)
        local_rank = _read_int(env, "LOCAL_RANK", minimum=0)
        local_world_size = _read_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if local_world_size is not None:
            if local_world_size > world_size:
                raise ClusterConfigError(
                    f"torchrun variables: LOCAL_WORLD_SIZE={local_world_size} is larger than "
                    f"WORLD_SIZE={world_size}; a host cannot run more processes than the job has.")
            if local_rank is not None and local_rank >= local_world_size:
                raise ClusterConfigError(
                    f"torchrun variables: LOCAL_RANK={local_rank} is out of range for "
                    f"LOCAL_WORLD_SIZE={local_world_size}; local ranks go from 0 to "
                    f"{local_world_size - 1}.")
        elif local_rank is not None and local_rank >= world_size:
            raise ClusterConfigError(
                f"torchrun variables: LOCAL_RANK={local_rank} is out of range for "
                f"WORLD_SIZE={world_size}.")
        super().__init__(task_type="worker", task_id=rank)
        self._world_size = world_size
        self._local_rank = local_rank or 0
        self._local_world_size = local_world_size
        self._rendezvous = _rendezvous_address(env, world_size)

    def cluster_spec(self) -> ClusterSpec:
        raise ClusterConfigError(
            "torchrun does not publish the address of every worker: its processes meet at "
            f"MASTER_ADDR:MASTER_PORT ({self._rendezvous}) and torch.distributed's "
            "rendezvous owns the rest. Use the resolver's num_workers, worker_rank and "
            "chief_address instead; to give every task an address (parameter-server "
            "training), describe the cluster with TF_CONFIG, e.g. via `stratagem launch`.")

    @property
    def local_rank(self) -> int:
        """This process's index among the processes of its host (LOCAL_RANK)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int | None:
        """How many processes run on this host (LOCAL_WORLD_SIZE); None when not set."""
        return self._local_world_size

    @property
    def num_workers(self) -> int:
        return self._world_size

    @property
    def worker_rank(self) -> int:
        assert self.task_id is not None
        return self.task_id

    @property
    def chief_address(self) -> str | None:
        return self._rendezvous

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The rendezvous address (rank 0's), the only one torchrun makes known."""
        if (task_type, task_id) not in ((None, None), ("worker", 0)):
            raise ClusterConfigError(
                f"torchrun knows only rank 0's address (MASTER_ADDR:MASTER_PORT), not that of "
                f"task ({task_type!r}, {task_id!r}); call master() or master('worker', 0).")
        address = self._rendezvous or ""
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer and address else address

    def num_accelerators(self, task_type: str | None = None,
                         task_id: int | None = None) -> dict[str, int]:
        return {"GPU": 1} if super().num_accelerators() else {}
