"""Embedding lookups that move only the rows used when the table lives on parameter servers.

On a worker, the local copy of a row-sparse table (an ``nn.Embedding`` weight created in a
ParameterServerStrategy's scope) is an empty tensor that carries the worker's runtime
(its record's ``runtime``, set when the runtime made it): a lookup asks that runtime for the
rows of the batch, which records them so that ``optimizer.step()`` pushes their gradient
rows only. Everywhere else a lookup is ``F.embedding``. The functional lookup,
:func:`~stratagem.nn.embedding.embedding_lookup`, lives in ``nn/`` (re-exported here); this
module adds the ``nn.Embedding`` the parameter-server placement puts in a table's place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.nn.embedding import embedding_lookup, runtime_of
from stratagem.ps.variables import remote_of

__all__ = ["PSEmbedding", "embedding_lookup"]


class PSEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table lives on parameter servers (rows pulled on use)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        runtime = runtime_of(self.weight)
        if runtime is None:
            return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        small, positions = runtime.lookup(remote_of(self.weight), ids)
        return F.embedding(positions, small, None, self.max_norm, self.norm_type, self.scale_grad_by_freq)
