"""Parameter-server training, in one folder: the strategy, the ps service, the worker.

On the coordinator (the user's script):

- ``strategy.py`` -- :class:`ParameterServerStrategy`, the strategy's hooks;
- ``placement.py`` -- where scoped variables live (created on the ps, sharded by a
  partitioner), and what scope does to modules and optimizers;
- ``closures.py`` -- how a scheduled function travels: variables, optimizers and
  per-worker iterators by reference (a pickler on the coordinator, an unpickler on the
  worker); :class:`~stratagem.ClusterCoordinator` (``coordinator.py``) sends them;
- ``coordinator.py`` -- the coordinator; its threads, a dispatcher per worker
  (``dispatcher.py``, fed from ``closure_queue.py``) and the ps watchdog (``health.py``),
  reach it only through the ``CoordinatorLink`` it hands them (``coordinator_link.py``), a
  :class:`RemoteValue` (``remote_value.py``) through the ``check`` callback it is given;
  ``fit_loop.py`` is ``Model.fit`` scheduled through it.

On the servers (``stratagem server``, ``server.py``, serves one task from TF_CONFIG):

- ``service.py`` -- :class:`ParameterServer`, the variables of one ps task, each with its
  ``torch.optim`` optimizer; ``shards.py`` -- one such variable (value, optimizer, lock) and
  the checks of what workers send for it; ``sparse_update.py`` applies SGD, Adagrad and
  Adam(W) to the touched rows only;
- ``worker.py`` -- :class:`~stratagem.ps.worker.WorkerService`, which runs closures with the
  worker's ``runtime.py`` (local copies of variables, pulls and pushes, datasets).

Who drives the servers: ``ownership.py`` (on a ps: its owner, the coordinator whose requests
it applies, and how a new one takes over) and ``tenure.py`` (on the coordinator: claiming every
ps, renewing the claim, being refused while another live coordinator holds them).

Shared: ``client.py`` (:class:`ParameterServerClient`, :func:`call_each`), ``variables.py``
(where a variable lives; :class:`ShardedVariable`), ``partitioners.py`` (TensorFlow's
FixedShards / MinSize / MaxSize partitioners), ``embedding.py`` (the lookup that moves only
the rows used).

The names below load their modules on first use, so that ``import stratagem`` does not
import gRPC and cryptography (they come with the client and the service).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CoordinatorConflictError", "FencedError", "FixedShardsPartitioner", "MaxSizePartitioner",
    "MinSizePartitioner", "OptimizerSpec", "ParameterServer", "ParameterServerClient",
    "ParameterServerStrategy", "Partitioner", "ShardedVariable", "call_each", "shard_sizes",
]

_MODULES = {
    "FixedShardsPartitioner": "partitioners", "MaxSizePartitioner": "partitioners",
    "MinSizePartitioner": "partitioners", "Partitioner": "partitioners", "shard_sizes": "partitioners",
    "OptimizerSpec": "shards", "ParameterServer": "service",
    "ParameterServerClient": "client", "call_each": "client",
    "ParameterServerStrategy": "strategy", "ShardedVariable": "variables",
    "CoordinatorConflictError": "ownership", "FencedError": "ownership",
}


def __getattr__(name: str) -> Any:
    # PEP 562: grpc and cryptography are heavy and only needed once a ps feature is used
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'stratagem.ps' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stratagem.ps.{module}"), name)
