"""TensorParallelStrategy: layers split over processes (Megatron-style), data parallel on top.

The processes of the cluster form a 2-D mesh ``(data, model)``: process ``r`` is data
rank ``r // model`` and model rank ``r % model``. Along the model axis, the layers named
by the plan are split with torch's ``parallelize_module`` (their parameters become
DTensors; see :mod:`stratagem.placement.tensor_parallel`); along the data axis, each
group of ``model`` processes is one data-parallel replica: it gets its own slice of each
global batch, and gradients are summed over the data axis before every update.

So ``num_replicas_in_sync`` is the data-parallel degree ``data``; ``strategy.reduce``
and the input pipeline work over the data axis (the processes of one model group hold
the same values and get the same input slice). Checkpoints, files and the chief's
decisions involve every process (``checkpoint_collective``): all of them call
``Checkpoint.save`` / ``restore``, and global rank 0 writes one logical copy.
"""

from __future__ import annotations

import atexit
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from stratagem.cluster import resolve
from stratagem.comm.cross_device_ops import default_cross_device_ops
from stratagem.comm.options import CommunicationOptions
from stratagem.comm.processes import WorkerGroup
from stratagem.comm.replicas import ReplicaCollective
from stratagem.comm.workers import WorkerCollective
from stratagem.devices import Device, Topology
from stratagem.errors import InvalidArgumentError
from stratagem.placement.tensor_parallel import TensorParallelPlacement, check_plan
from stratagem.strategies.base import Strategy
from stratagem.strategies.multi_worker import _limit_threads


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

    def guard(self, what: str) -> Any:
        return self.full.guard(what)

    def close(self) -> None:
        """The full group owns the process group."""


class TensorParallelStrategy(Strategy):
    """Tensor parallelism over a ``{"data": d, "model": t}`` mesh of processes (experimental).

    ``plan`` maps module names (or glob patterns such as ``"blocks.*.fc1"``), relative to the
    model created in scope, to ``"colwise"``, ``"rowwise"``, ``"sequence"`` or a torch
    ``ParallelStyle``. ``d * t`` must equal the number of processes; ``mesh=None`` means
    ``{"data": 1, "model": <all processes>}``.

    Run the same script on every process, e.g. ``stratagem launch --workers 4 train.py``.

    Example::

        import torch, stratagem as sg
        strategy = sg.experimental.TensorParallelStrategy(plan={"0": "colwise", "1": "rowwise"})
        with strategy.scope():   # one process here: a 1 x 1 mesh
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        assert strategy.num_replicas_in_sync == 1
        assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    """

    def __init__(self, mesh: dict[str, int] | None = None, plan: dict[str, Any] | None = None, *,
                 cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None):
        plan = check_plan(plan)
        resolver = resolve() if cluster_resolver is None else cluster_resolver
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise InvalidArgumentError(f"communication_options must be sg.CommunicationOptions, got {options!r}")
        data_size, model_size = _mesh_shape(mesh, resolver.num_workers)
        cuda = torch.cuda.is_available()
        device = Device("cuda", (resolver.worker_rank or 0) % torch.cuda.device_count()) if cuda else Device("cpu", 0)
        if cuda:
            torch.cuda.set_device(device.torch_device)
        full = WorkerGroup(resolver, options, uses_cuda=cuda)
        atexit.register(full.close)  # its heartbeat stops before the interpreter does (idempotent)
        if full.solo and not dist.is_initialized():  # a lone process still needs a group for the mesh
            dist.init_process_group(full.backend, store=dist.HashStore(), rank=0, world_size=1)
            atexit.register(_leave_solo_group)
        self.mesh = init_device_mesh(device.kind,
                                     (data_size, model_size), mesh_dim_names=("data", "model"))
        data_ranks = dist.get_process_group_ranks(self.mesh.get_group("data"))
        self._full = WorkerCollective(ReplicaCollective.create((device,), default_cross_device_ops((device,))),
                                      full, options)
        local = ReplicaCollective.create((device,), default_cross_device_ops((device,)))
        data = WorkerCollective(local, AxisGroup(full, self.mesh.get_group("data"), data_ranks), options)
        topology = Topology((device,), num_workers=data_size, worker_index=self.mesh.get_local_rank("data"))
        self._configure(topology, data, TensorParallelPlacement(self, self.mesh, plan, data, self._full,
                                                                    device.torch_device))
        self._resolver = resolver
        _limit_threads(resolver, full.world_size, (device,))
        self._check_same_configuration({"mesh": (data_size, model_size),
                                        "plan": {k: re.sub(r" at 0x[0-9a-f]+", "", str(v)) for k, v in plan.items()}})

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

    @property
    def model_rank(self) -> int:
        """This process's place along the model axis."""
        return self.mesh.get_local_rank("model")

    def _check_same_configuration(self, mine: dict) -> None:
        everyone = self._full.all_gather_object(mine, "start-up configuration check")
        names = self._full.group.names
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise InvalidArgumentError(
                    f"the processes run different TensorParallelStrategy configurations: {everyone[0]} on "
                    f"{names[0]} but {theirs} on {names[rank]}; start every process with the same arguments")

    def __repr__(self) -> str:
        shape = tuple(self.mesh.shape)
        return (f"TensorParallelStrategy(mesh={{'data': {shape[0]}, 'model': {shape[1]}}}, "
                f"process {self._full.worker_index} of {self._full.num_workers})")


def _mesh_shape(mesh: dict[str, int] | None, world_size: int) -> tuple[int, int]:
    if mesh is None:
        return 1, world_size
    if not isinstance(mesh, dict) or set(mesh) - {"data", "model"} or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh.values()):
        raise InvalidArgumentError(
            f"mesh must be a dict with positive integer sizes for 'data' and/or 'model', e.g. "
            f"{{'data': 2, 'model': 2}}; got {mesh!r}")
    data = mesh.get("data", world_size // mesh["model"] if mesh.get("model") else 1)
    model = mesh.get("model", world_size // data)
    if data * model != world_size:
        raise InvalidArgumentError(
            f"the mesh {{'data': {data}, 'model': {model}}} has {data * model} processes, but the cluster has "
            f"{world_size}; give sizes whose product is {world_size}")
    return data, model


def _leave_solo_group() -> None:
    if dist.is_initialized():   # (a test may have left it already)
        dist.destroy_process_group()
