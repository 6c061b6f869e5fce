"""MultiWorkerMirroredStrategy: synchronous training across processes and hosts.

Each process is a worker with one or more local replicas (GPUs, or logical CPU
devices). Inside a worker, replicas combine values as in MirroredStrategy; across
workers, through a torch.distributed process group (gloo on CPU, NCCL on CUDA).
Gradients are summed locally first, then across workers in packs that are
launched while backward is still running (see :mod:`stratagem.comm.gradients`).

At start-up the workers check that they run the same strategy configuration; when
modules created in scope are placed, they check that every worker created the same
parameters (names, shapes, dtypes) and take the chief's initial values, so that
every worker starts identical.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from stratagem.cluster import resolve
from stratagem.comm.cross_device_ops import default_cross_device_ops
from stratagem.comm.options import CommunicationOptions, check_compression
from stratagem.comm.processes import WorkerGroup
from stratagem.comm.replicas import ReplicaCollective
from stratagem.comm.workers import WorkerCollective
from stratagem.devices import Device, Topology, parse_devices
from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.mirrored import MirroredPlacement
from stratagem.placement.data_axis.zero import ZeroUpdate, check_sharding
from stratagem.strategies.base import Strategy


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the workers of a cluster.

    ``cluster_resolver=None`` reads TF_CONFIG, else torchrun's variables, else those of
    the Slurm job step this process is a task of (``srun``), else runs as a single worker. ``devices`` are this worker's local replicas (default: the
    GPU of this process under torchrun, every visible GPU otherwise, else one CPU).
    ``sharding="optimizer"`` keeps each worker's optimizer state for its share of the
    parameters only (ZeRO-1); ``sharding="gradients"`` also reduce-scatters the gradients
    (ZeRO-2); ``sharding="parameters"`` also shards the parameters between steps, each
    module created in scope becoming FSDP2 ``fully_shard`` units (ZeRO-3: every forward
    is then a collective, run it on every worker). All three need one replica per worker
    (see docs/sharding.md).

    Run the same script on every worker, e.g.::

        stratagem launch --workers 2 train.py
        torchrun --nproc-per-node 2 train.py
        srun --ntasks 2 python train.py        # in a Slurm job (docs/slurm.md)

    Example::

        import torch
        import stratagem as sg
        strategy = sg.MultiWorkerMirroredStrategy()   # no cluster: one worker
        assert strategy.num_replicas_in_sync == 1
        sharded = sg.MultiWorkerMirroredStrategy(sharding="optimizer")
        with sharded.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.Adam(model.parameters())
        assert sorted(optimizer.state_dict()) == ["param_groups", "state"]
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None,
                 *, devices: Sequence["str | torch.device"] | None = None, sharding: str | None = None):
        resolver = resolve() if cluster_resolver is None else cluster_resolver
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise InvalidArgumentError(f"communication_options must be sg.CommunicationOptions, got {options!r}")
        local_devices = parse_devices(devices) if devices is not None else _default_worker_devices(resolver)
        check_sharding(sharding, len(local_devices))
        check_compression(options, sharding=sharding)
        self._resolver = resolver
        self._sharding = sharding
        if local_devices[0].is_cuda:
            torch.cuda.set_device(local_devices[0].torch_device)  # NCCL's device for this process
        group = WorkerGroup(resolver, options, uses_cuda=local_devices[0].is_cuda)
        topology = Topology(local_devices, num_workers=group.world_size, worker_index=group.rank)
        check_compression(options, num_workers=group.world_size, strategy="MultiWorkerMirroredStrategy")
        local = ReplicaCollective.create(local_devices, default_cross_device_ops(local_devices))
        collective = WorkerCollective(local, group, options)
        if sharding is None:
            placement = MirroredPlacement(self, topology, collective)
        elif sharding == "parameters":
            from stratagem.placement.layout.fully_sharded import FullyShardedPlacement   # FSDP2, DTensor: seconds
            placement = FullyShardedPlacement(self, collective, local_devices[0].torch_device)
        else:
            placement = MirroredPlacement(self, topology, collective, update=ZeroUpdate(sharding))
        self._configure(topology, collective, placement)
        limit_threads(resolver, group.world_size, local_devices)
        self._check_same_configuration(group.names)

    @property
    def sharding(self) -> str | None:
        """What is sharded over the workers: None, ``"optimizer"``, ``"gradients"`` or ``"parameters"``
        (docs/sharding.md)."""
        return self._sharding

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def is_chief(self) -> bool:
        """Whether this worker saves checkpoints and writes summaries."""
        return self._topology.worker_index == 0

    def _check_same_configuration(self, names: list[str]) -> None:
        collective = self._collective
        mine = {"strategy": type(self).__name__, "local replicas": self._topology.num_local_replicas,
                "device kind": self._topology.devices[0].kind, "backend": collective.group.backend,
                "bytes_per_pack": collective.options.bytes_per_pack,
                "compression": collective.options.compression_settings,
                "cross_device_ops": type(collective.local.options).__name__, "sharding": self._sharding}
        everyone = collective.all_gather_object(mine, "start-up configuration check")
        for rank, theirs in enumerate(everyone):
            for key in mine:
                if theirs.get(key) != everyone[0].get(key):
                    raise InvalidArgumentError(
                        f"the workers run different strategy configurations: {key} is "
                        f"{everyone[0].get(key)!r} on {names[0]} but {theirs.get(key)!r} on "
                        f"{names[rank]}; start every worker with the same strategy arguments")

    def __repr__(self) -> str:
        group = self._collective.group
        return (f"MultiWorkerMirroredStrategy({group.names[group.rank]} of "
                f"{group.world_size} workers, devices={list(self.worker_devices)}"
                + (f", sharding={self._sharding!r})" if self._sharding else ")"))


def _default_worker_devices(resolver: Any) -> tuple[Device, ...]:
    """This worker's devices when none are given: the CPU; with CUDA under torchrun, a DDP
    script's ``cuda:LOCAL_RANK``; otherwise every visible GPU when the worker is alone on its host
    (TensorFlow's default), else its even share of them: ``stratagem launch`` and Slurm say how many
    worker processes share the host and which one this is (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``),
    so that two workers never take the same GPU as replicas."""
    count = torch.cuda.device_count()
    if not count:
        return (Device("cpu", 0),)
    local_rank = getattr(resolver, "local_rank", None)
    if local_rank is not None and type(resolver).__name__ == "TorchrunClusterResolver":
        return (Device("cuda", local_rank % count),)   # a DDP script's device, one per process
    local_world = getattr(resolver, "local_world_size", None)
    if local_rank is None:   # (a TF_CONFIG cluster: stratagem launch sets both, as torchrun does)
        local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    return tuple(Device("cuda", i) for i in gpu_share(count, local_rank, local_world))


def gpu_share(count: int, local_rank: int | None, local_world: int | None) -> range:
    """The indices of the GPUs (of ``count`` visible) that worker ``local_rank`` of the
    ``local_world`` worker processes on one host takes: all of them when it is alone (or when
    nothing says), an even share each, or one each, shared round-robin, when the processes
    outnumber the GPUs.

        >>> list(gpu_share(8, None, None)), list(gpu_share(8, 1, 4)), list(gpu_share(2, 3, 4))
        ([0, 1, 2, 3, 4, 5, 6, 7], [2, 3], [1])
    """
    if local_rank is None or not local_world or local_world <= 1:
        return range(count)
    if not 0 <= local_rank < local_world:
        raise InvalidArgumentError(
            f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}; start the workers with "
            f"stratagem launch or torchrun, which set both, or pass devices= explicitly")
    per = count // local_world
    if per == 0:   # more processes than GPUs here: they share, as cuda:LOCAL_RANK % count would
        return range(local_rank % count, local_rank % count + 1)
    return range(local_rank * per, (local_rank + 1) * per)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def limit_threads(resolver: Any, world_size: int, devices: tuple[Device, ...]) -> None:
    """One intra-op thread per process when this host's processes outnumber its cores."""
    if devices[0].is_cuda or "STRATAGEM_KEEP_THREADS" in os.environ:
        return
    local_processes = getattr(resolver, "local_world_size", None) or _processes_on_this_host(resolver, world_size)
    per_process = max(1, _usable_cores() // max(local_processes, 1))
    if torch.get_num_threads() > per_process:
        torch.set_num_threads(per_process)


def _processes_on_this_host(resolver: Any, world_size: int) -> int:
    try:
        spec = resolver.cluster_spec()
        chief = resolver.chief_address or ""
    except InvalidArgumentError:
        return world_size
    host = chief.rsplit(":", 1)[0]
    addresses = [a for job in ("chief", "worker") if job in spec.jobs for a in spec.job_tasks(job) if a]
    mine = resolver.master() if resolver.task_type else chief
    my_host = mine.rsplit(":", 1)[0] if mine else host
    return max(1, sum(1 for a in addresses if a.rsplit(":", 1)[0] == my_host))
