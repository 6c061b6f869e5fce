"""``sg.experimental_set_strategy``: a strategy's scope entered for the rest of the program.

TensorFlow's ``tf.distribute.experimental_set_strategy``: a script whose model, optimizer and
scaler are built in branches (a DistributedDataParallel script being ported) makes them in the
strategy's scope without re-indenting them under ``with strategy.scope():``. Like the scope it
enters, it holds for the calling thread.
"""

from __future__ import annotations

import threading
from typing import Any

from stratagem import _context
from stratagem.errors import ContextError, InvalidArgumentError

__all__ = ["experimental_set_strategy"]


class _Set(threading.local):
    def __init__(self) -> None:
        self.strategy: Any = None
        self.scope: Any = None    # the entered scope's context manager
        self.depth = 0            # the thread's frames below it when it was entered


_set = _Set()


def experimental_set_strategy(strategy: Any) -> None:
    """Enter ``strategy``'s scope on this thread until another call changes it; ``None`` leaves it.

    Everything created afterwards is created in the scope (modules, optimizers, ``GradScaler``),
    and, where the process holds one replica (``MultiWorkerMirroredStrategy`` with one device per
    worker), a step written without ``strategy.run`` is that replica's step: the loss helpers
    scale for ``num_replicas_in_sync`` and ``backward()`` sums over the workers. Calling it inside
    ``with strategy.scope():`` is refused (leave the scope first), and so is entering another
    strategy's scope while it is set.

    Example::

        import torch, stratagem as sg
        strategy = sg.OneDeviceStrategy("cpu")
        sg.experimental_set_strategy(strategy)
        assert sg.get_strategy() is strategy
        model = torch.nn.Linear(4, 2)                  # created in the scope
        sg.experimental_set_strategy(None)
        assert sg.get_strategy() is not strategy
    """
    if strategy is not None and not hasattr(strategy, "scope"):
        raise InvalidArgumentError(
            f"experimental_set_strategy takes a strategy (or None to leave it), got {type(strategy).__name__}")
    if _context.depth() != (_set.depth + 1 if _set.scope is not None else 0):
        frame = _context.current_frame()
        where = "inside strategy.run" if frame is not None and frame.replica_context is not None else \
            f"inside `with strategy.scope():` of {frame.strategy!r}" if frame is not None else "here"
        raise ContextError(
            f"sg.experimental_set_strategy was called {where}; call it outside every scope and every "
            f"run (leave the `with strategy.scope():` block first)")
    if _set.scope is not None:
        scope, _set.scope, _set.strategy = _set.scope, None, None
        scope.__exit__(None, None, None)   # (the placement finalizes what was created, as at a scope's end)
    if strategy is not None and not strategy.is_default:
        scope = strategy.scope()
        _set.depth = _context.depth()
        scope.__enter__()
        _set.scope, _set.strategy = scope, strategy


def mixing_refusal(entering: Any, active: Any) -> ContextError:
    """The error for entering the scope of ``entering`` while that of ``active`` is open here."""
    how = (" (entered by sg.experimental_set_strategy: call sg.experimental_set_strategy(None) first, "
           "or set this strategy instead)" if active is _set.strategy else "")
    return ContextError(
        f"cannot enter the scope of {entering!r} while the scope of {active!r} is active on this "
        f"thread{how}: mixing strategies is not supported. Leave the first scope, or create "
        f"everything under one strategy")
