"""Options that say how replicas' values travel between processes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from stratagem.errors import InvalidArgumentError


class CommunicationImplementation(enum.Enum):
    """Which collective library carries cross-worker traffic (TensorFlow's names).

    ``RING`` is the gloo ring on CPU, ``NCCL`` is NCCL on CUDA, ``AUTO`` picks per
    device kind.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """How a multi-worker strategy communicates.

    Example::

        import stratagem as sg
        opts = sg.CommunicationOptions(bytes_per_pack=32 << 20, timeout_seconds=120)
    """

    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        impl = self.implementation
        if isinstance(impl, str):
            try:
                impl = CommunicationImplementation[impl.upper()]
            except KeyError:
                impl = None
            object.__setattr__(self, "implementation", impl)
        if not isinstance(self.implementation, CommunicationImplementation):
            raise InvalidArgumentError(
                f"implementation must be one of {[m.name for m in CommunicationImplementation]}, "
                f"got {impl!r}")
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise InvalidArgumentError(
                f"bytes_per_pack must be an integer >= 0 (0 picks a default), got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise InvalidArgumentError(
                f"timeout_seconds must be positive or None, got {self.timeout_seconds!r}")
