"""The default strategy: one replica, pass-through, a process-wide singleton.

``stratagem/__init__.py`` registers :meth:`_DefaultStrategy._create` with the context stack
(:func:`stratagem._context.set_default_strategy_factory`), loading this module on the first
``sg.get_strategy()`` outside every scope.
"""

from __future__ import annotations

from stratagem.comm.cross_device_ops import HierarchicalCopyAllReduce
from stratagem.comm.replicas import ReplicaCollective
from stratagem.devices import Device, Topology
from stratagem.errors import ContextError
from stratagem.placement.layout.mirrored import MirroredPlacement
from stratagem.strategies.base import Strategy
from stratagem.strategies.replica_context import ReplicaContext

_CREATING = object()


class _DefaultStrategy(Strategy):
    """What ``sg.get_strategy()`` returns outside every scope.

    Modules and optimizers created under it are left untouched (its scope installs
    nothing); ``run`` calls the function on the calling thread. Users cannot construct it.
    """

    is_default = True

    def __init__(self, _token: object = None):
        if _token is not _CREATING:
            raise ContextError(
                "the default strategy cannot be constructed; use sg.get_strategy() outside any "
                "scope to get it, or create a real strategy such as sg.OneDeviceStrategy('cpu')")
        topology = Topology((Device("cpu", 0),))
        collective = ReplicaCollective.create(topology.devices, HierarchicalCopyAllReduce())
        self._configure(topology, collective, MirroredPlacement(self, topology, collective))
        self._replica_context = ReplicaContext(self, 0, topology.devices[0], collective)

    @classmethod
    def _create(cls) -> "_DefaultStrategy":
        return cls(_CREATING)

    def default_replica_context(self) -> ReplicaContext:
        return self._replica_context

    def _result_device(self, value):
        # The default strategy places nothing: results stay where the value is.
        return value.device if hasattr(value, "device") else None

    def __repr__(self) -> str:
        return "DefaultStrategy()"

