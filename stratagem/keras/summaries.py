"""Scalar summaries for TensorBoard, through ``torch.utils.tensorboard`` (the ``tensorboard`` package).

The package is optional: :func:`summary_writer` says how to install it when it is missing.
"""

from __future__ import annotations

import os
from typing import Any

from stratagem.errors import MissingDependencyError

__all__ = ["summary_writer", "write_scalars"]


def summary_writer(log_dir: "str | os.PathLike") -> Any:
    """A ``SummaryWriter`` for ``log_dir``; a clear error when ``tensorboard`` is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise MissingDependencyError(
            f"summaries for TensorBoard need the tensorboard package ({err}); install it with "
            f"`pip install tensorboard` (or `pip install stratagem[tensorboard]`)") from None
    return SummaryWriter(log_dir=os.fspath(log_dir))


def write_scalars(writer: Any, prefix: str, values: dict, step: int) -> None:
    """Write every number of ``values`` as ``<prefix><name>`` at ``step``; skip what is not a number."""
    for name, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        writer.add_scalar(f"{prefix}{name}", number, step)
    writer.flush()
