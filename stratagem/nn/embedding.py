"""The embedding lookup that moves only the rows used when the table lives on parameter servers.

The lookup asks the table's record (:mod:`stratagem._record`), not the parameter-server
package: a worker's local copy of a row-sparse table (an ``nn.Embedding`` weight created in a
ParameterServerStrategy's scope) carries the worker's runtime, which pulls the rows of the
batch and records them so that ``optimizer.step()`` pushes their gradient rows only. Every
other table is looked up with ``F.embedding``. So the loss helpers' package, which the core
imports, loads nothing of ``stratagem.ps``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stratagem._record import record_of

__all__ = ["embedding_lookup", "runtime_of"]


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
    runtime = runtime_of(params)
    if runtime is None:
        return F.embedding(ids, params)
    small, positions = runtime.lookup(record_of(params).remote, ids)
    return F.embedding(positions, small)


def runtime_of(table: torch.Tensor) -> Any:
    """The worker's runtime a table's local copy carries (``ps.runtime.WorkerRuntime``), None elsewhere."""
    found = record_of(table)
    return None if found is None else found.runtime
