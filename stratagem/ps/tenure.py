"""A coordinator's tenure over its parameter servers: claim them all, keep them, let them go.

A :class:`~stratagem.ps.strategy.ParameterServerStrategy` claims every ps when it is made
(:meth:`Tenure.take`), renews its lease on each once a second from a daemon thread, and
releases them when the program exits (or the strategy is collected). What a ps does with
claims is :mod:`stratagem.ps.ownership`; here is how the claimant decides, in two rounds so
that a refused claimant has changed nothing:

1. it asks every ps for its owner. A ps that is free, or whose owner released it or let its
   lease run out, can be taken. So can one whose owner is *gone*, which this process can
   tell only on the owner's host: its pid no longer runs the same process (a chief killed
   and restarted by ``stratagem launch``, or one re-run after a crash, takes over at once),
   or it is an earlier strategy of this same program. Any other owner still holding a lease
   is watched: if it renews twice more it is alive, and the claim fails with
   :class:`~stratagem.ps.ownership.CoordinatorConflictError` naming it (within about two
   seconds); if its lease runs out (at most :data:`~stratagem.ps.ownership.OWNER_LEASE_SECONDS`)
   it is taken over. A line is logged while it waits;
2. it claims every ps, naming the owners it judged gone. Taking a ps over from another
   coordinator drops that one's variables there: this program creates its own (and restores
   them from its checkpoint, if it has one). A warning names whom it took over from, unless
   that coordinator had released the servers (it ended cleanly).

Once another coordinator has taken a ps over from this one, the next renewal is refused:
the tenure *fails* (:attr:`Tenure.failure`, a :class:`~stratagem.ps.ownership.FencedError`
naming the newcomer) and tells its listeners (the :class:`~stratagem.ClusterCoordinator`,
which then raises it from ``schedule``, ``join`` and ``fetch``); nothing it sends is
applied any more.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.ownership import (OWNER_LEASE_SECONDS, CoordinatorConflictError, CoordinatorIdentity,
                                    FencedError)
from stratagem.rpc.errors import RemoteError

__all__ = ["Tenure"]

logger = logging.getLogger("stratagem.ps")

HOLD_SECONDS = 1.0
LIVE_RENEWALS = 2            # renewals seen while watching an owner: it is alive
WATCH_MARGIN_SECONDS = 2.0   # beyond the owner's lease, for the ps to see it run out
POLL_SECONDS = 0.25


def _remote(error: BaseException, kind: type) -> Any:
    """``error`` if it is a ``kind``, or the ``kind`` a remote call raised; else None."""
    if isinstance(error, kind):
        return error
    inner = getattr(error, "remote_exception", None)
    return inner if isinstance(inner, kind) else None


class Tenure:
    """This program's claim on the parameter servers reached by ``clients`` (see the module doc).

    ``identity`` is this coordinator; ``took_over`` lists, per ps taken from another
    coordinator, whom from and why. ``lease_s``: how long the servers wait for a renewal.
    """

    def __init__(self, identity: CoordinatorIdentity, clients: Sequence[ParameterServerClient], *,
                 lease_s: float = OWNER_LEASE_SECONDS) -> None:
        self.identity = identity
        self.id = identity.id
        self.clients = list(clients)
        self.lease_s = lease_s
        self.took_over: list[str] = []
        self.failure: FencedError | None = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._released = False

    # ------------------------------------------------------------------ claiming

    def take(self) -> None:
        """Claims every ps (see the module doc); CoordinatorConflictError when a live
        coordinator holds one, and then nothing was claimed."""
        replaces, reasons = self._judge()
        request = {"identity": self.identity.as_dict(), "lease_s": self.lease_s}
        try:
            answers = call_each([(client, "claim", {**request, "replaces": replaces[i]})
                                 for i, client in enumerate(self.clients)])
        except RemoteError as error:   # another claimant came between the two rounds
            conflict = _remote(error, CoordinatorConflictError)
            if conflict is None:
                raise
            raise CoordinatorConflictError(self._conflict_text(str(conflict))) from None
        for answer, reason in zip(answers, reasons):
            previous = answer.get("previous")
            if previous is None:
                continue
            who, why = CoordinatorIdentity.from_dict(previous).describe(), reason or answer["why"]
            self.took_over.append(f"{answer['ps']}: from {who} ({why}; "
                                  f"{answer.get('dropped', 0)} variables of it dropped)")
            if why != "it released it":
                logger.warning("took %s over from %s: %s. Its variables there are dropped; this program "
                               "creates its own (restore them from a checkpoint to go on from it)",
                               answer["ps"], who, why)
        threading.Thread(target=self._hold_loop, daemon=True, name="stratagem-ps-tenure").start()
        atexit.register(self.release)

    def _owners(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return call_each([(self.clients[i], "owner", {}) for i in indices], timeout=10.0)

    def _judge(self) -> tuple[list[str | None], list[str | None]]:
        """Round 1: per ps, the owner id to replace (None: none) and why it is gone if this
        process saw it end; waits for owners whose liveness it cannot see, raises
        CoordinatorConflictError for a live one."""
        replaces: list[str | None] = [None] * len(self.clients)
        reasons: list[str | None] = [None] * len(self.clients)
        watched: dict[int, dict[str, Any]] = {}   # ps -> the owner's state when first seen
        deadline = 0.0
        pending = list(range(len(self.clients)))
        while pending:
            for i, state in zip(pending, self._owners(pending)):
                owner = state.get("owner")
                if owner is None:
                    continue
                identity = CoordinatorIdentity.from_dict(owner)
                first = watched.get(i)
                if first is not None and first["owner"]["id"] == identity.id:
                    if state["renewals"] - first["renewals"] >= LIVE_RENEWALS and state["live"]:
                        raise CoordinatorConflictError(self._conflict_text(
                            f"{state['ps']} is held by {identity.describe()}, which renewed its lease "
                            f"{state['renewed_ago_s']:.1f} s ago and "
                            f"{state['renewals'] - first['renewals']} times while this program watched"))
                gone = None if state["released"] else identity.gone_here()
                if identity.id == self.id or not state["live"] or gone:
                    replaces[i], reasons[i] = identity.id, gone
                    watched.pop(i, None)
                    continue
                if first is None or first["owner"]["id"] != identity.id:
                    watched[i] = state
                    deadline = max(deadline, time.monotonic() + state["lease_left_s"] + WATCH_MARGIN_SECONDS)
                    logger.warning("%s is held by %s, which this program cannot see end from here; waiting "
                                   "up to %.0f s for its lease to run out, or for it to show it is alive",
                                   state["ps"], identity.describe(), state["lease_left_s"] + WATCH_MARGIN_SECONDS)
            pending = sorted(watched)
            if pending and time.monotonic() > deadline:   # the ps still counts it live: it renewed
                state = self._owners(pending[:1])[0]
                raise CoordinatorConflictError(self._conflict_text(
                    f"{state['ps']} is still held by "
                    f"{CoordinatorIdentity.from_dict(state['owner']).describe()} after its lease should "
                    "have run out"))
            if pending:
                time.sleep(POLL_SECONDS)
        return replaces, reasons

    def _conflict_text(self, what: str) -> str:
        return (f"another coordinator drives these parameter servers and is alive: {what}. A cluster "
                "has one coordinator at a time: stop that program first, or point this one at other "
                "parameter servers. (A coordinator that dies is taken over by the next one at once on "
                f"its host, and elsewhere once its {self.lease_s:g} s lease runs out.)")

    # ------------------------------------------------------------------ holding

    def _hold_loop(self) -> None:
        request = {"identity": self.identity.as_dict(), "lease_s": self.lease_s}
        while not self._stop.wait(HOLD_SECONDS):
            calls = [client.rpc.call_async("hold", request, timeout=2 * HOLD_SECONDS) for client in self.clients]
            for call in calls:
                try:
                    call.result()
                except Exception as error:  # noqa: BLE001 - a silent ps is the watchdog's to judge
                    fenced = _remote(error, FencedError)
                    if fenced is not None:
                        self.replaced(fenced)
                        return

    def replaced(self, fenced: BaseException) -> FencedError:
        """Another coordinator took a ps over (``fenced``: what the ps said): fail, once."""
        with self._lock:
            first = self.failure is None
            if first:
                owner = getattr(fenced, "owner", "") or "another coordinator"
                refusal = getattr(fenced, "refusal", "") or str(fenced)
                self.failure = FencedError(
                    f"this program ({self.identity.describe()}) no longer drives the parameter servers: "
                    f"{owner} has taken them over ({refusal}). Nothing this program sends is applied "
                    "any more: stop it (training goes on under the coordinator that took over).")
                self.failure.owner, self.failure.refusal = owner, refusal
                self._stop.set()
            failure, listeners = self.failure, list(self._listeners)
        if first:
            for listener in listeners:
                listener(failure)
        return failure

    def on_failure(self, listener: Callable[[BaseException], None]) -> None:
        """Calls ``listener(error)`` when the tenure fails (at once if it has)."""
        with self._lock:
            self._listeners.append(listener)
            failure = self.failure
        if failure is not None:
            listener(failure)

    def release(self) -> None:
        """Lets the servers go (the program ends): the next coordinator need not wait. Bounded."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        calls = []
        for client in self.clients:
            try:
                calls.append(client.rpc.call_async("release", {"coordinator": self.id}, timeout=HOLD_SECONDS))
            except Exception:  # noqa: BLE001 - a closed client: nothing to release through it
                pass
        for call in calls:
            try:
                call.result()
            except Exception:  # noqa: BLE001 - a dead ps holds nothing worth releasing
                pass
