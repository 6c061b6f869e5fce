"""Options that say how replicas' values travel between processes."""

from __future__ import annotations

import enum
import warnings
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


#: ``compression=`` values: how the gradient sums between workers travel (docs/collectives.md)
COMPRESSIONS = ("bf16", "fp16", "powersgd")


@dataclass(frozen=True)
class CommunicationOptions:
    """How a multi-worker strategy communicates.

    ``compression`` trades the exactness of the gradient sum between workers for fewer bytes on
    a slow link (opt-in; None, the default, sums exactly): ``"bf16"`` / ``"fp16"`` send each
    worker's gradient in half precision, ``"powersgd"`` sends a rank-``powersgd_rank`` (default 1)
    approximation of each matrix-shaped gradient and keeps the error for the next step
    (:mod:`stratagem.comm.compression`). ``powersgd_start_step`` (default 0) sums the first that
    many steps exactly before PowerSGD starts, as ``start_powerSGD_iter`` does for
    DistributedDataParallel's PowerSGD hook. Only the sums at the end of ``backward()`` are
    compressed, never a collective the user calls.

    Example::

        import stratagem as sg
        opts = sg.CommunicationOptions(bytes_per_pack=32 << 20, timeout_seconds=120)
        slow_link = sg.CommunicationOptions(compression="powersgd", powersgd_rank=4)
        assert sg.CommunicationOptions(compression="powersgd").powersgd_rank == 1
        like_ddp = sg.CommunicationOptions(compression="powersgd", powersgd_start_step=1000)
        assert like_ddp.compression_settings == ("powersgd", 1, 1000)
    """

    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    compression: str | None = None
    powersgd_rank: int | None = None
    powersgd_start_step: int | None = None

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
        self._check_compression()

    def _check_compression(self) -> None:
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise InvalidArgumentError(
                f"compression must be None (exact sums) or one of {list(COMPRESSIONS)}, got {self.compression!r}")
        # (name, default, least, what it is): PowerSGD's own settings, refused with another compression
        settings = (("powersgd_rank", 1, 1, "the rank of each compressed gradient's approximation; 1 sends "
                     "the fewest bytes"),
                    ("powersgd_start_step", 0, 0, "the steps summed exactly before PowerSGD starts; 0 "
                     "compresses from the first"))
        for name, default, least, meaning in settings:
            value = getattr(self, name)
            if self.compression != "powersgd":
                if value is not None:
                    raise InvalidArgumentError(
                        f"{name}={value!r} is given but compression is {self.compression!r}; pass "
                        f"compression='powersgd' with it, or leave {name} out")
            elif value is None:
                object.__setattr__(self, name, default)
            elif isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(f"{name} must be an integer >= {least} ({meaning}), got {value!r}")

    @property
    def compression_settings(self) -> tuple[str | None, int | None, int | None]:
        """``(compression, powersgd_rank, powersgd_start_step)``: what every worker must agree on."""
        return self.compression, self.powersgd_rank, self.powersgd_start_step


def check_compression(options: CommunicationOptions | None, *, sharding: str | None = None,
                      num_workers: int | None = None, strategy: str = "the strategy") -> None:
    """Refuse ``compression`` where gradients are not all-reduced whole (ZeRO-2, ZeRO-3); warn where
    there is one worker (``num_workers``; the same script may run on more)."""
    if options is None or options.compression is None:
        return
    if sharding in ("gradients", "parameters"):
        raise InvalidArgumentError(
            f"compression={options.compression!r} compresses the all-reduce of whole gradients, but "
            f"sharding={sharding!r} reduce-scatters them and never makes that all-reduce; use "
            f"sharding='optimizer' (or None) with compression, or leave compression out")
    if num_workers == 1:
        warnings.warn(f"compression={options.compression!r} has nothing to compress: {strategy} has one "
                      f"worker on its data axis, so gradients are never sent and stay exact", stacklevel=3)
