"""The default strategy: one replica, pass-through, a process-wide singleton."""

from __future__ import annotations

from stratagem.devices import Device
from stratagem.errors import ContextError
from stratagem.strategies.local import LocalStrategy
from stratagem.strategies.replica_context import ReplicaContext

_CREATING = object()


class _DefaultStrategy(LocalStrategy):
    """What ``sg.get_strategy()`` returns outside every scope.

    Modules and optimizers created under it are left untouched; ``run`` calls the
    function on the calling thread. Users cannot construct it.
    """

    _is_default = True

    def __init__(self, _token: object = None):
        if _token is not _CREATING:
            raise ContextError(
                "the default strategy cannot be constructed; use sg.get_strategy() outside any "
                "scope to get it, or create a real strategy such as sg.OneDeviceStrategy('cpu')")
        super().__init__((Device("cpu", 0),))
        self._replica_context = ReplicaContext(self, 0, 0, None)

    @classmethod
    def _create(cls) -> "_DefaultStrategy":
        return cls(_CREATING)

    def _default_replica_context(self) -> ReplicaContext:
        return self._replica_context

    def _result_device(self, value):
        # The default strategy places nothing: results stay where the value is.
        return value.device if hasattr(value, "device") else None

    def __repr__(self) -> str:
        return "DefaultStrategy()"
