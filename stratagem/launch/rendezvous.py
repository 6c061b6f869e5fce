"""The rendezvous of a multi-node launch: which nodes form each start of the job, and what next.

Every node runs ``stratagem launch --nnodes ...``; one of them (the host, node-rank 0) also
serves the rendezvous at ``--rdzv HOST:PORT`` (``nodes.py``), over the authenticated RPC
of :mod:`stratagem.rpc`: a request without the cluster token is refused and logged with
the caller's address, and the token itself never travels. :class:`Rendezvous` is the
state behind it; the node agents (``node_agent.py``) call its handlers.

A job goes through *rounds*, one per start of the group (``STRATAGEM_RESTART`` is the
round's number)::

    forming --enough nodes joined--> running --every node's tasks exited 0--> done
    running --a task failed / a node left or stopped answering--> forming (round + 1)
            (spends a restart; a preemption, exit 75 or a node's SIGTERM, spends none)
    running --no restarts left--> failed          forming --the timeout--> failed

*Enough nodes*: all ``max_nodes`` of them; in an elastic job (``min_nodes < max_nodes``)
also ``min_nodes`` or more once no other node has joined for ``settle`` seconds (so a node
lost for good does not hold the job back; one that comes back joins at the next restart),
or, after the first round, as soon as every node of the last round that is not lost is
back (there is nobody left to wait for).
The members of a round are ordered by ``--node-rank`` when the nodes give one, else by
when each node first joined (the host first); the chief and the evaluator run on the
first member, which is the host. Each member lists its own free ports for the round;
the cluster spec is put together from them.

A node that stops polling for ``node_timeout`` seconds is lost, and so is one whose
``attend`` call's connection closed (its launcher died: see :meth:`Rendezvous.attend`) at
once: in a running round that is a failure of the round; while forming it is dropped from
the round, and the next round does not wait for it.

Every node must agree on the :class:`~stratagem.launch.job_shape.JobShape`: the options of its command line (all but
:data:`PER_NODE_OPTIONS`), the script's contents and its arguments. A node that differs is
refused, each difference named with both values; before the first round that ends the job
on every node (it could not start as its nodes were told), later the job goes on without it.

Example::

    >>> from stratagem.launch.job_shape import JobShape
    >>> from stratagem.launch.rendezvous import Rendezvous
    >>> rdzv = Rendezvous(JobShape(max_nodes=2, workers_per_node=1), node_timeout=30)
    >>> rdzv.join({"node": "a", "host": "10.0.0.1", "ports": [2222], "shape": rdzv.shape.as_dict()})["state"]
    'wait'
    >>> rdzv.join({"node": "b", "host": "10.0.0.2", "ports": [2222], "shape": rdzv.shape.as_dict()})["state"]
    'run'
    >>> rdzv.poll({"node": "a", "round": 0})["cluster"]
    {'worker': ['10.0.0.1:2222', '10.0.0.2:2222']}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratagem.launch.job_shape import PER_NODE_OPTIONS, JobShape
from stratagem.launch.ports import format_address
from stratagem.preemption import PREEMPTED_EXIT_CODE

__all__ = ["ATTEND_SECONDS", "CLOSED_GRACE", "Rendezvous"]

ATTEND_SECONDS = 10.0   # how long the rendezvous holds a node's attend call before it answers
CLOSED_GRACE = 2.0      # a node whose attend call's connection closed is lost unless it calls again within this

@dataclass
class _Node:
    node: str             # the agent's id: its host name, pid and a random part
    host: str             # the address its tasks listen on
    ports: list[int]      # this round's ports, one per local task
    rank: int | None      # --node-rank, if given
    order: int            # when it first joined the job
    first: bool = False   # the rendezvous host's own node: always the first member
    seen: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return (f"node {self.rank}" if self.rank is not None else "node") + f" ({self.host})"


def _position(node: _Node) -> tuple[bool, bool, int, int]:
    """Members' order: the host first, then by --node-rank, then by first join."""
    return (not node.first, node.rank is None, node.rank or 0, node.order)


class Rendezvous:
    """The job's rounds; thread-safe (the RPC server calls it from several threads)."""

    def __init__(self, shape: JobShape, *, node_timeout: float = 30.0, rdzv_timeout: float = 600.0,
                 settle: float | None = None, say: Callable[[str], None] | None = None,
                 caller_gone: Callable[[], bool] = lambda: False) -> None:
        self.shape = shape
        self._say = say   # tells the host's output what the nodes are not told (a late refusal)
        self._caller_gone = caller_gone   # in a handler: whether its caller's connection closed
        self._closed: dict[str, float] = {}   # node -> when its attend call's connection closed
        self._expected: dict[str, _Node] = {}   # the last round's nodes, not lost: a new round waits for them
        self._node_timeout = node_timeout
        self._rdzv_timeout = rdzv_timeout
        self._settle = node_timeout if settle is None else settle
        self._lock = threading.Lock()
        self._round = 0
        self._phase = "forming"
        self._joining: dict[str, _Node] = {}
        self._members: list[_Node] = []
        self._cluster: dict[str, list[str]] = {}
        self._forming_since = time.monotonic()
        self._last_join = self._forming_since
        self._order: dict[str, int] = {}
        self._restarts = self._preemptions = 0
        self._done: set[str] = set()
        self._told_end: set[str] = set()
        self._end: tuple[int, str] = (0, "")   # the job's status and the reason, once it ended
        self._news = ""                        # what the last change of round was

    # -- the handlers ----------------------------------------------------------------------

    def handlers(self) -> dict[str, Any]:
        return {"join": self.join, "poll": self.poll, "report": self.report, "attend": self.attend}

    def join(self, request: dict[str, Any]) -> dict[str, Any]:
        """A node asks to take part in the round being formed (it gives its ports for it)."""
        with self._lock:
            refusal = self._refusal(request)
            if refusal:
                return {"state": "refused", "message": refusal}
            if self._phase in ("done", "failed"):
                return self._answer(request["node"])
            node = request["node"]
            self._order.setdefault(node, len(self._order))
            self._joining[node] = _Node(node, request["host"], list(request["ports"]), request.get("rank"),
                                        self._order[node], bool(request.get("first")))
            self._last_join = time.monotonic()
            self._advance()
            return self._answer(node)

    def poll(self, request: dict[str, Any]) -> dict[str, Any]:
        """A node's heartbeat: what its tasks should do now."""
        with self._lock:
            node = request["node"]
            for each in (*self._members, *self._joining.values()):
                if each.node == node:
                    each.seen = time.monotonic()
            self._advance()
            return self._answer(node, request.get("round"))

    def attend(self, request: dict[str, Any]) -> dict[str, Any]:
        """A node's open line: held for ATTEND_SECONDS (the node calls again at once).

        Its connection closing while held (the caller's process died: SIGKILL, a crash, the
        OOM killer; its kernel closes the connection) is news at once: the node is lost when
        it does not call again within CLOSED_GRACE seconds. A node that is silent without a
        closed connection (SIGSTOP, a power cut, a network cut) is lost after ``node_timeout``.
        """
        held = time.monotonic()
        while time.monotonic() - held < ATTEND_SECONDS:
            if self._caller_gone():
                with self._lock:
                    self._closed[request["node"]] = time.monotonic()
                return {"state": "gone"}
            time.sleep(0.05)
        return {"state": "held"}

    def report(self, request: dict[str, Any]) -> dict[str, Any]:
        """A node says its tasks failed, finished, or that it is leaving the job (SIGTERM)."""
        with self._lock:
            node, event = request["node"], request["event"]
            member = next((each for each in self._members if each.node == node), None)
            if event == "leaving":
                self._joining.pop(node, None)
            if member is None or request.get("round") != self._round or self._phase != "running":
                return self._answer(node, request.get("round"))   # about an old round: it changed already
            member.seen = time.monotonic()
            if event == "done":
                self._done.add(node)
                if len(self._done) == len(self._members):
                    self._finish(0, "every task of every node exited 0")
            elif event == "leaving":
                self._next_round(f"{member.name} is leaving the job (its launcher got "
                                 f"{request.get('signal', 'a signal')})", preempted=True, lost=[node])
            else:
                code = int(request["code"])
                self._next_round(f"{request['task']} on {member.name} {request['how']}",
                                 preempted=code == PREEMPTED_EXIT_CODE, code=code)
            return self._answer(node, request.get("round"))

    def ended_for_everyone(self) -> bool:
        """Whether every node of the last round (or waiting for one) has been told the job ended (or is lost)."""
        with self._lock:
            self._advance()
            now = time.monotonic()
            return all(each.node in self._told_end or self._gone(each, now)
                       for each in (*self._members, *self._joining.values()))

    def stop(self, status: int, why: str) -> None:
        """Ends the job (the host is going): every node is told at its next poll."""
        with self._lock:
            if self._phase not in ("done", "failed"):
                self._finish(status or 1, why)

    @property
    def ended(self) -> tuple[int, str] | None:
        with self._lock:
            return self._end if self._phase in ("done", "failed") else None

    # -- the state -------------------------------------------------------------------------

    def _refusal(self, request: dict[str, Any]) -> str:
        rank = request.get("rank")
        who = f"node {rank} ({request.get('host')})" if rank is not None else f"the node at {request.get('host')}"
        different = self.shape.differences(request.get("shape", {}), f"on {who}", "on the rendezvous host")
        if different:
            refusal = (f"{who} was started otherwise than the rendezvous host: "
                       f"{'; '.join(different)}. Start every node with the same stratagem launch command "
                       f"line and script (only {', '.join(PER_NODE_OPTIONS)} may differ)")
            if self._round == 0 and self._phase == "forming":   # the job never ran: it cannot start so
                self._finish(1, refusal)
            elif self._say is not None:                          # a running job goes on without it
                self._say(f"refused a node: {refusal}")
            return refusal
        if rank is not None and not 0 <= rank < self.shape.max_nodes:
            return f"--node-rank {rank} is out of range for --nnodes {self.shape.max_nodes} (0 to {self.shape.max_nodes - 1})"
        others = (*self._joining.values(), *(self._members if self._phase == "running" else ()))
        taken = next((each for each in others
                      if rank is not None and each.rank == rank and each.node != request["node"]
                      and not self._gone(each, time.monotonic())), None)
        if taken is not None:
            return (f"--node-rank {rank} is taken by the node at {taken.host}, which is still "
                    "running; give every node its own --node-rank")
        return ""

    def _advance(self) -> None:
        """Applies what time alone changes: lost nodes, a round that forms or times out."""
        now = time.monotonic()
        if self._phase == "running":
            lost = [(each, why) for each in self._members if (why := self._gone(each, now))]
            if lost:
                self._next_round(f"{lost[0][0].name} {lost[0][1]}", lost=[each.node for each, _ in lost])
            return
        if self._phase != "forming":
            return
        for node, each in list(self._joining.items()):
            if self._gone(each, now):
                del self._joining[node]
        count = len(self._joining)
        # after a round, the nodes still in the job have all come back: waiting longer waits for nobody
        back = self._round > 0 and all(node in self._joining or self._gone(each, now)
                                       for node, each in self._expected.items())
        if count >= self.shape.max_nodes or (self.shape.elastic and count >= self.shape.least
                                             and (back or now - self._last_join >= self._settle)):
            self._form()
        elif now - self._forming_since > self._rdzv_timeout:
            self._finish(1, self._missing(count))

    def _missing(self, count: int) -> str:
        present = sorted(self._joining.values(), key=_position)
        needed = self.shape.least
        ranks = {each.rank for each in present}
        missing = ([f"node-rank {rank}" for rank in range(self.shape.max_nodes) if rank not in ranks]
                   if all(each.rank is not None for each in present) else [f"{needed - count} node(s)"])
        return (f"the rendezvous did not complete within {self._rdzv_timeout:g} s (--rdzv-timeout): "
                f"{count} of {needed} nodes joined ({', '.join(each.name for each in present) or 'none'}); "
                f"missing: {', '.join(missing)}. Start `stratagem launch` with the same options on the "
                "missing nodes, and check that they reach the rendezvous address")

    def _form(self) -> None:
        members = sorted(self._joining.values(), key=_position)[:self.shape.max_nodes]
        cluster: dict[str, list[str]] = {}
        for position, member in enumerate(members):
            for kind, port in zip(self.shape.tasks_on(position == 0), member.ports):
                cluster.setdefault(kind, []).append(format_address(member.host, port))
        self._members, self._cluster = members, cluster
        self._joining = {node: each for node, each in self._joining.items() if each not in members}
        self._phase, self._done = "running", set()

    def _gone(self, node: _Node, now: float) -> str:
        """Why ``node`` is lost ("" while it is not): silent too long, or its connection closed."""
        if now - node.seen > self._node_timeout:
            return f"stopped answering for {self._node_timeout:g} s"
        closed = self._closed.get(node.node)
        if closed is not None and node.seen < closed and now - closed >= CLOSED_GRACE:
            return "is gone: its launcher's connection to the rendezvous closed (the launcher died)"
        return ""

    def _next_round(self, why: str, *, preempted: bool = False, code: int = 1, lost: Sequence[str] = ()) -> None:
        count = sum(len(self.shape.tasks_on(i == 0)) for i in range(len(self._members)))
        where = f"all {count} tasks on {len(self._members)} node(s)"
        if preempted and self._preemptions < self.shape.max_preemptions:
            self._preemptions += 1
            news = (f"{why}; restarting {where} for preemption {self._preemptions}/"
                    f"{self.shape.max_preemptions} (does not count against --max-restarts)")
        elif preempted:
            return self._finish(PREEMPTED_EXIT_CODE, f"{why}, after {self._preemptions} preemption restart(s), "
                                "the most --max-preemptions allows; not restarting")
        elif self._restarts < self.shape.max_restarts:
            self._restarts += 1
            news = f"{why}; restarting {where} (restart {self._restarts}/{self.shape.max_restarts})"
        else:
            after = f" (after {self._restarts} restart(s))" if self._restarts else ""
            return self._finish(code if 1 <= code <= 255 else 1, f"{why}{after}; the job failed")
        self._round += 1
        self._news = news
        self._phase, self._forming_since = "forming", time.monotonic()
        self._last_join = self._forming_since
        for each in self._members:   # each survivor rejoins with fresh ports
            if each.node not in lost:
                each.seen = time.monotonic()
        self._expected = {each.node: each for each in (*self._members, *self._joining.values())
                          if each.node not in lost}
        self._joining = {}

    def _finish(self, status: int, why: str) -> None:
        self._phase = "done" if status == 0 else "failed"
        self._end, self._news = (status, why), why

    def _answer(self, node: str, round_: int | None = None) -> dict[str, Any]:
        if self._phase in ("done", "failed"):
            self._told_end.add(node)
            return {"state": self._phase, "status": self._end[0], "message": self._end[1]}
        if round_ is not None and round_ < self._round:
            return {"state": "restart", "round": self._round, "message": self._news}
        if self._phase == "running":
            for position, member in enumerate(self._members):
                if member.node == node:
                    return {"state": "run", "round": self._round, "cluster": self._cluster,
                            "tasks": self._tasks_of(position), "nodes": len(self._members)}
        waiting = len(self._joining)
        return {"state": "wait", "round": self._round, "joined": waiting, "needed": self.shape.least,
                "running": self._phase == "running"}

    def _tasks_of(self, position: int) -> list[tuple[str, int]]:
        """The (type, index) of each of a member's tasks, in the order of its ports."""
        before = {"worker": position * self.shape.workers_per_node}
        tasks, seen = [], dict(before)
        for kind in self.shape.tasks_on(position == 0):
            tasks.append((kind, seen.get(kind, 0)))
            seen[kind] = seen.get(kind, 0) + 1
        return tasks
