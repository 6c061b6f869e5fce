"""What each worker sends to and receives from the parameter servers, and how long it waits on them.

A worker's :class:`~stratagem.ps.client.ParameterServerClient`\\ s share one :class:`PsTraffic`
(its :class:`~stratagem.ps.runtime.WorkerRuntime`'s): each call counts the bytes of the tensors
in its request (*pushed*: gradients, and the row ids of an embedding's lookups) and in its reply
(*pulled*: variable values -- also those a push brings back for the next step, see the runtime's
"Prefetch" --, embedding rows), and the time during which at least one call was in flight (calls
to several parameter servers at once count once). Cheap counters: a few additions under a lock
per call, no event kept.

Each closure's run hands its counts back with its result (:meth:`PsTraffic.take`); the
coordinator adds them up per worker in a :class:`WorkerTraffic`
(``ClusterCoordinator.worker_traffic``), which the ``TensorBoard`` callback reads at each epoch's
start and end to write per worker the bytes pulled and pushed per step and the seconds in ps
calls per step (:meth:`WorkerTraffic.per_step`).

Example::

    >>> import torch
    >>> from stratagem.ps.traffic import PsTraffic, WorkerTraffic
    >>> traffic = PsTraffic()
    >>> traffic.begin({"grads": {"w": torch.zeros(4)}})        # a push of 16 bytes...
    >>> traffic.end({"w": torch.zeros(2, 2)})                   # ...brings back 16 bytes of values
    >>> counts = traffic.take()
    >>> counts["pushed"], counts["pulled"], counts["calls"], counts["seconds"] >= 0
    (16, 16, 1, True)
    >>> totals = WorkerTraffic()
    >>> before = totals.totals()
    >>> totals.add(1, counts); totals.add(1, counts)           # two closures ran on worker 1
    >>> step = WorkerTraffic.per_step(before, totals.totals())[1]
    >>> step["ps_pull_bytes"], step["ps_push_bytes"]
    (16.0, 16.0)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

__all__ = ["PsTraffic", "WorkerTraffic", "tensor_bytes"]

_COUNTS = ("pulled", "pushed", "calls", "seconds")


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested in dicts, lists and tuples)."""
    kind = type(value)
    if kind is dict:
        value = value.values()
    elif kind is not list and kind is not tuple:
        return value.nbytes if isinstance(value, torch.Tensor) else 0
    total = 0
    for item in value:   # (type checks first, a loop, not sum(): a few microseconds less per call)
        kind = type(item)
        if kind is dict or kind is list or kind is tuple:
            total += tensor_bytes(item)
        elif kind is not str and isinstance(item, torch.Tensor):
            total += item.nbytes
    return total


class PsTraffic:
    """One worker's counters of its ps calls (thread-safe: ``call_each`` calls from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0           # time.perf_counter() when the first call in flight began
        self._counts = dict.fromkeys(_COUNTS, 0)

    def begin(self, request: Any) -> None:
        """A call with ``request`` (its keyword arguments) is sent."""
        sent = tensor_bytes(request)
        with self._lock:
            if not self._in_flight:
                self._since = time.perf_counter()
            self._in_flight += 1
            self._counts["pushed"] += sent
            self._counts["calls"] += 1

    def end(self, reply: Any) -> None:
        """The call ended with ``reply`` (None when it failed)."""
        received = tensor_bytes(reply)
        with self._lock:
            self._in_flight -= 1
            if not self._in_flight:
                self._counts["seconds"] += time.perf_counter() - self._since
            self._counts["pulled"] += received

    def take(self) -> dict[str, float]:
        """The counts since the last take (``pulled``, ``pushed``: bytes; ``calls``; ``seconds``), reset."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(_COUNTS, 0)
        return counts


class WorkerTraffic:
    """A coordinator's sums of its workers' ps traffic, per worker index, with the closures they ran."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[int, dict[str, float]] = {}

    def add(self, worker: int, counts: dict[str, float] | None) -> None:
        """Worker ``worker`` ran a closure whose calls counted ``counts`` (:meth:`PsTraffic.take`)."""
        with self._lock:
            total = self._totals.setdefault(worker, dict.fromkeys(("steps",) + _COUNTS, 0))
            total["steps"] += 1
            for name in _COUNTS:
                total[name] += (counts or {}).get(name, 0)

    def totals(self) -> dict[int, dict[str, float]]:
        """A copy of the sums so far: per worker, ``steps`` (closures run) and the counts."""
        with self._lock:
            return {worker: dict(total) for worker, total in self._totals.items()}

    @staticmethod
    def per_step(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]
                 ) -> dict[int, dict[str, float]]:
        """Per worker that ran closures between the two :meth:`totals`: bytes pulled and pushed and
        seconds in ps calls per closure (``ps_pull_bytes``, ``ps_push_bytes``, ``ps_call_seconds``)."""
        steps = {}
        for worker, now in sorted(after.items()):
            then = before.get(worker, {})
            count = now["steps"] - then.get("steps", 0)
            if count > 0:
                steps[worker] = {f"ps_{scalar}": (now[name] - then.get(name, 0)) / count
                                 for scalar, name in (("pull_bytes", "pulled"), ("push_bytes", "pushed"),
                                                      ("call_seconds", "seconds"))}
        return steps
