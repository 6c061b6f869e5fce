"""ClusterCoordinator, its closure queue and RemoteValue: parameter-server training's coordinator side.

What travels with a closure and what runs it on a worker are in :mod:`stratagem.ps`.
"""

from stratagem.coordinator.coordinator import ClusterCoordinator
from stratagem.coordinator.values import RemoteValue, RemoteValueStatus
from stratagem.ps.closures import PerWorkerDataset, PerWorkerIterator

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator", "RemoteValue", "RemoteValueStatus"]
