"""Fences and leases: a parameter server applies each closure's update at most once.

The :class:`~stratagem.ClusterCoordinator` may run one scheduled function
(a *closure*) more than once: when a worker stops answering, its closure is given to
another worker, while the first may still be running (a stopped process resumes; a
push may sit in a socket). A closure may therefore *execute* several times, but a
parameter server applies each of its updates at most once, and exactly once for every
closure that completes. Every push a worker sends for a closure carries a :class:`Fence`:

- ``coordinator``: the id of the coordinator that scheduled it;
- ``closure``: the closure's sequence number at that coordinator;
- ``attempt``: which execution of it this is (1, 2, ... in dispatch order);
- ``index``: the how-manieth push of this execution (a step function may call
  ``optimizer.step()`` more than once);
- ``floor``: the oldest closure that coordinator had not finished when it dispatched this one.

The ps keeps, per coordinator and closure, the newest attempt it has seen and which
``(variable, index)`` updates it applied. A push is

- *refused* (:class:`SupersededError`) when a newer attempt of its closure has already
  pushed here, or its closure is older than the floor (that closure finished, or was
  scheduled before the variables were restored after a ps loss: any push for it now comes
  from an abandoned execution);
- *skipped*, per variable, when that variable's update of that index was already applied
  by another attempt (so a re-run completes without applying it twice);
- applied otherwise.

Leases make "a ps declared lost applies nothing more" true even when the ps was only
stopped and resumes: the coordinator renews a lease on every ps once a second, and a ps
applies fenced pushes only while that coordinator's lease runs. A renewal that arrives
late (it waited in a socket while the ps was stopped) does not extend the lease: the ps
compares the renewal's sending time with its own clock, relative to the smallest such
difference seen recently (so the hosts' clocks need not agree, only not jump). The
coordinator declares a ps lost only after ``ps_timeout`` seconds without a renewal, twice
the lease, so by then the lease has run out on the ps and pushes are refused
(:class:`LeaseExpiredError`). Renewals carry the floor too, so that once the variables were
restored after a loss, a late push of a closure that had already failed is refused.

Fences are per coordinator, and a ps serves one coordinator at a time
(:mod:`stratagem.ps.ownership`): when a new coordinator takes the ps over, the old one's
table is dropped and its pushes are refused (``FencedError``) before a fence is looked at.

Example::

    >>> import time
    >>> from stratagem.ps.fencing import Fence, Fences
    >>> fences = Fences()
    >>> fences.renew("c1", lease_s=5.0, sent_at=time.time())
    True
    >>> fence = Fence("c1", closure=7, attempt=1, index=0, floor=7)
    >>> fences.admit(fence, ["w", "b"])          # the first execution applies both
    ['w', 'b']
    >>> fences.admit(Fence("c1", 7, attempt=2, index=0, floor=7), ["w", "b"])  # re-run: skip
    []
    >>> fences.admit(fence, ["w"])
    Traceback (most recent call last):
    ...
    stratagem.ps.fencing.SupersededError: closure 7 of coordinator c1: attempt 1 was superseded by attempt 2; its update is not applied
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stratagem.errors import InvalidArgumentError, UnavailableError

__all__ = ["Fence", "Fences", "LeaseExpiredError", "SupersededError"]

MAX_COORDINATORS = 8        # the fence tables of the most recently active coordinators are kept
DELAY_SAMPLES = 32          # renewals over which the smallest sending delay is taken


class SupersededError(UnavailableError):
    """A push from an execution of a closure that the coordinator has given up on."""


class LeaseExpiredError(UnavailableError):
    """A push for a coordinator whose lease on this ps ran out (the ps was stopped or cut off,
    or that coordinator declared it lost): nothing is applied."""


@dataclass(frozen=True)
class Fence:
    """Which execution of which scheduled function a push belongs to (see the module doc)."""

    coordinator: str
    closure: int
    attempt: int
    index: int
    floor: int

    @classmethod
    def from_request(cls, fence: Any) -> Fence:
        """The fence a worker sent (a dict, or a Fence); InvalidArgumentError if malformed."""
        if isinstance(fence, Fence):
            return fence
        if not isinstance(fence, Mapping):
            raise InvalidArgumentError(f"a push's fence must be a dict, got {type(fence).__name__}.")
        try:
            made = cls(str(fence["coordinator"]), *(int(fence[key]) for key in
                                                    ("closure", "attempt", "index", "floor")))
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidArgumentError(
                "a push's fence needs coordinator, closure, attempt, index and floor "
                f"(got {sorted(fence)}): {err}") from err
        if made.attempt < 1 or made.index < 0 or not 0 <= made.floor <= made.closure:
            raise InvalidArgumentError(f"malformed fence {fence!r}.")
        return made

    def as_dict(self) -> dict[str, Any]:
        return {"coordinator": self.coordinator, "closure": self.closure, "attempt": self.attempt,
                "index": self.index, "floor": self.floor}


class _Closure:
    __slots__ = ("attempt", "applied")

    def __init__(self) -> None:
        self.attempt = 0
        self.applied: dict[tuple[str, int], int] = {}   # (variable, push index) -> attempt


class _Coordinator:
    """What a ps remembers of one coordinator: its lease and its closures' fences."""

    def __init__(self) -> None:
        self.floor = 0
        self.closures: dict[int, _Closure] = {}
        self.lease_until = 0.0                  # time.monotonic() on this ps
        self.delays: collections.deque[float] = collections.deque(maxlen=DELAY_SAMPLES)
        self.renewed = False


class Fences:
    """The fence tables and leases of one parameter server. Thread-safe."""

    def __init__(self) -> None:
        self._coordinators: collections.OrderedDict[str, _Coordinator] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, coordinator: str) -> _Coordinator:   # holding the lock
        entry = self._coordinators.get(coordinator)
        if entry is None:
            entry = self._coordinators[coordinator] = _Coordinator()
            while len(self._coordinators) > MAX_COORDINATORS:
                self._coordinators.popitem(last=False)
        self._coordinators.move_to_end(coordinator)
        return entry

    def renew(self, coordinator: str, *, lease_s: float, sent_at: float, floor: int | None = None) -> bool:
        """Extends ``coordinator``'s lease to ``lease_s`` seconds from when the renewal was
        sent (``sent_at``: the sender's ``time.time()``); False when the renewal came too
        late to extend it. ``floor``: every closure older than it has finished (its late
        pushes are refused from now on, as a fence's floor says)."""
        if not (isinstance(lease_s, (int, float)) and lease_s > 0 and isinstance(sent_at, (int, float))):
            raise InvalidArgumentError(f"renew_lease needs lease_s > 0 and sent_at, got {lease_s!r}, {sent_at!r}.")
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int) or floor < 0):
            raise InvalidArgumentError(f"renew_lease: floor must be an int >= 0, got {floor!r}.")
        delay = time.time() - sent_at            # one-way delay plus the clocks' offset
        now = time.monotonic()
        with self._lock:
            entry = self._entry(coordinator)
            if floor is not None:
                self._raise_floor(entry, floor)
            entry.delays.append(delay)
            late = delay - min(entry.delays)     # how long this renewal waited on the way
            until = now + lease_s - late
            if until <= now:
                return False
            entry.lease_until = max(entry.lease_until, until)
            entry.renewed = True
            return True

    @staticmethod
    def _raise_floor(entry: _Coordinator, floor: int) -> None:   # holding the lock
        if floor > entry.floor:
            entry.floor = floor
            for closure in [c for c in entry.closures if c < floor]:
                del entry.closures[closure]

    def forget(self, coordinator: str) -> None:
        """Drops what this ps knew of ``coordinator`` (another one took the ps over): its
        lease is gone, and its pushes are refused before they get here."""
        with self._lock:
            self._coordinators.pop(coordinator, None)

    def expire(self, coordinator: str) -> None:
        """Ends ``coordinator``'s lease now (it is shutting down, or has declared this ps lost)."""
        with self._lock:
            self._entry(coordinator).lease_until = 0.0

    def admit(self, fence: Fence, var_ids: Iterable[str]) -> list[str]:
        """Of ``var_ids``, those this push may update; records them as applied by its attempt.

        Raises :class:`SupersededError` or :class:`LeaseExpiredError` when nothing may be.
        """
        var_ids = list(var_ids)
        with self._lock:
            entry = self._entry(fence.coordinator)
            if time.monotonic() >= entry.lease_until:
                why = ("it has not renewed its lease here yet" if not entry.renewed else
                       "its lease ran out: this ps was stopped or cut off from it for a while, "
                       "or it declared this ps lost")
                raise LeaseExpiredError(
                    f"closure {fence.closure} of coordinator {fence.coordinator}: {why}; the update "
                    "is not applied (the coordinator runs the step again, or fails it)")
            self._raise_floor(entry, fence.floor)
            if fence.closure < entry.floor:
                raise SupersededError(
                    f"closure {fence.closure} of coordinator {fence.coordinator} has finished (or was "
                    f"scheduled before a restore after a ps loss): attempt {fence.attempt} was "
                    "abandoned; its update is not applied")
            closure = entry.closures.setdefault(fence.closure, _Closure())
            if fence.attempt < closure.attempt:
                raise SupersededError(
                    f"closure {fence.closure} of coordinator {fence.coordinator}: attempt "
                    f"{fence.attempt} was superseded by attempt {closure.attempt}; its update "
                    "is not applied")
            closure.attempt = fence.attempt
            admitted = []
            for var_id in var_ids:
                key = (var_id, fence.index)
                if key not in closure.applied:
                    closure.applied[key] = fence.attempt
                    admitted.append(var_id)
            return admitted

    def stats(self) -> dict[str, Any]:
        """Per coordinator: closures remembered, floor, seconds of lease left."""
        now = time.monotonic()
        with self._lock:
            return {coordinator: {"closures": len(entry.closures), "floor": entry.floor,
                                  "lease_left_s": max(entry.lease_until - now, 0.0)}
                    for coordinator, entry in self._coordinators.items()}
