"""The collective flight recorder: every collective this process issues, the last ones kept.

Each collective stratagem issues -- a process-group call (``comm/processes.py``'s guard, each
gradient pack from its launch to the end of its wait), the replica threads' sums, a
parameter-server RPC call -- is recorded here: a sequence number (per process, from 1), its
kind (what stratagem calls it: ``"gradient all_reduce"``, ``"strategy.reduce"``,
``"rpc push"``), the bytes it moves (0 where unknown), its peers, the step it belongs to (how
many ``strategy.run`` calls -- on a parameter-server worker, closures -- this process had
begun), the thread, and when it started and ended (``time.monotonic()`` and the wall clock). The last :data:`CAPACITY` records are kept
in a ring. It is always on: a record is one tuple written into a list slot at the start and
one float at the end, and nothing else is allocated unless a listener is attached.

Who reads it: a task asked where it stands (:mod:`stratagem.observe.answer`) reports its
:func:`last_completed` and :func:`in_flight` collectives; a timeline attaches a listener
(:func:`add_listener`) and receives every record when it starts (``end`` None) and when it
ends.

Example::

    >>> from stratagem.observe import flight
    >>> seen = []
    >>> remove = flight.add_listener(seen.append)
    >>> with flight.record("example all_reduce", 4096, "2 workers"):
    ...     [r.kind for r in flight.in_flight()][-1]
    'example all_reduce'
    >>> remove()
    >>> done = flight.last_completed()
    >>> done.kind, done.nbytes, done.end_monotonic >= done.start_monotonic
    ('example all_reduce', 4096, True)
    >>> [r.end_monotonic is None for r in seen]      # the listener saw it start, then end
    [True, False]
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["CAPACITY", "Record", "add_listener", "begin", "end", "in_flight", "last_completed",
           "note_step", "progress", "record", "records", "step"]

#: How many records the ring keeps (the oldest are overwritten).
CAPACITY = 4096


class Record(NamedTuple):
    """One collective, as the recorder saw it (``end_*`` None while it is in flight)."""

    seq: int
    kind: str
    nbytes: int
    peers: str
    step: int
    thread: int              # threading.get_ident() of the thread that issued it
    start_monotonic: float
    start_wall: float
    end_monotonic: float | None = None

    @property
    def end_wall(self) -> float | None:
        """The end on the wall clock (the start's wall clock plus the monotonic duration)."""
        return None if self.end_monotonic is None else self.start_wall + (self.end_monotonic - self.start_monotonic)


_counter = itertools.count(1)
_starts: list[tuple | None] = [None] * CAPACITY   # (seq, kind, nbytes, peers, step, thread, t0, wall0)
_ends: list[float | None] = [None] * CAPACITY     # time.monotonic() at the end, None while in flight
_listeners: list[Callable[[Record], None]] = []
_state = {"step": 0, "completed": 0, "last": 0}   # steps begun, records ended, highest seq ended
_monotonic, _wall, _ident = time.monotonic, time.time, threading.get_ident


def begin(kind: str, nbytes: int = 0, peers: str = "") -> int:
    """Records the start of a collective; returns its sequence number for :func:`end`."""
    seq = next(_counter)
    slot = seq % CAPACITY
    _ends[slot] = None
    _starts[slot] = start = (seq, kind, nbytes, peers, _state["step"], _ident(), _monotonic(), _wall())
    if _listeners:
        _tell(Record(*start))
    return seq


def end(seq: int) -> None:
    """Records the end of collective ``seq`` (whether it succeeded or raised)."""
    slot = seq % CAPACITY
    start = _starts[slot]
    if start is None or start[0] != seq:   # overwritten meanwhile by newer records
        return
    _ends[slot] = now = _monotonic()
    if not start[1].startswith("rpc "):
        _state["completed"] += 1
    if seq > _state["last"]:
        _state["last"] = seq
    if _listeners:
        _tell(Record(*start, now))


class record:  # noqa: N801 - used like a function: ``with flight.record(kind, nbytes, peers):``
    """A context manager recording one collective from its entry to its exit."""

    __slots__ = ("_kind", "_nbytes", "_peers", "_seq")

    def __init__(self, kind: str, nbytes: int = 0, peers: str = "") -> None:
        self._kind, self._nbytes, self._peers = kind, nbytes, peers

    def __enter__(self) -> int:
        self._seq = begin(self._kind, self._nbytes, self._peers)
        return self._seq

    def __exit__(self, *exc_info: object) -> None:
        end(self._seq)


def note_step() -> None:
    """A step (one ``strategy.run``) begins: later records carry its number."""
    _state["step"] += 1


def step() -> int:
    """How many steps (``strategy.run`` calls) this process has begun."""
    return _state["step"]


def progress() -> int:
    """A number that grows whenever this process makes progress (a step begins, a collective
    ends); a hang watch compares it over time. RPC calls (kinds ``"rpc ..."``) do not count: a
    coordinator keeps renewing its leases with healthy servers while its workers stand still."""
    return _state["step"] + _state["completed"]


def records() -> list[Record]:
    """The records kept, oldest first."""
    found = []
    for start, finish in zip(list(_starts), list(_ends)):
        if start is not None:
            found.append(Record(*start, finish if finish is not None and finish >= start[6] else None))
    return sorted(found)


def in_flight() -> list[Record]:
    """The collectives started and not ended, oldest first."""
    return [r for r in records() if r.end_monotonic is None]


def last_completed() -> Record | None:
    """The collective with the highest sequence number among those that ended (None before any)."""
    last = _state["last"]
    start = _starts[last % CAPACITY] if last else None
    if start is None or start[0] != last:
        return None
    return Record(*start, _ends[last % CAPACITY])


def add_listener(fn: Callable[[Record], None]) -> Callable[[], None]:
    """Calls ``fn(record)`` when each collective starts (``end_monotonic`` None) and ends, on the
    thread that issued it, until the returned function is called. ``fn`` must be quick and must
    not raise."""
    _listeners.append(fn)

    def remove() -> None:
        if fn in _listeners:
            _listeners.remove(fn)
    return remove


def _tell(rec: Record) -> None:
    for fn in list(_listeners):
        fn(rec)
