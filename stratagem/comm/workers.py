"""The hierarchical Collective: replica threads inside each worker, torch.distributed across.

A value is first combined among this process's replica threads (by the
:class:`~stratagem.comm.replicas.ReplicaCollective` the cross-device op configured),
then local replica 0 combines it with the other workers through the
:class:`~stratagem.comm.processes.WorkerGroup` (gloo on CPU, NCCL on CUDA), and the
result is handed back to the other local replicas. Gradients cross workers in packs
launched while backward still runs (:mod:`stratagem.comm.gradients`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm.collective import Collective
from stratagem.comm.gradients import GradientPacks
from stratagem.comm.options import CommunicationOptions
from stratagem.comm.processes import WorkerGroup
from stratagem.comm.replicas import ReplicaCollective, check_mean
from stratagem.errors import InvalidArgumentError
from stratagem.values import ReduceOp


class WorkerCollective(Collective):
    """Replica threads of this worker (``local``) joined with the other workers (``group``)."""

    def __init__(self, local: ReplicaCollective, group: WorkerGroup, options: CommunicationOptions):
        super().__init__(local.devices)
        self.local = local
        self.group = group
        self.options = options
        self.num_workers = group.world_size
        self.worker_index = group.rank
        # Among local replicas nothing changes: bind the local primitives directly (the
        # gradient path then reaches the arithmetic without an extra call).
        self.exchange = local.exchange
        self.sum_exchanged = local.sum_exchanged
        self._packs: dict[int, GradientPacks] = {}

    def start_run(self) -> None:
        self.local.start_run()

    def abort(self) -> None:
        self.local.abort()

    def finish(self, local_id: int) -> None:
        self.local.finish(local_id)

    # ------------------------------------------------------ replica context

    def all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
        check_mean(tensors, op)
        local = self.local.all_reduce(local_id, tensors, ReduceOp.SUM)
        if self.num_workers > 1:
            if local_id == 0 and local:
                if len({t.dtype for t in local}) == 1:  # one message for all of them
                    flat = torch.cat([t.reshape(-1) for t in local])
                    self.group.all_reduce(flat, "ReplicaContext.all_reduce")
                    offset = 0
                    for t in local:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                else:
                    for t in local:
                        self.group.all_reduce(t, "ReplicaContext.all_reduce")
            self._share_first(local_id, local, "all_reduce:workers")
        if op is ReduceOp.MEAN:
            n = self.num_replicas
            local = [t / n for t in local]
        return local

    def _share_first(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> None:
        """Local replicas 1.. copy local replica 0's ``tensors`` (after it talked to the workers)."""
        if self.num_local > 1:
            first = self.local.exchange(local_id, tensors, tag)[0]
            if local_id != 0:
                for t, t0 in zip(tensors, first):
                    t.copy_(t0)
            self.local.exchange(local_id, None, f"{tag} done")

    def exchange_all(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> list[Any]:
        local = self.local.exchange(local_id, tensors, tag)
        if self.num_workers == 1:
            return local
        everyone = None
        if local_id == 0:
            per_worker = self.group.all_gather_object(
                [[t.detach().cpu() for t in replica] for replica in local], f"ReplicaContext.{tag}")
            everyone = [replica for worker in per_worker for replica in worker]
        return self.local.exchange(local_id, everyone, f"{tag}:workers")[0]

    def gradient_packs(self, params: list[torch.Tensor]) -> GradientPacks:
        """The packs that sum ``params``' gradients over workers (made at the first step)."""
        key = id(params[0]) if params else 0
        packs = self._packs.get(key)
        if packs is None or not packs.covers(params):
            packs = GradientPacks(params, self.group, bytes_per_pack=self.options.bytes_per_pack,
                                  overlap=self.num_local == 1)
            self._packs[key] = packs
        return packs

    def share_gradients(self, local_id: int, params: list[torch.Tensor]) -> None:
        """Local replicas 1.. take local replica 0's gradients (summed over workers)."""
        if self.num_local > 1:
            everyone = self.local.exchange(local_id, params, "optimizer.step (cross-worker gradients)")
            if local_id != 0:
                for p, p0 in zip(params, everyone[0]):
                    if p0.grad is not None:
                        if p.grad is None:
                            p.grad = p0.grad.to(p.device, copy=True)
                        else:
                            p.grad.copy_(p0.grad)
            self.local.exchange(local_id, None, "optimizer.step (cross-worker gradients done)")

    # -------------------------------------------------------- process level

    def worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.num_workers == 1:
            return tensor
        group = self.group
        result = tensor.contiguous().clone()
        carrier = result if result.device == group.device else result.to(group.device)
        with group.guard("strategy.reduce"):
            dist.all_reduce(carrier, group=group.group)
        if carrier is not result:
            result.copy_(carrier)
        return result

    def worker_gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self.num_workers == 1:
            return tensor
        parts = self.group.all_gather_object(tensor.detach().cpu(), "strategy.gather")
        return torch.cat([p.to(tensor.device) for p in parts], dim=axis)

    def broadcast_object(self, value: Any) -> Any:
        return self.group.broadcast_object(value, "broadcast from the chief")

    def all_gather_object(self, value: Any, what: str = "all_gather") -> list[Any]:
        return self.group.all_gather_object(value, what)

    def agree_on_modules(self, modules: list[nn.Module]) -> None:
        tensors, described = [], []
        for module in modules:
            for kind in ("_parameters", "_buffers"):
                for name, tensor in dict.items(module.__dict__[kind]):
                    if tensor is not None:
                        tensors.append(tensor)
                        described.append((f"{type(module).__name__}.{name}", tuple(tensor.shape),
                                          str(tensor.dtype)))
        everyone = self.group.all_gather_object(described, "start-up parameter check")
        chief = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs != chief:
                self._raise_mismatch(chief, theirs, rank)
        if tensors:
            with torch.no_grad():
                for dtype in dict.fromkeys(t.dtype for t in tensors):
                    same = [t for t in tensors if t.dtype == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    self.group.broadcast(flat, "broadcast of the chief's initial parameters")
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def _raise_mismatch(self, chief: list, theirs: list, rank: int) -> None:
        names = self.group.names
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

    def close(self) -> None:
        self.group.close()

    def __repr__(self) -> str:
        return f"WorkerCollective({self.group.names[self.worker_index]} of {self.num_workers}, {self.local!r})"
