"""The rendezvous that replica threads of one process use for every collective.

Protocol: each replica calls :meth:`ReplicaSync.exchange` with its own value and a
tag naming the collective. The call returns, on every replica, the list of all
replicas' values once the last one has arrived. Slots are double-buffered by
generation, so one barrier per exchange is enough: a replica cannot deposit for
generation ``g + 2`` before every replica has returned from generation ``g``.

A replica that raises calls :meth:`abort`; every replica waiting (or arriving later)
then raises :class:`ReplicaAborted`, so one failing replica never leaves the others
hanging. A replica whose function returned calls :meth:`finish`; a replica still
waiting in a collective then fails with ``CollectiveMismatchError`` instead of
waiting for a partner that will never come.
"""

from __future__ import annotations

import threading
from typing import Any

from stratagem.errors import CollectiveMismatchError


class ReplicaAborted(Exception):
    """Raised in a replica whose partner failed; ``run`` reports the partner's error."""


class ReplicaSync:
    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._cond = threading.Condition(threading.Lock())
        self._slots: list[list[Any]] = [[None] * num_replicas, [None] * num_replicas]
        self._tags: list[list[str]] = [[""] * num_replicas, [""] * num_replicas]
        self._arrived = 0
        self._generation = 0
        self._aborted = False
        self._finished: list[int] = []

    def reset(self) -> None:
        """Start a new ``run``: called while no replica is waiting."""
        with self._cond:
            self._arrived = 0
            self._aborted = False
            self._finished = []
            self._slots = [[None] * self.num_replicas, [None] * self.num_replicas]

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def finish(self, replica_id: int) -> None:
        with self._cond:
            self._finished.append(replica_id)
            self._cond.notify_all()

    def exchange(self, replica_id: int, value: Any, tag: str) -> list[Any]:
        n = self.num_replicas
        if n == 1:
            return [value]
        with self._cond:
            if self._aborted:
                raise ReplicaAborted()
            generation = self._generation
            slots, tags = self._slots[generation & 1], self._tags[generation & 1]
            slots[replica_id] = value
            tags[replica_id] = tag
            self._arrived += 1
            if self._arrived == n:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
            else:
                while self._generation == generation:
                    if self._aborted:
                        raise ReplicaAborted()
                    if self._finished:
                        raise CollectiveMismatchError(
                            f"replica {replica_id} is waiting in {tag} but replica "
                            f"{self._finished[0]} already returned from its function; every "
                            f"replica must make the same collective calls in the same order")
                    self._cond.wait()
            values, seen = list(slots), list(tags)
        if any(t != seen[0] for t in seen):
            calls = ", ".join(f"replica {r}: {t}" for r, t in enumerate(seen))
            raise CollectiveMismatchError(
                f"replicas made different collective calls at the same point ({calls}); every "
                f"replica must call the same collectives in the same order")
        return values
