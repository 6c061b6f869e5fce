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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stratagem import _context   # the context stack alone: no torch

__version__ = "0.1.0"

# Every public name loads on first use (PEP 562), so ``import stratagem`` costs nothing until
# a name is read: the command line (``stratagem launch``) starts its tasks without paying for
# torch, and grpc/cryptography load only once a parameter-server feature is used.
# name -> the module that defines it (a name equal to its module's last part is the module).
_EXPORTS: dict[str, str] = {
    # contexts
    "get_replica_context": "stratagem._context", "get_strategy": "stratagem._context",
    "has_strategy": "stratagem._context", "in_cross_replica_context": "stratagem._context",
    # strategies and their configuration
    "Strategy": "stratagem.strategies.base",
    "experimental_set_strategy": "stratagem.strategies.set_strategy",
    "OneDeviceStrategy": "stratagem.strategies.one_device",
    "MirroredStrategy": "stratagem.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "stratagem.strategies.multi_worker",
    "CentralStorageStrategy": "stratagem.strategies.central_storage",
    "ParameterServerStrategy": "stratagem.ps.strategy",
    "ClusterCoordinator": "stratagem.ps.coordinator", "RemoteValue": "stratagem.ps.remote_value",
    "ReplicaContext": "stratagem.strategies.replica_context",
    "CrossDeviceOps": "stratagem.comm.cross_device_ops",
    "HierarchicalCopyAllReduce": "stratagem.comm.cross_device_ops",
    "NcclAllReduce": "stratagem.comm.cross_device_ops",
    "ReductionToOneDevice": "stratagem.comm.cross_device_ops",
    "RingAllReduce": "stratagem.comm.cross_device_ops",
    "CommunicationImplementation": "stratagem.comm.options",
    "CommunicationOptions": "stratagem.comm.options",
    # values and input
    "DistributedValues": "stratagem.values", "PerReplica": "stratagem.values", "ReduceOp": "stratagem.values",
    "AutoShardPolicy": "stratagem.data.input", "InputContext": "stratagem.data.input",
    "InputOptions": "stratagem.data.input", "ValueContext": "stratagem.data.input",
    # parameter-server variables
    "FixedShardsPartitioner": "stratagem.ps.partitioners", "MaxSizePartitioner": "stratagem.ps.partitioners",
    "MinSizePartitioner": "stratagem.ps.partitioners", "ShardedVariable": "stratagem.ps.variables",
    # long jobs
    "Checkpoint": "stratagem.checkpoint", "CheckpointManager": "stratagem.checkpoint",
    "latest_checkpoint": "stratagem.checkpoint",
    "PreemptionWatcher": "stratagem.preemption",
    "SidecarEvaluator": "stratagem.keras.sidecar",
    # Keras-style training
    "Model": "stratagem.keras.model", "losses": "stratagem.keras.losses", "models": "stratagem.models",
    "mixed_precision": "stratagem.mixed_precision",
    # submodules
    "callbacks": "stratagem.callbacks", "cluster": "stratagem.cluster", "errors": "stratagem.errors",
    "nn": "stratagem.nn",
    "metrics": "stratagem.metrics",   # (its classes load torchmetrics on first use)
    "experimental": "stratagem.experimental",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rpartition(".")[2] == name else getattr(module, name)
    globals()[name] = value          # the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _make_default_strategy() -> Any:
    # What sg.get_strategy() returns outside every scope, built on that first call. Registered
    # here because every import of a stratagem module runs this file first, and the context
    # stack sits below the strategies (it cannot import the one it falls back to).
    from stratagem.strategies.default import _DefaultStrategy

    return _DefaultStrategy._create()


_context.set_default_strategy_factory(_make_default_strategy)


if TYPE_CHECKING:   # what the names are, for type checkers and editors
    from stratagem import callbacks, cluster, errors, experimental, metrics, mixed_precision, models, nn
    from stratagem._context import get_replica_context, get_strategy, has_strategy, in_cross_replica_context
    from stratagem.comm.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                                 ReductionToOneDevice)
    from stratagem.comm.cross_device_ops import RingAllReduce
    from stratagem.comm.options import CommunicationImplementation, CommunicationOptions
    from stratagem.ps.coordinator import ClusterCoordinator
    from stratagem.ps.remote_value import RemoteValue
    from stratagem.data.input import AutoShardPolicy, InputContext, InputOptions, ValueContext
    from stratagem.preemption import PreemptionWatcher
    from stratagem.ps.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
    from stratagem.ps.strategy import ParameterServerStrategy
    from stratagem.ps.variables import ShardedVariable
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.central_storage import CentralStorageStrategy
    from stratagem.strategies.mirrored import MirroredStrategy
    from stratagem.strategies.multi_worker import MultiWorkerMirroredStrategy
    from stratagem.strategies.one_device import OneDeviceStrategy
    from stratagem.strategies.replica_context import ReplicaContext
    from stratagem.strategies.set_strategy import experimental_set_strategy
    from stratagem.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
    from stratagem.keras import losses
    from stratagem.keras.model import Model
    from stratagem.keras.sidecar import SidecarEvaluator
    from stratagem.values import DistributedValues, PerReplica, ReduceOp
