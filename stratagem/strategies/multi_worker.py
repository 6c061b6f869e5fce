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
from stratagem.cluster.process_group import WorkerGroup
from stratagem.comm.gradients import GradientPacks
from stratagem.comm.options import CommunicationOptions
from stratagem.devices import Device, parse_devices
from stratagem.errors import InvalidArgumentError
from stratagem.strategies.local import LocalStrategy, _usable_cores
from stratagem.strategies.replica_context import ReplicaContext
from stratagem.values import ReduceOp


class MultiWorkerMirroredStrategy(LocalStrategy):
    """Synchronous data parallelism over the workers of a cluster.

    ``cluster_resolver=None`` reads TF_CONFIG, else torchrun's variables, else runs
    as a single worker. ``devices`` are this worker's local replicas (default: the
    GPU of this process under torchrun, every visible GPU otherwise, else one CPU).

    Run the same script on every worker, e.g.::

        stratagem launch --workers 2 train.py
        torchrun --nproc-per-node 2 train.py

    Example::

        import stratagem as sg
        strategy = sg.MultiWorkerMirroredStrategy()   # no cluster: one worker
        assert strategy.num_replicas_in_sync == 1
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None,
                 *, devices: Sequence["str | torch.device"] | None = None):
        resolver = resolve() if cluster_resolver is None else cluster_resolver
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise InvalidArgumentError(f"communication_options must be sg.CommunicationOptions, got {options!r}")
        local_devices = parse_devices(devices) if devices is not None else _default_worker_devices(resolver)
        self._resolver = resolver
        self._options = options
        if local_devices[0].is_cuda:
            torch.cuda.set_device(local_devices[0].torch_device)  # NCCL's device for this process
        self._group = WorkerGroup(resolver, options, uses_cuda=local_devices[0].is_cuda)
        super().__init__(local_devices)
        self._packs: dict[int, GradientPacks] = {}
        _limit_threads(resolver, self._group.world_size, local_devices)
        self._check_same_configuration()

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def _num_workers(self) -> int:
        return self._group.world_size

    @property
    def _worker_index(self) -> int:
        return self._group.rank

    @property
    def is_chief(self) -> bool:
        """Whether this worker saves checkpoints and writes summaries."""
        return self._group.is_chief

    # ------------------------------------------------------------- start-up

    def _configuration(self) -> dict[str, Any]:
        return {"strategy": type(self).__name__, "local replicas": len(self._devices),
                "device kind": self._devices[0].kind, "backend": self._group.backend,
                "bytes_per_pack": self._options.bytes_per_pack,
                "cross_device_ops": type(self._cross_device_ops).__name__}

    def _check_same_configuration(self) -> None:
        mine = self._configuration()
        everyone = self._group.all_gather_object(mine, "start-up configuration check")
        for rank, theirs in enumerate(everyone):
            for key in mine:
                if theirs.get(key) != everyone[0].get(key):
                    raise InvalidArgumentError(
                        f"the workers run different strategy configurations: {key} is "
                        f"{everyone[0].get(key)!r} on {self._group.names[0]} but {theirs.get(key)!r} on "
                        f"{self._group.names[rank]}; start every worker with the same strategy arguments")

    def _on_modules_placed(self, modules: list) -> None:
        tensors, described = [], []
        for module in modules:
            for kind in ("_parameters", "_buffers"):
                for name, tensor in dict.items(module.__dict__[kind]):
                    if tensor is not None:
                        tensors.append(tensor)
                        described.append((f"{type(module).__name__}.{name}", tuple(tensor.shape),
                                          str(tensor.dtype)))
        everyone = self._group.all_gather_object(described, "start-up parameter check")
        chief = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs != chief:
                self._raise_mismatch(chief, theirs, rank)
        if tensors:
            with torch.no_grad():
                for dtype in dict.fromkeys(t.dtype for t in tensors):
                    same = [t for t in tensors if t.dtype == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    self._group.broadcast(flat, "broadcast of the chief's initial parameters")
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def _raise_mismatch(self, chief: list, theirs: list, rank: int) -> None:
        names = self._group.names
        for i, (a, b) in enumerate(zip(chief, theirs)):
            if a != b:
                raise InvalidArgumentError(
                    f"the workers created different models: tensor #{i} created in scope is {a[0]} "
                    f"of shape {list(a[1])} ({a[2]}) on {names[0]} but {b[0]} of shape {list(b[1])} "
                    f"({b[2]}) on {names[rank]}; every worker must build the same model")
        longer, shorter = (names[0], names[rank]) if len(chief) > len(theirs) else (names[rank], names[0])
        extra = (chief if len(chief) > len(theirs) else theirs)[min(len(chief), len(theirs))]
        raise InvalidArgumentError(
            f"the workers created different models: {longer} created {max(len(chief), len(theirs))} "
            f"tensors in scope but {shorter} only {min(len(chief), len(theirs))}; the first extra one "
            f"is {extra[0]} of shape {list(extra[1])}; every worker must build the same model")

    # ------------------------------------------------------------ gradients

    def _cross_worker_gradients(self, ctx: ReplicaContext, params: list[torch.Tensor]) -> None:
        if self._num_workers == 1:
            return
        if ctx._local_id == 0:
            packs = self._packs_for(params)
            packs.finish()
        if len(self._devices) > 1:
            everyone = ctx._exchange(params, "optimizer.step (cross-worker gradients)")
            if ctx._local_id != 0:
                for p, p0 in zip(params, everyone[0]):
                    if p0.grad is not None:
                        if p.grad is None:
                            p.grad = p0.grad.to(p.device, copy=True)
                        else:
                            p.grad.copy_(p0.grad)
            ctx._exchange(None, "optimizer.step (cross-worker gradients done)")

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if not set_to_none:  # gradients may be views of packs: detach them from the packs first
            for twin in self._placement.twins(optimizer):
                for group in twin.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad = torch.zeros_like(p)
            return
        super()._optimizer_zero_grad(optimizer, set_to_none)

    def _packs_for(self, params: list[torch.Tensor]) -> GradientPacks:
        key = id(params[0]) if params else 0
        packs = self._packs.get(key)
        if packs is None or not packs.covers(params):
            packs = GradientPacks(params, self._group, bytes_per_pack=self._options.bytes_per_pack,
                                  overlap=len(self._devices) == 1)
            self._packs[key] = packs
        return packs

    # ---------------------------------------------------------- collectives

    def _cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._num_workers == 1:
            return tensor
        return self._group.all_reduce(tensor.contiguous().clone(), "strategy.reduce")

    def _broadcast_from_chief(self, value: Any) -> Any:
        return self._group.broadcast_object(value, "broadcast from the chief")

    def _cross_worker_gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self._num_workers == 1:
            return tensor
        parts = self._group.all_gather_object(tensor.detach().cpu(), "strategy.gather")
        return torch.cat([p.to(tensor.device) for p in parts], dim=axis)

    def _replica_all_reduce(self, ctx: ReplicaContext, op: ReduceOp, tensors: list) -> list:
        local = self._cross_device_ops.all_reduce(self._sync, ctx._local_id, tensors, ReduceOp.SUM, inplace=False)
        if self._num_workers > 1:
            if ctx._local_id == 0 and local:
                flat = torch.cat([t.reshape(-1).to(local[0].dtype) for t in local]) \
                    if len({t.dtype for t in local}) == 1 else None
                if flat is not None:
                    self._group.all_reduce(flat, "ReplicaContext.all_reduce")
                    offset = 0
                    for t in local:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                else:
                    for t in local:
                        self._group.all_reduce(t, "ReplicaContext.all_reduce")
            if len(self._devices) > 1:
                first = ctx._exchange(local, "all_reduce:workers")[0]
                if ctx._local_id != 0:
                    for t, t0 in zip(local, first):
                        t.copy_(t0)
                ctx._exchange(None, "all_reduce:workers done")
        if op is ReduceOp.MEAN:
            local = [t / self.num_replicas_in_sync if t.is_floating_point() or t.is_complex()
                     else t // self.num_replicas_in_sync for t in local]
        return local

    def _replica_exchange(self, ctx: ReplicaContext, tensors: list, tag: str) -> list:
        local = ctx._exchange(tensors, tag)
        if self._num_workers == 1:
            return local
        if ctx._local_id == 0:
            per_worker = self._group.all_gather_object(
                [[t.detach().cpu() for t in replica] for replica in local], f"ReplicaContext.{tag}")
            everyone = [replica for worker in per_worker for replica in worker]
        else:
            everyone = None
        return ctx._exchange(everyone, f"{tag}:workers")[0]

    def _replica_all_gather(self, ctx: ReplicaContext, tensors: list, axis: int) -> list:
        everyone = self._replica_exchange(ctx, tensors, "all_gather")
        device = ctx._device
        return [torch.cat([e[i].to(device) for e in everyone], dim=axis) for i in range(len(tensors))]

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy({self._group.names[self._group.rank]} of "
                f"{self._group.world_size} workers, devices={list(self.worker_devices)})")


def _default_worker_devices(resolver: Any) -> tuple[Device, ...]:
    count = torch.cuda.device_count()
    if not count:
        return (Device("cpu", 0),)
    local_rank = getattr(resolver, "local_rank", None)
    if local_rank is not None and type(resolver).__name__ == "TorchrunClusterResolver":
        return (Device("cuda", local_rank % count),)
    return tuple(Device("cuda", i) for i in range(count))


def _limit_threads(resolver: Any, world_size: int, devices: tuple[Device, ...]) -> None:
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
