"""Embedding lookups that move only the rows used when the table lives on parameter servers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    from stratagem.coordinator.worker import runtime

    remote = getattr(params, "_sg_remote", None)
    worker = runtime()
    if worker is not None and remote is not None and remote.row_sparse:
        small, positions = worker.lookup(remote, ids)
        return F.embedding(positions, small)
    return F.embedding(ids, params)
