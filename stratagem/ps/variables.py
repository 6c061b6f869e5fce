"""Variables that live on parameter servers, as the coordinator and the workers see them.

A :class:`RemoteVariable` is the metadata of one logical variable (a parameter or a
buffer of a module created in a ParameterServerStrategy's scope): its id, shape,
dtype, and where its shards live (ps task, rows). Only this metadata travels with
a closure to a worker, never the values: a worker pulls the latest values before
each step and pushes gradients after it.

A :class:`ShardedVariable` is what a module holds, on the coordinator, for a
variable split into several shards along its first dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem._record import attach, record, record_of


@dataclass(frozen=True)
class Shard:
    """One piece of a variable: rows ``start:stop`` on ps task ``ps``, stored as ``shard_id``."""

    shard_id: str
    ps: int
    start: int
    stop: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard's rows of a logical-shaped tensor (a 0-d tensor is its own only shard)."""
        return tensor if tensor.dim() == 0 else tensor[self.start:self.stop]


@dataclass(frozen=True)
class RemoteVariable:
    """Where a logical variable lives."""

    var_id: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[Shard, ...]
    trainable: bool = True
    row_sparse: bool = False   # an embedding table: steps read and update only the rows they use

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def shard_of_rows(self, rows: torch.Tensor) -> list[tuple[Shard, torch.Tensor, torch.Tensor]]:
        """For each shard holding some of ``rows``: (shard, positions in ``rows``, local row ids)."""
        pieces = []
        for shard in self.shards:
            mask = (rows >= shard.start) & (rows < shard.stop)
            positions = mask.nonzero(as_tuple=True)[0]
            if positions.numel():
                pieces.append((shard, positions, rows[positions] - shard.start))
        return pieces


class ShardedVariable(nn.Parameter):
    """A parameter stored on several parameter servers, split along its first dimension.

    On the coordinator it behaves as the whole logical tensor; ``variables`` are its
    shards (views of it, in order), ``num_shards`` and ``shard_shapes`` describe the split.

    Example::

        import torch, stratagem as sg
        from stratagem.ps.variables import RemoteVariable, Shard, ShardedVariable
        v = ShardedVariable(torch.arange(6.).reshape(3, 2), RemoteVariable(
            "w", (3, 2), torch.float32, (Shard("w/0", 0, 0, 2), Shard("w/1", 1, 2, 3))))
        assert [tuple(s.shape) for s in v.variables] == [(2, 2), (1, 2)]
    """

    def __new__(cls, data: torch.Tensor, remote: RemoteVariable, requires_grad: bool = True):
        instance = super().__new__(cls, data, requires_grad)
        attach(instance, remote=remote)
        return instance

    @property
    def num_shards(self) -> int:
        return record(self).remote.num_shards

    @property
    def shard_shapes(self) -> list[tuple[int, ...]]:
        return [(s.stop - s.start, *self.shape[1:]) for s in record(self).remote.shards]

    @property
    def variables(self) -> tuple[torch.Tensor, ...]:
        """The shards, as views of the logical value (refreshed from the ps on read)."""
        return tuple(self.data[s.start:s.stop] for s in record(self).remote.shards)

    def __repr__(self) -> str:
        return (f"ShardedVariable(shape={list(self.shape)}, num_shards={self.num_shards}, "
                f"shard_shapes={self.shard_shapes})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_plain_parameter, (self.data.clone(), self.requires_grad))


def _plain_parameter(data: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=requires_grad)


def remote_of(tensor: torch.Tensor) -> RemoteVariable | None:
    """Where ``tensor`` lives on the parameter servers (its record's), None for another tensor."""
    found = record_of(tensor)
    return None if found is None else found.remote


def gradients_by_ps(params: Any) -> dict[int, dict[str, torch.Tensor]]:
    """The dense gradients of ``params``, cut per shard and grouped by ps task (one push each)."""
    per_ps: dict[int, dict[str, torch.Tensor]] = {}
    for p in params:
        remote = remote_of(p)
        if remote is None or remote.row_sparse or p.grad is None:
            continue
        for shard in remote.shards:
            per_ps.setdefault(shard.ps, {})[shard.shard_id] = shard.of(p.grad).contiguous()
    return per_ps
