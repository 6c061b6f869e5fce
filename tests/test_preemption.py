"""sg.PreemptionWatcher in one process: the signal, the agreement's rhythm, the exit, the handler.

The multi-worker agreement (every worker stops after the same step, the chief saves, the
group restarts and resumes) runs with real processes in ``tests/launch/test_restarts.py``.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import stratagem as sg
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.timeout(60)


class _CountingCollective:
    """Stands in for a strategy's collective: counts the agreements, sums like one worker."""

    def __init__(self) -> None:
        self.calls = 0

    def worker_sum(self, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        self.calls += 1
        return tensor


class _Strategy:
    def __init__(self) -> None:
        self.collective = _CountingCollective()
        self.checkpoint_collective = self.collective   # the processes that stop together


def test_sigterm_is_recorded_and_the_loop_stops_at_the_next_question() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sg.PreemptionWatcher() as watcher:
        assert signal.getsignal(signal.SIGTERM) != before
        assert not watcher.received and not watcher.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)   # the handler runs before the next bytecode
        assert watcher.received
        assert watcher.should_stop() and watcher.should_stop()   # once True, stays True
        assert "stopping" in repr(watcher)
    assert signal.getsignal(signal.SIGTERM) == before   # put back at the end of the block


def test_exit_meets_the_other_workers_then_exits_with_75() -> None:
    strategy = _Strategy()
    before = signal.getsignal(signal.SIGTERM)
    watcher = sg.PreemptionWatcher(strategy)
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.should_stop()
    with pytest.raises(SystemExit) as exited:
        watcher.exit()
    assert exited.value.code == PREEMPTED_EXIT_CODE == sg.PreemptionWatcher.EXIT_CODE == 75
    assert strategy.collective.calls == 2   # the agreement, then the barrier
    assert signal.getsignal(signal.SIGTERM) == before


def test_check_every_asks_the_other_workers_on_every_nth_call_only() -> None:
    strategy = _Strategy()
    with sg.PreemptionWatcher(strategy, check_every=3) as watcher:
        os.kill(os.getpid(), signal.SIGTERM)
        answers = [watcher.should_stop() for _ in range(4)]
    assert answers == [False, False, True, True]
    assert strategy.collective.calls == 1


def test_other_signals_can_mean_preemption() -> None:
    with sg.PreemptionWatcher(signals=[signal.SIGUSR1]) as watcher:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.received and watcher.should_stop()


def test_bad_arguments_and_the_wrong_thread_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="check_every must be an integer >= 1"):
        sg.PreemptionWatcher(check_every=0)
    with pytest.raises(InvalidArgumentError, match="at least one signal"):
        sg.PreemptionWatcher(signals=[])
    caught: list[BaseException] = []

    def create() -> None:
        try:
            sg.PreemptionWatcher()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            caught.append(error)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(caught) == 1 and isinstance(caught[0], ContextError)
    assert "main thread" in str(caught[0])
