"""The closure queue's bound, in one process: ``put`` blocks while it is full, goes on as
closures finish, and a blocked ``put`` gives up when the queue closes or its check raises."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from stratagem.ps.closure_queue import _Closure, _Queue
from stratagem.ps.remote_value import RemoteValue

pytestmark = pytest.mark.timeout(20)


_seqs = itertools.count()


def closure() -> _Closure:
    return _Closure(print, (), {}, RemoteValue(None), seq=next(_seqs))


def put_in_thread(queue: _Queue, check=None) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def body() -> None:
        try:
            queue.put(closure(), check=check)
            outcome["put"] = True
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def test_put_blocks_while_full_and_proceeds_as_closures_finish() -> None:
    queue = _Queue(max_queued=3)
    for _ in range(3):
        queue.put(closure())
    thread, outcome = put_in_thread(queue)
    thread.join(0.3)
    assert thread.is_alive() and outcome == {} and queue.unfinished == 3
    taken = queue.get(timeout=0)                     # handed to a worker: still unfinished
    assert taken is not None
    thread.join(0.3)
    assert thread.is_alive() and queue.unfinished == 3
    queue.finished(taken)                            # one finished: room for the blocked one
    thread.join(5)
    assert outcome == {"put": True} and queue.unfinished == 3


def test_a_requeued_closure_never_waits() -> None:
    queue = _Queue(max_queued=1)
    queue.put(closure())
    queue.put(queue.get(timeout=0), front=True, new=False)   # a lost worker gives it back
    assert queue.unfinished == 1


def test_bound_holds_with_many_producers() -> None:
    queue = _Queue(max_queued=4)
    seen: list[int] = []
    producers = [put_in_thread(queue)[0] for _ in range(20)]
    done = 0
    while done < 20:
        seen.append(queue.unfinished)
        taken = queue.get(timeout=0.05)
        if taken is not None:
            queue.finished(taken)
            done += 1
    for thread in producers:
        thread.join(5)
    assert max(seen) <= 4 and queue.unfinished == 0


def test_blocked_put_raises_when_the_queue_closes() -> None:
    queue = _Queue(max_queued=1)
    queue.put(closure())
    failure = RuntimeError("fatal dispatcher error")
    state = {"failed": None}

    def check() -> None:
        if state["failed"] is not None:
            raise state["failed"]

    thread, outcome = put_in_thread(queue, check)
    thread.join(0.2)
    assert thread.is_alive()
    started = time.monotonic()
    state["failed"] = failure               # as coordinator._fail does: record, then close
    queue.close(failure)
    thread.join(5)
    assert outcome.get("error") is failure and time.monotonic() - started < 1.0


def test_blocked_put_raises_when_its_check_does() -> None:
    queue = _Queue(max_queued=1)
    queue.put(closure())
    state = {"stop": False}

    def check() -> None:
        if state["stop"]:
            raise LookupError("shut down")

    thread, outcome = put_in_thread(queue, check)
    thread.join(0.2)
    started = time.monotonic()
    state["stop"] = True
    thread.join(5)
    assert isinstance(outcome.get("error"), LookupError) and time.monotonic() - started < 1.0


def test_floor_is_the_oldest_unfinished_closure() -> None:
    # the fence floor: every closure older than it has finished, so the ps may refuse its pushes
    queue = _Queue(max_queued=10)
    closures = [_Closure(print, (), {}, RemoteValue(None), seq=seq) for seq in range(4)]
    for item in closures:
        queue.put(item)
    assert queue.floor == 0
    queue.finished(queue.get(timeout=0))           # 0 done
    second = queue.get(timeout=0)                  # 1 runs ...
    queue.put(second, front=True, new=False)       # ... its worker is lost: back to the front
    queue.finished(queue.get(timeout=0))           # 1 done on another worker
    assert queue.floor == 2
    queue.get(timeout=0)
    queue.finished(queue.get(timeout=0))           # 3 done before 2
    assert queue.floor == 2
    queue.finished(closures[2])
    assert queue.floor == 4 and queue.unfinished == 0   # all done: the next one's (heartbeats carry it)
