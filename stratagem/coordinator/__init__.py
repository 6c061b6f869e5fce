"""ClusterCoordinator, closures and RemoteValue: parameter-server training's coordinator side."""

from stratagem.coordinator.coordinator import ClusterCoordinator, PerWorkerDataset, PerWorkerIterator
from stratagem.coordinator.values import RemoteValue, RemoteValueStatus

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator", "RemoteValue", "RemoteValueStatus"]
