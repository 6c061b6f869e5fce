"""Preemption: stop at a step every worker agrees on, save, and exit to be restarted.

A cluster manager that takes a machine back (a spot instance, a Slurm time limit, a
Kubernetes eviction) sends SIGTERM first and kills a little later. TensorFlow's
``PreemptionCheckpointHandler`` answers by saving a checkpoint and exiting; this is the
same idea for a custom training loop; the checkpoint itself is the script's
(``sg.CheckpointManager.save()`` or ``sg.callbacks.BackupAndRestore.save()``, called by
every worker).

:class:`PreemptionWatcher` installs a handler for SIGTERM that only records the signal.
The training loop asks :meth:`~PreemptionWatcher.should_stop` once per step. In
multi-worker training the signal may reach one worker only, or each worker at a
different step, so the question is a collective: the workers sum their flags, and every
worker gets the same answer at the same step -- the chief can then save a checkpoint
that matches every worker's state. :meth:`~PreemptionWatcher.exit` waits until every
worker is there (so the chief's save is complete before anyone leaves) and exits with
:data:`PREEMPTED_EXIT_CODE`, which ``stratagem launch`` reads as "restart the group",
not as a failure.

The life of a watcher::

    watching --SIGTERM--> received (this process only; training goes on)
    received --should_stop() on every worker--> stopping (True on every worker, same step)
    stopping --exit()--> every worker has arrived --> SystemExit(75)

Example::

    import stratagem as sg
    strategy = sg.get_strategy()
    with sg.PreemptionWatcher(strategy) as watcher:
        for step in range(3):
            pass                     # one training step
            if watcher.should_stop():
                pass                 # the chief saves here
                watcher.exit()
    assert not watcher.received
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, NoReturn

from stratagem._context import get_strategy
from stratagem.errors import ContextError, InvalidArgumentError

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionWatcher"]

#: The exit status of a worker that stopped for preemption after its group saved:
#: ``EX_TEMPFAIL`` from ``sysexits.h``, "a temporary failure; try again later".
#: ``stratagem launch`` restarts the group on it without counting a failure.
PREEMPTED_EXIT_CODE = 75


class PreemptionWatcher:
    """Notices SIGTERM and tells every worker to stop at the same step.

    ``strategy`` (default: the current one) carries the workers' agreement; with one
    process the agreement is this process's own flag. ``check_every=N`` communicates on
    every N-th call of :meth:`should_stop` only (the others return at once): cheaper,
    at the price of up to N - 1 more steps between the signal and the stop. ``signals``
    are the signals that mean "you will be stopped soon" (Slurm can send SIGUSR1).

    The handler is installed when the watcher is created (on the main thread: Python
    runs signal handlers there only) and the previous one is put back by :meth:`close`
    or at the end of a ``with`` block. A process that gets SIGTERM before its watcher
    exists is terminated as usual.
    """

    #: The status :meth:`exit` exits with (:data:`PREEMPTED_EXIT_CODE`).
    EXIT_CODE = PREEMPTED_EXIT_CODE

    def __init__(self, strategy: Any = None, *, check_every: int = 1,
                 signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise InvalidArgumentError(
                f"check_every must be an integer >= 1 (1 asks the other workers at every "
                f"step), got {check_every!r}.")
        signals = tuple(signal.Signals(s) for s in signals)
        if not signals:
            raise InvalidArgumentError(
                "signals must name at least one signal, like signal.SIGTERM.")
        if threading.current_thread() is not threading.main_thread():
            raise ContextError(
                "PreemptionWatcher must be created on the main thread, where Python runs signal "
                "handlers; create it before the training loop, outside any worker thread.")
        self._strategy = get_strategy() if strategy is None else strategy
        self._check_every = check_every
        self._calls = 0
        self._received: signal.Signals | None = None
        self._stopping = False
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in signals}

    @property
    def received(self) -> bool:
        """Whether this process got one of the signals (no communication)."""
        return self._received is not None

    def should_stop(self) -> bool:
        """Whether the workers must stop now: True on every worker at the same call.

        A collective in multi-worker training: every worker calls it at the same point of
        every step (like ``strategy.reduce``), from the main thread, outside
        ``strategy.run``. Once True it stays True without communicating again.
        """
        if self._stopping:
            return True
        self._calls += 1
        if self._calls % self._check_every:
            return False
        import torch   # here, not at the top: the launcher reads PREEMPTED_EXIT_CODE without torch

        flag = torch.tensor([1.0 if self.received else 0.0])
        self._stopping = bool(self._strategy.checkpoint_collective.worker_sum(
            flag, "PreemptionCheckpointHandler (did a worker get the signal)").item() > 0)
        return self._stopping

    def exit(self) -> NoReturn:
        """Waits for every worker, puts the signal handlers back, exits with 75.

        Call it on every worker after the chief saved: no worker leaves before the chief's
        save is complete, so a launcher that restarts the group finds the checkpoint whole.
        """
        import torch

        self._strategy.checkpoint_collective.worker_sum(  # the last meeting: a barrier
            torch.zeros(1), "PreemptionCheckpointHandler.exit (the last meeting)")
        self.close()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """Puts back the signal handlers that were there before (idempotent)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def __enter__(self) -> "PreemptionWatcher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        first = self._received is None
        self._received = signal.Signals(signum)
        if first:  # os.write: print() may be in the middle of a line on this very thread
            os.write(2, (f"[preemption] received {self._received.name} at "
                         f"{time.strftime('%H:%M:%S')}; training stops at the next step "
                         f"that every worker agrees on\n").encode())

    def __repr__(self) -> str:
        state = "stopping" if self._stopping else "received" if self.received else "watching"
        return f"PreemptionWatcher({state}, check_every={self._check_every})"
