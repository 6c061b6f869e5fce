"""Who drives a parameter server: one coordinator at a time, and a new one may take over.

Parameter servers (``stratagem server``) outlive the program that drives them: a chief that
crashes, is killed or simply ends is followed by a new one against the same servers. Each
ps therefore records its **owner**, the coordinator program that claimed it (a
:class:`CoordinatorIdentity`: an id, its host and pid, since when), under a lease that the
owner renews once a second (``hold``). The owner counts as *live* while that lease runs.

States of one ps, and what moves it::

    free (a fresh ps)  --claim / hold by C----------------------------------------> owned by C
    owned by C, live   --claim by D, naming C as gone (C's host saw its pid end)--> owned by D
    owned by C         --C's lease ran out, or C released it (clean exit)--------> not live
    not live           --claim by D----------------------------------------------> owned by D
    owned by C, live   --claim by D, not naming C---------------------------------> refused
                         (CoordinatorConflictError, naming C)

Taking a ps over from another coordinator is a new *incarnation*: the variables the old one
made are dropped (the new program creates its own, then restores them from its checkpoint
if it has one) and its fence tables too. From then on every request that changes the ps --
creating, assigning, restoring, pushing (a worker's push names its coordinator in its
fence), writing a checkpoint, renewing a lease -- must name the owner, or it is refused
with :class:`FencedError`; so a late push of the old incarnation (its worker was still
running a step, or the old program was only stopped and resumes) applies nothing. A
request and a takeover never overlap: changing requests run under the shared side of a
gate whose exclusive side a takeover holds. A free ps accepts every request (as a ps used
in-process does); reads never need to name anyone.

Whether an owner that still holds a lease is alive is judged by the claimant
(:mod:`stratagem.ps.tenure`): on the same host, a pid that no longer runs the same process
is gone at once; elsewhere, the claimant waits for the lease to run out, and an owner whose
renewals keep coming is live.

Example::

    >>> from stratagem.ps.ownership import CoordinatorIdentity, Ownership
    >>> ownership = Ownership("ps 0")
    >>> first = CoordinatorIdentity.current().as_dict()
    >>> ownership.claim(first, lease_s=10.0, replaces=None)["previous"] is None
    True
    >>> ownership.admit(first["id"], "push")          # the owner's requests pass
    >>> second = {**first, "id": "f" * 16}
    >>> ownership.claim(second, lease_s=10.0, replaces=first["id"])["previous"] == first
    True
    >>> ownership.admit(first["id"], "push")
    Traceback (most recent call last):
    ...
    stratagem.ps.ownership.FencedError: ps 0 refused 'push' from an earlier coordinator, ... nothing was applied
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from stratagem.errors import InvalidArgumentError, StratagemError

__all__ = ["CHANGES", "CoordinatorConflictError", "CoordinatorIdentity", "FencedError", "Ownership",
           "OWNER_LEASE_SECONDS"]

#: Seconds an owner stays live after its last renewal (it renews once a second).
OWNER_LEASE_SECONDS = 10.0

#: The ps methods that change it: only its owner may call them (reads need no owner).
CHANGES = frozenset({"create", "delete", "set_optimizer", "push", "push_rows", "assign",
                     "set_hyperparameters", "set_state", "load_shards", "write_shards",
                     "renew_lease"})

_FORMER = 8   # identities of earlier owners kept, to name them in refusals


class FencedError(StratagemError, RuntimeError):
    """A request of a coordinator that no longer owns the parameter server (another one took
    it over), or of none while one does: nothing of it is applied. ``owner`` describes the
    coordinator that owns it now, ``refusal`` which ps refused which request."""

    owner = ""
    refusal = ""


class CoordinatorConflictError(StratagemError, RuntimeError):
    """Another coordinator, still alive, drives these parameter servers: one at a time."""


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class CoordinatorIdentity:
    """A coordinator program: ``id`` (fresh per program), where it runs and since when.

    ``boot`` (the kernel's boot id), ``pidns`` (the pid namespace) and ``start`` (the
    process's start time in clock ticks) let a process on the same host tell whether this
    one still runs: a pid can be reused, the three together cannot.
    """

    id: str
    host: str
    pid: int
    since: float
    boot: str = ""
    pidns: int = 0
    start: int = 0

    @classmethod
    def current(cls) -> CoordinatorIdentity:
        """This process, as a new coordinator."""
        stat = _proc_stat(os.getpid())
        return cls(uuid.uuid4().hex[:16], socket.gethostname(), os.getpid(), time.time(),
                   _read("/proc/sys/kernel/random/boot_id"), _pid_namespace(),
                   int(stat[19]) if stat and len(stat) > 19 else 0)

    @classmethod
    def from_dict(cls, value: Any) -> CoordinatorIdentity:
        if not isinstance(value, Mapping) or not isinstance(value.get("id"), str) or not value["id"]:
            raise InvalidArgumentError(f"a coordinator identity is a dict with an 'id', got {value!r}")
        try:
            return cls(str(value["id"]), str(value.get("host", "?")), int(value.get("pid", 0)),
                       float(value.get("since", 0.0)), str(value.get("boot", "")),
                       int(value.get("pidns", 0)), int(value.get("start", 0)))
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"malformed coordinator identity {value!r}: {err}") from err

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """``the coordinator of pid 4242 on host-a (since 2024-05-01 09:30:12 UTC, id 3f2a...)``"""
        since = datetime.datetime.fromtimestamp(self.since, datetime.timezone.utc)
        return (f"the coordinator of pid {self.pid} on {self.host} (since "
                f"{since:%Y-%m-%d %H:%M:%S} UTC, id {self.id})")

    def gone_here(self) -> str | None:
        """Why this coordinator's process has ended, when this process can tell (same host
        and pid namespace): it no longer exists, has exited, or its pid is another process's
        now; or it is an earlier coordinator of this very process. None when it may run."""
        me = CoordinatorIdentity.current()
        if not (self.boot and self.boot == me.boot and self.pidns and self.pidns == me.pidns):
            return None   # another host (or container): only its lease can tell
        if self.pid == me.pid and self.start == me.start:
            return "it is an earlier ParameterServerStrategy of this same program"
        stat = _proc_stat(self.pid)
        if stat is None:
            return f"its process (pid {self.pid}) no longer exists"
        if stat[0] in ("Z", "X"):
            return f"its process (pid {self.pid}) has exited"
        if len(stat) > 19 and self.start and int(stat[19]) != self.start:
            return f"its process (pid {self.pid}) has ended (the pid now belongs to another process)"
        return None


class Ownership:
    """The owner of one parameter server (``name``: "ps 0"), its lease, and the gate that keeps
    changing requests and takeovers apart. Thread-safe."""

    def __init__(self, name: str = "ps") -> None:
        self.name = name
        self._owner: CoordinatorIdentity | None = None
        self._lease_s = OWNER_LEASE_SECONDS
        self._lease_until = 0.0       # time.monotonic() on this ps
        self._renewed_at = 0.0
        self._renewals = 0
        self._released = False
        self._former: collections.OrderedDict[str, tuple[CoordinatorIdentity, str]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._gate = threading.Condition()
        self._active = 0              # changing requests running
        self._exclusive = False       # a takeover running or waiting

    # ------------------------------------------------------------------ the gate

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Held by a changing request while it is checked and applied."""
        with self._gate:
            while self._exclusive:
                self._gate.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by a claim: no changing request runs meanwhile."""
        with self._gate:
            while self._exclusive:
                self._gate.wait()
            self._exclusive = True
            while self._active:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._exclusive = False
                self._gate.notify_all()

    # --------------------------------------------------------------- the owner

    def _live(self, now: float) -> bool:   # holding the lock
        return self._owner is not None and not self._released and now < self._lease_until

    def state(self) -> dict[str, Any]:
        """The owner (None: free), whether it is live, its lease left, renewals so far."""
        now = time.monotonic()
        with self._lock:
            owner = self._owner
            return {"ps": self.name, "owner": None if owner is None else owner.as_dict(),
                    "live": self._live(now), "released": self._released,
                    "lease_left_s": max(self._lease_until - now, 0.0) if owner else 0.0,
                    "renewed_ago_s": now - self._renewed_at if owner else None,
                    "renewals": self._renewals}

    def _grant(self, identity: CoordinatorIdentity, lease_s: float, now: float) -> None:   # holding the lock
        if self._owner is None or self._owner.id != identity.id:
            self._renewals = 0
        self._owner, self._released = identity, False
        self._lease_s = lease_s
        self._lease_until, self._renewed_at = now + lease_s, now
        self._renewals += 1

    def claim(self, identity: Any, lease_s: float, replaces: str | None) -> dict[str, Any]:
        """Makes ``identity`` the owner unless another live owner holds the ps and is not
        ``replaces`` (the id the claimant judged gone). Answers with ``previous``: the owner
        it took over from (its variables are to be dropped), or None. Call it holding
        :meth:`exclusive`."""
        claimant = CoordinatorIdentity.from_dict(identity)
        lease_s = _check_lease(lease_s)
        now = time.monotonic()
        with self._lock:
            owner = self._owner
            if owner is not None and owner.id != claimant.id and self._live(now) and owner.id != replaces:
                raise CoordinatorConflictError(
                    f"{self.name} is held by {owner.describe()}, which renewed its lease "
                    f"{now - self._renewed_at:.1f} s ago; it is alive as far as {self.name} can tell")
            previous = owner if owner is not None and owner.id != claimant.id else None
            why = ("it released it" if self._released else
                   f"its lease ran out {now - self._lease_until:.0f} s ago" if not self._live(now) else
                   "its process has ended") if previous is not None else None
            if previous is not None:
                self._former[previous.id] = (previous, f"{claimant.describe()} took it over")
                while len(self._former) > _FORMER:
                    self._former.popitem(last=False)
            self._grant(claimant, lease_s, now)
        return {"ps": self.name, "previous": None if previous is None else previous.as_dict(), "why": why}

    def hold(self, identity: Any, lease_s: float) -> dict[str, Any]:
        """The owner's heartbeat: renews its lease (a free ps -- one restarted -- is claimed
        by it). FencedError when another coordinator owns the ps."""
        holder = CoordinatorIdentity.from_dict(identity)
        lease_s = _check_lease(lease_s)
        now = time.monotonic()
        with self._lock:
            if self._owner is not None and self._owner.id != holder.id:
                raise self._fenced(holder.id, "hold")
            self._grant(holder, lease_s, now)
            return {"ps": self.name, "renewals": self._renewals}

    def release(self, coordinator: str) -> None:
        """The owner ends its lease (it exits): the next claimant need not wait for it."""
        with self._lock:
            if self._owner is not None and self._owner.id == coordinator:
                self._released = True
                self._lease_until = 0.0

    def admit(self, coordinator: Any, method: str) -> None:
        """Raises FencedError unless a request of ``method`` naming ``coordinator`` (None:
        naming none) may change this ps."""
        with self._lock:
            owner = self._owner
            if owner is None or coordinator == owner.id:
                return
            raise self._fenced(coordinator, method)

    def _fenced(self, coordinator: Any, method: str) -> FencedError:   # holding the lock
        owner = self._owner
        assert owner is not None
        if coordinator is None:
            return FencedError(
                f"{self.name} refused {method!r}: it belongs to {owner.describe()}, and only that "
                "coordinator may change it (this request names no coordinator); nothing was applied")
        former = self._former.get(str(coordinator))
        who = former[0].describe() if former else f"coordinator {coordinator}"
        error = FencedError(
            f"{self.name} refused {method!r} from an earlier coordinator, {who}: {owner.describe()} "
            "has taken the parameter servers over since, and the requests of the earlier one are "
            "fenced out; nothing was applied")
        error.owner, error.refusal = owner.describe(), f"{self.name} refused its {method!r}"
        return error


def _check_lease(lease_s: Any) -> float:
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 3600:
        raise InvalidArgumentError(f"an owner's lease is a number of seconds in (0, 3600], got {lease_s!r}")
    return float(lease_s)


def named_coordinator(method: str, request: Any) -> tuple[Any, Any]:
    """The coordinator a request of ``method`` names, and the request to hand to the method:
    a ``coordinator`` entry is taken out of it (except for ``renew_lease``, whose argument it
    is); a push names the coordinator of its fence."""
    if not isinstance(request, Mapping):
        return None, request
    if method == "renew_lease":
        return request.get("coordinator"), request
    rest = dict(request)
    named = rest.pop("coordinator", None)
    fence = rest.get("fence")
    if named is None and isinstance(fence, Mapping):
        named = fence.get("coordinator")
    elif named is None and fence is not None:
        named = getattr(fence, "coordinator", None)
    return named, rest


def _guard(ownership: Ownership, method: str, handler: Any, refused: Any) -> Any:
    def guarded(request: Any) -> Any:
        named, rest = named_coordinator(method, request)
        with ownership.shared():
            try:
                ownership.admit(named, method)
            except FencedError:
                refused(method)
                raise
            return handler(rest)

    guarded.__name__ = method
    return guarded


def _keywords(method: str, function: Any) -> Any:
    def handler(request: Any) -> Any:
        if not isinstance(request, Mapping):
            raise InvalidArgumentError(f"the request of {method!r} must be a dict of its keyword arguments, "
                                       f"got {type(request).__name__}.")
        return function(**request)

    handler.__name__ = method
    return handler


def owned_handlers(ownership: Ownership, handlers: Mapping[str, Any], claim: Any, *,
                   refused: Any = lambda method: None) -> dict[str, Any]:
    """A ps's RPC ``handlers`` with each changing one (:data:`CHANGES`) checking the owner
    first (``refused(method)`` is told of each refusal), and the owner's own methods added:
    ``claim`` (the ps's method that also drops a former incarnation's variables), ``hold``,
    ``release`` and ``owner`` (its state)."""
    guarded = {name: _guard(ownership, name, handler, refused) if name in CHANGES else handler
               for name, handler in handlers.items()}
    guarded.update(claim=_keywords("claim", claim), hold=_keywords("hold", ownership.hold),
                   release=_keywords("release", ownership.release),
                   owner=lambda request=None: ownership.state())
    return guarded
