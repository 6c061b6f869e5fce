"""Exceptions raised by stratagem.

Every error subclasses :class:`StratagemError`, and also ``ValueError``, ``RuntimeError`` or
``ImportError`` (a missing optional package) where one of those fits, so that ``except
ValueError`` around a call that validates user input keeps working.

Example::

    import stratagem as sg
    try:
        sg.MirroredStrategy(devices=[])
    except sg.errors.StratagemError as err:
        print(err)
"""

from __future__ import annotations


class StratagemError(Exception):
    """Base class of every error stratagem raises on purpose."""


class InvalidArgumentError(StratagemError, ValueError):
    """An argument has the wrong value: the message names it and the fix."""


class InvalidDeviceError(InvalidArgumentError):
    """A device name could not be parsed or names a device this machine lacks."""


class ContextError(StratagemError, RuntimeError):
    """A call was made from the wrong context (replica vs cross-replica, wrong scope)."""


class CollectiveMismatchError(StratagemError, RuntimeError):
    """Replicas called different collectives, or one returned while others waited."""


class ClusterConfigError(InvalidArgumentError):
    """A cluster description (TF_CONFIG, torchrun variables, ClusterSpec) is malformed."""


class UnavailableError(StratagemError, RuntimeError):
    """A peer task (worker, parameter server) died or stopped answering."""

    def __init__(self, message: str, task: str | None = None):
        super().__init__(message)
        self.task = task


class CheckpointError(StratagemError, RuntimeError):
    """A checkpoint is corrupt or does not match what is being restored."""


class MissingDependencyError(StratagemError, ImportError):
    """An optional package a feature needs is not installed: the message names the pip command."""
