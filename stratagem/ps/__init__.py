"""The parameter-server side of ParameterServerStrategy: variables, optimizers, partitioners.

- :class:`ParameterServer` (``service.py``) -- the variables of one ps task by id, each an
  ``nn.Parameter`` with its own ``torch.optim`` optimizer; pull / push (dense and
  row-sparse) / assign / get_state / set_state; :meth:`ParameterServer.handlers` serves it
  over :mod:`stratagem.rpc`;
- :class:`ParameterServerClient` (``client.py``) -- the same methods, called over RPC;
- ``sparse_update.py`` -- torch.optim's SGD, Adagrad and Adam(W) applied to touched rows only;
- ``partitioners.py`` -- TensorFlow's FixedShards / MinSize / MaxSize partitioners and the
  row split of shards (:func:`shard_sizes`).

``stratagem server`` with a ps TF_CONFIG runs a ParameterServer (see
:func:`ps_service`, the factory registered for task type "ps").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.partitioners import (FixedShardsPartitioner, MaxSizePartitioner,
                                       MinSizePartitioner, Partitioner, shard_offsets, shard_sizes)
from stratagem.ps.service import OptimizerSpec, ParameterServer
from stratagem.ps.sparse_update import SUPPORTED_OPTIMIZERS as SPARSE_OPTIMIZERS

if TYPE_CHECKING:
    from stratagem.server import TaskInfo

__all__ = [
    "FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "OptimizerSpec",
    "ParameterServer", "ParameterServerClient", "Partitioner", "SPARSE_OPTIMIZERS",
    "call_each", "ps_service", "shard_offsets", "shard_sizes",
]


def ps_service(task: TaskInfo) -> ParameterServer:
    """The service factory of task type "ps" for ``stratagem server``: a fresh, empty
    ParameterServer named after the task."""
    return ParameterServer(name=task.name)
