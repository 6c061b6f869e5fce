"""Embedding lookups that move only the rows used when the table lives on parameter servers.

On a worker, the local copy of a row-sparse table (an ``nn.Embedding`` weight created in a
ParameterServerStrategy's scope) is an empty tensor that carries the worker's runtime
(its record's ``runtime``, set when the runtime made it): a lookup asks that runtime for the
rows of the batch, which records them so that ``optimizer.step()`` pushes their gradient
rows only. Everywhere else a lookup is ``F.embedding``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem._record import record_of
from stratagem.ps.variables import remote_of

__all__ = ["PSEmbedding", "embedding_lookup"]


def embedding_lookup(params: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the table ``params`` (``F.embedding(ids, params)``).

    Inside a step scheduled by a ParameterServerStrategy's coordinator, the table of an
    ``nn.Embedding`` created in scope is not copied to the worker: only the rows in
    ``ids`` are pulled from the parameter servers, and only their gradient rows are
    pushed by ``optimizer.step()``. Elsewhere it is an ordinary lookup.

    Example::

        import torch, stratagem as sg
        table = torch.arange(12.).reshape(6, 2)
        assert sg.nn.embedding_lookup(table, torch.tensor([5, 0])).tolist() == [[10., 11.], [0., 1.]]
    """
    runtime = _runtime_of(params)
    if runtime is None:
        return F.embedding(ids, params)
    small, positions = runtime.lookup(remote_of(params), ids)
    return F.embedding(positions, small)


def _runtime_of(table: torch.Tensor) -> Any:
    """The worker's runtime a table's local copy carries, None elsewhere."""
    found = record_of(table)
    return None if found is None else found.runtime


class PSEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table lives on parameter servers (rows pulled on use)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        runtime = _runtime_of(self.weight)
        if runtime is None:
            return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        small, positions = runtime.lookup(remote_of(self.weight), ids)
        return F.embedding(positions, small, None, self.max_norm, self.norm_type, self.scale_grad_by_freq)
