"""One node of a multi-node launch: its part of each round, and a supervisor that follows the job.

:class:`NodeAgent` talks to the rendezvous (``rendezvous.py``) for its node: it joins each
round with fresh ports on the node's address, waits until the round forms, and turns the
round's cluster into its local tasks and their environments (TF_CONFIG, the token,
``STRATAGEM_RESTART``). :class:`NodeSupervisor` is the local launcher's
:class:`~stratagem.launch.supervisor.Supervisor` for those tasks, except that the group's
fate is the job's: a local failure is reported and the rendezvous decides (restart every
node, or fail the job), a failure elsewhere restarts the local tasks too, and the node is
done when every node is.

The agent polls the rendezvous every :data:`POLL_SECONDS`; when it cannot reach it for
``node_timeout`` seconds, it stops its tasks and the launch fails, saying so (the host is
gone: nobody can restart the job). Beside the polls it keeps an ``attend`` call open: when
the agent's process dies its connection closes, and the host loses the node at once.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from stratagem.cluster import ClusterSpec
from stratagem.errors import ClusterConfigError, StratagemError, UnavailableError
from stratagem.launch.output import TaskOutput
from stratagem.launch.ports import free_ports
from stratagem.launch.job_shape import JobShape
from stratagem.launch.rendezvous import ATTEND_SECONDS
from stratagem.launch.supervisor import Supervisor, blame_order, describe_exit
from stratagem.launch.tasks import Task
from stratagem.rpc import AuthenticationError, RpcClient, RpcError

__all__ = ["NodeAgent", "NodeSupervisor", "RendezvousLost", "POLL_SECONDS"]

POLL_SECONDS = 0.5
_PROGRESS_SECONDS = 10.0   # how often "waiting for nodes" is said


class RendezvousLost(StratagemError):
    """The rendezvous host did not answer for the node timeout, or refused this node."""


class NodeAgent:
    """This node's side of the rendezvous; ``environment(task, cluster, round)`` makes a task's env."""

    def __init__(self, address: str, token: str, *, host: str, rank: int | None, shape: JobShape,
                 command: Sequence[str], environment: Callable[[Task, ClusterSpec, int], dict[str, str]],
                 output: TaskOutput, node_timeout: float, first: bool, rdzv_timeout: float = 600.0,
                 stop_requested: Callable[[], bool] = lambda: False) -> None:
        self._client = RpcClient(address, token, task="rendezvous", default_timeout=max(node_timeout / 3, 1.0))
        self._address = address
        self.node = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._host, self._rank, self.shape, self._first = host, rank, shape, first
        self._command = tuple(command)
        self._environment = environment
        self._output = output
        self._node_timeout = node_timeout
        self._first_timeout = rdzv_timeout   # before the rendezvous first answered
        self._heard = False
        self._stop_requested = stop_requested
        self.round = -1
        self.tasks: list[Task] = []
        self.ended: dict[str, Any] | None = None   # the rendezvous' last answer, once the job ended
        self._answered = time.monotonic()   # when the rendezvous last answered
        self._next_poll = 0.0
        self._attending: Future[Any] | None = None   # the attend call in flight

    def close(self) -> None:
        self._client.close()

    # -- rounds ----------------------------------------------------------------------------

    def next_round(self) -> list[dict[str, str]] | None:
        """Joins the round being formed and waits for it; its tasks' envs (None: stop now).

        Raises :class:`RendezvousLost` when the rendezvous is gone or refuses the node; a
        job that ended while waiting comes back as :attr:`ended`.
        """
        count = len(self.shape.tasks_on(self._first))
        ports = free_ports(count, self._host)
        request = {"node": self.node, "host": self._host, "ports": ports, "rank": self._rank,
                   "first": self._first, "shape": self.shape.as_dict()}
        answer = self._call("join", request)
        said = time.monotonic()
        while answer["state"] == "wait":
            if self._stop_requested():
                return None
            if time.monotonic() - said > _PROGRESS_SECONDS:
                said = time.monotonic()
                self._output.say(
                    "the job runs without this node (elastic); it joins at the next restart" if answer["running"]
                    else f"waiting for nodes at the rendezvous {self._address}: {answer['joined']} of "
                    f"{answer['needed']} joined round {answer['round']}")
            time.sleep(POLL_SECONDS / 2)
            answer = self._call("poll", {"node": self.node, "round": answer["round"]})
            if answer["state"] == "restart":   # (the round moved on while we waited: join it)
                answer = self._call("join", request)
        if answer["state"] == "refused":
            raise RendezvousLost(f"the rendezvous at {self._address} refused this node: {answer['message']}.")
        if answer["state"] in ("done", "failed"):
            self.ended = answer
            return None
        self.round = answer["round"]
        spec = ClusterSpec(answer["cluster"])
        self.tasks = [Task(kind, index, self._command, True) for kind, index in answer["tasks"]]
        self._output.say(f"round {self.round}: {answer['nodes']} node(s), this node runs "
                         f"{', '.join(task.name for task in self.tasks)}")
        return [self._environment(task, spec, self.round) for task in self.tasks]

    def poll(self) -> dict[str, Any] | None:
        """The heartbeat, at most every POLL_SECONDS: the rendezvous' answer, or None between."""
        if time.monotonic() < self._next_poll:
            return None
        self._next_poll = time.monotonic() + POLL_SECONDS
        return self._call("poll", {"node": self.node, "round": self.round})

    def report(self, event: str, **details: Any) -> dict[str, Any]:
        return self._call("report", {"node": self.node, "round": self.round, "event": event, **details})

    def _attend(self) -> None:
        """Keeps an attend call open to the rendezvous: when this launcher dies, its connection
        closes and the host knows at once (instead of after ``node_timeout`` of silence)."""
        if self._attending is not None and not self._attending.done():
            return
        try:
            self._attending = self._client.call_async("attend", {"node": self.node},
                                                      timeout=ATTEND_SECONDS + self._node_timeout)
        except (RpcError, UnavailableError):
            self._attending = None   # the host is unreachable: the polls say so

    def _call(self, method: str, request: dict[str, Any]) -> dict[str, Any]:
        self._attend()
        while True:
            try:
                answer = self._client.call(method, request)
            except AuthenticationError as error:
                raise RendezvousLost(
                    f"the rendezvous at {self._address} refused this node: {error}. Every node needs "
                    "the same cluster token (--token-file or STRATAGEM_CLUSTER_TOKEN)") from None
            except (RpcError, UnavailableError) as error:
                silent = time.monotonic() - self._answered
                patience = self._node_timeout if self._heard else self._first_timeout
                if silent > patience:
                    what = (f"has not answered for {silent:.0f} s (--node-timeout {self._node_timeout:g}): the "
                            "node hosting it (node-rank 0) is gone or unreachable, so the job cannot go on"
                            if self._heard else f"did not answer within {silent:.0f} s of this node's start "
                            "(--rdzv-timeout): is the node with --node-rank 0 started, and is --rdzv its address?")
                    raise RendezvousLost(f"the rendezvous at {self._address} {what}. Last error: {error}") from None
                if self._stop_requested():
                    return {"state": "failed", "status": 1, "message": "stopped while the rendezvous was unreachable"}
                time.sleep(POLL_SECONDS / 2)
                continue
            self._answered, self._heard = time.monotonic(), True
            return answer


class NodeSupervisor(Supervisor):
    """A node's tasks, restarted and stopped as the rendezvous decides for the whole job."""

    def __init__(self, agent: NodeAgent, first: list[dict[str, str]], **options: Any) -> None:
        self._agent = agent
        self._reported_done = False
        super().__init__(agent.tasks, lambda start: first, **options)

    def _on_group_exits(self, exits: list[tuple[Any, int]]) -> int | None:
        for slot, code in exits:
            slot.finished = code == 0
        failures = [(slot, code) for slot, code in exits if code != 0]
        if failures:
            slot, code = min(failures, key=lambda failure: blame_order(failure[1]))
            return self._follow(self._agent.report("failed", task=slot.task.name, code=code,
                                                   how=describe_exit(code)))
        if not self._reported_done and all(slot.finished for slot in self._slots):
            self._reported_done = True
            return self._follow(self._agent.report("done"))
        return None

    def _peer_status(self) -> int | None:
        answer = self._agent.poll()
        return None if answer is None else self._follow(answer)

    def _all_trained(self) -> bool:
        return False   # the job is done when the rendezvous says so (every node), not before

    def leave(self, signum: int) -> None:
        """After the launcher was stopped: tell the rendezvous this node is leaving the job."""
        try:
            self._agent.report("leaving", signal=signal.Signals(signum).name)
        except (RendezvousLost, RpcError, UnavailableError, ClusterConfigError):
            pass   # the host is gone: there is nobody to tell

    def _follow(self, answer: dict[str, Any]) -> int | None:
        state = answer["state"]
        if state == "run":
            return None
        if state in ("done", "failed"):
            if state == "failed" or self._count_running():
                self._output.say(f"the job {'ended' if state == 'done' else 'failed'}: {answer['message']}")
            return int(answer["status"])
        self._output.say(answer.get("message") or "the job moved on to another round")   # restart
        started = time.monotonic()
        self._stop_all(self._slots)
        if self._signals:
            return None
        environments = self._agent.next_round()
        if environments is None:
            ended = self._agent.ended
            if ended is None:   # stopped while waiting
                return None
            return self._follow(ended)
        training = [(task, env) for task, env in zip(self._agent.tasks, environments) if task.trains]
        for slot, (task, env) in zip(self._slots, training):   # the evaluator goes on as it is
            slot.task, slot.env, slot.prefix = task, env, f"[{task.name}] "
            self._start(slot)
        self._reported_done = False
        self._output.say(f"started this node's {len(self._slots)} task(s) again (STRATAGEM_RESTART="
                         f"{self._agent.round}) {time.monotonic() - started:.1f} s after the restart was decided")
        return None
