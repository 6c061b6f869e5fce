"""MeshStrategy: the base of the model-parallel strategies, whose processes form a mesh.

The processes of the cluster form a mesh ``(data, <model axis>, <more axes>)`` in row-major
order: with two axes, process ``r`` is data rank ``r // size`` and model-axis rank
``r % size`` (the model axis is ``"model"`` for tensor parallelism, ``"pipe"`` for pipeline
parallelism); ``PipelineStrategy`` adds a third, ``"model"``, innermost. The processes that
share a data rank hold one replica of the model between them; the data axis is data
parallelism over those groups. This base starts the process group (a lone process gets a
one-process group: torch's DTensor and pipeline stages need one), the ``DeviceMesh``, a
Collective per axis and one over every process, and checks at start-up that every
process runs the same configuration. ``num_replicas_in_sync`` is the data-axis size.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from stratagem.cluster import resolve
from stratagem.comm.cross_device_ops import default_cross_device_ops
from stratagem.comm.gloo_threads import leave_every_group
from stratagem.comm.options import CommunicationOptions, check_compression
from stratagem.comm.processes import WorkerGroup, peers_of
from stratagem.comm.replicas import ReplicaCollective
from stratagem.comm.workers import WorkerCollective
from stratagem.devices import Device, Topology
from stratagem.errors import InvalidArgumentError
from stratagem.strategies.base import Strategy
from stratagem.strategies.multi_worker import limit_threads


class AxisGroup(WorkerGroup):
    """The processes along one axis of the mesh, as a WorkerGroup (failures named by the full group)."""

    def __init__(self, full: WorkerGroup, group: Any, ranks: list[int]):  # noqa: D107 - no WorkerGroup.__init__
        self.full = full
        self.group = group
        self.rank = ranks.index(full.rank)
        self.world_size = len(ranks)
        self.names = [full.names[r] for r in ranks]
        self.timeout, self.backend, self.device = full.timeout, full.backend, full.device
        self.solo = self.world_size == 1
        self.peers = peers_of(self.names)

    def guard(self, what: str, nbytes: int = 0, *, record: bool = True) -> Any:
        return self.full.guard(what, nbytes, record=record, peers=self.peers)

    def close(self) -> None:
        """The full group owns the process group."""


class MeshStrategy(Strategy):
    """A strategy over a ``{"data": d, <axis>: n}`` mesh of processes (one device each)."""

    #: the model-parallel axis of the mesh ("model", "pipe")
    axis = "model"
    #: every axis, outermost first: "data", ``axis``, then axes of size 1 unless given
    axes: tuple[str, ...] = ("data", "model")

    def _start_mesh(self, mesh: dict[str, int] | None, cluster_resolver: Any,
                    communication_options: CommunicationOptions | None) -> tuple[int, ...]:
        """Join the processes and build the mesh; returns the size of each of :attr:`axes`.

        Sets ``self.mesh``, ``self._mesh_device``, ``self._full`` (every process) and
        ``self._resolver``; :meth:`_axis_collective` then gives each axis's Collective.
        """
        resolver = resolve() if cluster_resolver is None else cluster_resolver
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise InvalidArgumentError(f"communication_options must be sg.CommunicationOptions, got {options!r}")
        sizes = mesh_shape(mesh, resolver.num_workers, self.axes)
        check_compression(options, num_workers=sizes[0], strategy=type(self).__name__)
        cuda = torch.cuda.is_available()
        device = Device("cuda", (resolver.worker_rank or 0) % torch.cuda.device_count()) if cuda else Device("cpu", 0)
        if cuda:
            torch.cuda.set_device(device.torch_device)
        full = WorkerGroup(resolver, options, uses_cuda=cuda)   # (closed at exit: its heartbeat stops)
        if full.solo and not dist.is_initialized():  # a lone process still needs a group for the mesh
            dist.init_process_group(full.backend, store=dist.HashStore(), rank=0, world_size=1)
            atexit.register(leave_every_group)
        self.mesh = init_device_mesh(device.kind, sizes, mesh_dim_names=self.axes)
        self._mesh_device = device
        self._options = options
        self._full = WorkerCollective(self._local_collective(), full, options)
        self._resolver = resolver
        limit_threads(resolver, full.world_size, (device,))
        return sizes

    def _local_collective(self) -> ReplicaCollective:
        return ReplicaCollective.create((self._mesh_device,), default_cross_device_ops((self._mesh_device,)))

    def _axis_collective(self, name: str) -> WorkerCollective:
        """The processes along axis ``name`` (one of :attr:`axes`) that include this one."""
        group = self.mesh.get_group(name)
        axis_group = AxisGroup(self._full.group, group, dist.get_process_group_ranks(group))
        return WorkerCollective(self._local_collective(), axis_group, self._options)

    def _data_topology(self) -> Topology:
        """One replica per data group: the input pipeline and ``reduce`` work over the data axis."""
        return Topology((self._mesh_device,), num_workers=self.mesh.size(0),
                        worker_index=self.mesh.get_local_rank("data"))

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def is_chief(self) -> bool:
        """Whether this process saves checkpoints and writes summaries (global rank 0)."""
        return self._full.worker_index == 0

    @property
    def checkpoint_collective(self) -> WorkerCollective:
        """Every process: all of them call ``Checkpoint.save``; global rank 0 writes."""
        return self._full

    def _check_same_configuration(self, mine: dict) -> None:
        mine = {**mine, "compression": self._options.compression_settings}
        everyone = self._full.all_gather_object(mine, "start-up configuration check")
        names = self._full.group.names
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise InvalidArgumentError(
                    f"the processes run different {type(self).__name__} configurations: {everyone[0]} on "
                    f"{names[0]} but {theirs} on {names[rank]}; start every process with the same arguments")

    def _mesh_repr(self) -> str:
        sizes = ", ".join(f"'{name}': {size}" for name, size in zip(self.axes, self.mesh.shape))
        return f"mesh={{{sizes}}}"


def mesh_shape(mesh: dict[str, int] | None, world_size: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    """The size of each of ``axes`` (``("data", axis, *more)``) from a mesh dict that gives some of them.

    Axes after the second are 1 unless given; of ``data`` and ``axis``, a missing one takes the
    processes left (``data`` 1 when both are missing; ``mesh=None``: every process on ``axis``).
    """
    axis, more = axes[1], axes[2:]
    if mesh is None:
        return (1, world_size, *(1 for _ in more))
    example = ", ".join(f"'{name}': 2" for name in axes)
    others = "".join(f" (and '{name}')" for name in more)
    if not isinstance(mesh, dict) or set(mesh) - set(axes) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh.values()):
        raise InvalidArgumentError(
            f"mesh must be a dict with positive integer sizes for 'data' and/or '{axis}'{others}, e.g. "
            f"{{{example}}}; got {mesh!r}")
    extra = [mesh.get(name, 1) for name in more]
    fixed = 1
    for size in extra:
        fixed *= size
    main = {k: v for k, v in mesh.items() if k in ("data", axis)}
    if len(main) < 2:
        given = fixed * (main.get("data", 1) * main.get(axis, 1))
        if world_size % given:
            what = "gives {!r} {} processes".format(*next(iter(mesh.items()))) if len(mesh) == 1 else \
                f"{mesh} gives {given} processes"
            raise InvalidArgumentError(
                f"the mesh {what}, which does not divide the {world_size} processes of the cluster; give "
                f"sizes whose product divides {world_size}, or every size")
    rest = world_size // fixed
    data = main.get("data", rest // main[axis] if main.get(axis) else 1)
    other = main.get(axis, rest // data)
    sizes = (data, other, *extra)
    total = data * other * fixed
    if total != world_size:
        named = ", ".join(f"'{name}': {size}" for name, size in zip(axes, sizes))
        raise InvalidArgumentError(
            f"the mesh {{{named}}} has {total} processes, but the cluster has {world_size}; give sizes whose "
            f"product is {world_size}")
    return sizes
