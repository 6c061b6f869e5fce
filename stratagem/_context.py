"""The thread-local context stack behind ``get_strategy`` and ``get_replica_context``.

Every thread has its own stack of frames. ``strategy.scope()`` pushes a frame with
no replica context (cross-replica context); ``strategy.run`` pushes, on each replica's
thread, a frame carrying that replica's :class:`~stratagem.ReplicaContext`. With an
empty stack a thread is in the default strategy's replica context.

Nothing here is shared between threads, so replica threads never clobber each
other's state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol


class ReplicaContext(Protocol):
    """What the stack holds for a replica (:class:`stratagem.ReplicaContext` is one)."""

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index among the replicas in sync."""

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas compute each step together."""


class Strategy(Protocol):
    """What the stack needs of a strategy (:class:`stratagem.Strategy` is one). Declared here
    so that this module, which every layer reads, imports none of them."""

    is_default: bool

    def default_replica_context(self) -> ReplicaContext:
        """The replica context a thread is in when no ``run`` is active."""

    def outside_replica_context(self) -> "ReplicaContext | None":
        """The replica code outside ``run`` acts as: this process's one replica, else None."""


@dataclass(frozen=True)
class _Frame:
    strategy: "Strategy"
    replica_context: "ReplicaContext | None"


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = []


_state = _ThreadState()
_default: dict[str, Any] = {}   # "factory": set by stratagem/__init__.py; "strategy": made on first use


def push(strategy: "Strategy", replica_context: "ReplicaContext | None") -> None:
    _state.stack.append(_Frame(strategy, replica_context))


def pop() -> None:
    _state.stack.pop()


def depth() -> int:
    """How many frames this thread's stack holds."""
    return len(_state.stack)


def current_frame() -> _Frame | None:
    stack = _state.stack
    return stack[-1] if stack else None


def set_default_strategy_factory(factory: Callable[[], "Strategy"]) -> None:
    """Called once, by the package's ``__init__`` (which every import of this module runs first):
    the default strategy is built on top of this module, so this module cannot import it."""
    _default["factory"] = factory


def default_strategy() -> "Strategy":
    strategy = _default.get("strategy")
    if strategy is None:
        strategy = _default.setdefault("strategy", _default["factory"]())
    return strategy


def get_strategy() -> "Strategy":
    """The strategy whose scope is active on this thread, else the default strategy.

    Example::

        import stratagem as sg
        assert sg.get_strategy() is sg.get_strategy()   # the default singleton
        s = sg.OneDeviceStrategy("cpu")
        with s.scope():
            assert sg.get_strategy() is s
    """
    frame = current_frame()
    return frame.strategy if frame is not None else default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy's scope is active on this thread."""
    frame = current_frame()
    return frame is not None and not frame.strategy.is_default


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope but outside ``strategy.run``."""
    frame = current_frame()
    return frame is not None and frame.replica_context is None


def acting_replica_context() -> "ReplicaContext | None":
    """The replica that code on this thread computes for: inside ``run``, its replica; outside
    ``run``, in the scope of a strategy whose process holds exactly one replica, that replica
    (the step written without ``run``, as under DistributedDataParallel); outside every scope,
    the default strategy's; else None (several replicas in this process, outside ``run``).

    Unlike :func:`get_replica_context` (TensorFlow's: None in cross-replica context), this is
    what the loss helpers scale for.
    """
    frame = current_frame()
    if frame is None:
        return default_strategy().default_replica_context()
    if frame.replica_context is not None:
        return frame.replica_context
    return frame.strategy.outside_replica_context()


def get_replica_context() -> "ReplicaContext | None":
    """This replica's context inside ``run``; ``None`` in cross-replica context.

    Outside every scope it is the default strategy's replica context, as in TensorFlow.

    Example::

        import stratagem as sg
        ctx = sg.get_replica_context()
        assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    """
    frame = current_frame()
    if frame is None:
        return default_strategy().default_replica_context()
    return frame.replica_context
