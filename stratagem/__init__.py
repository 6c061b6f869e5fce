"""stratagem: TensorFlow's ``tf.distribute.Strategy`` system for PyTorch.

Write the model and the training step once; choose where it runs with one line,
the strategy.

Glossary (TensorFlow's vocabulary):

- *replica*: one copy of the model computing on one slice of each global batch.
- *device*: where a replica computes: ``"cuda:0"``, or a logical CPU device
  ``"cpu:0"``, ``"cpu:1"`` (several replicas on the host CPU).
- *worker*: a process running replicas; several workers form a cluster.
- *scope*: ``with strategy.scope():`` — modules and optimizers created inside are
  distributed by the strategy.
- *replica context*: inside ``strategy.run(fn)``, where ``fn`` runs once per
  replica; ``sg.get_replica_context()`` gives the :class:`ReplicaContext`.
- *cross-replica context*: inside a scope, outside ``run``: the code that sees
  every replica at once (``strategy.reduce``, ``strategy.gather``).
- *PerReplica*: a value with one component per local replica.
- *merge_call*: a pause in which every replica hands its value to one function
  that runs once, in cross-replica context.

Example::

    import torch, stratagem as sg
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    print(strategy.num_replicas_in_sync)   # 2
"""

import importlib

from stratagem import errors
from stratagem._context import get_replica_context, get_strategy, has_strategy, in_cross_replica_context
from stratagem.comm.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                             ReductionToOneDevice)
from stratagem.comm.options import CommunicationImplementation, CommunicationOptions
from stratagem.data.input import AutoShardPolicy, InputContext, InputOptions, ValueContext
from stratagem.strategies import default as _default  # noqa: F401 - registers the default strategy
from stratagem.strategies.base import Strategy
from stratagem.strategies.mirrored import MirroredStrategy
from stratagem.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.strategies.one_device import OneDeviceStrategy
from stratagem.strategies.replica_context import ReplicaContext
from stratagem.values import DistributedValues, PerReplica, ReduceOp
from stratagem.ps.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
from stratagem.ps.variables import ShardedVariable
from stratagem.preemption import PreemptionWatcher
from stratagem.training import Checkpoint, CheckpointManager
from stratagem.training.model import Model
from stratagem.training import losses
from stratagem import callbacks, cluster, nn

__version__ = "0.1.0"

__all__ = [
    "AutoShardPolicy", "Checkpoint", "CheckpointManager", "ClusterCoordinator", "CommunicationImplementation",
    "CommunicationOptions", "CrossDeviceOps", "DistributedValues", "FixedShardsPartitioner", "HierarchicalCopyAllReduce",
    "InputContext", "InputOptions", "MaxSizePartitioner", "MinSizePartitioner", "MirroredStrategy",
    "MultiWorkerMirroredStrategy", "NcclAllReduce", "OneDeviceStrategy", "ParameterServerStrategy",
    "PerReplica", "PreemptionWatcher", "ReduceOp", "ReductionToOneDevice", "RemoteValue",
    "ReplicaContext", "ShardedVariable",
    "Strategy", "ValueContext", "callbacks", "cluster", "errors", "get_replica_context", "get_strategy",
    "has_strategy", "in_cross_replica_context", "nn",
    "Model", "losses",
    "metrics",
]

# PEP 562: the parameter-server names load on first use, with grpc and cryptography (heavy,
# and only needed once a ps feature is used).
_LAZY = {"ClusterCoordinator": "stratagem.coordinator", "RemoteValue": "stratagem.coordinator",
         "ParameterServerStrategy": "stratagem.ps.strategy"}
# Subpackages loaded on first use: sg.metrics imports torchmetrics (~0.5 s and more).
_LAZY_MODULES = {"metrics": "stratagem.metrics"}


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
