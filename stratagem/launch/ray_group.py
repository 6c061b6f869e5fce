"""One start of a job's tasks on Ray: placed, given their TF_CONFIG and token, watched, stopped.

:class:`RayGroup` is what :func:`~stratagem.launch.ray_launch.launch_ray` makes at every
start of the job (the first, and one per restart)::

    placement group   one bundle per task (``cpus_per_task``, ``gpus_per_task``):
                      STRICT_SPREAD with ``spread=True`` (every task on a node of its own;
                      refused at once when the cluster has fewer nodes than tasks), else
                      PACK; waited for up to ``placement_timeout`` seconds, then refused,
                      saying what was asked
    actors            one TaskRunner (``ray_actor.py``) per task, in its bundle; each
                      reports its node's address and a free port there; two tasks given the
                      same address are asked again
    ClusterSpec       built from what the actors reported; each task's TF_CONFIG from it
    token             :func:`choose_token`
    start             every actor starts its task's process

Then :meth:`RayGroup.poll` hands over the tasks' output lines and exits, and
:meth:`RayGroup.stop` stops every task (SIGTERM, the grace period, SIGKILL, on each node),
kills the actors and removes the placement group. A group is never reused: a restart makes
a new one, with new actors, new ports and so a new rendezvous.

The token (``choose_token``), decided from what the actors report:

- every node has ``STRATAGEM_CLUSTER_TOKEN`` in its environment (where Ray started there):
  the tasks use it, and it never travels; the nodes' digests must agree and each token
  must be strong, else the launch is refused, naming the tasks;
- no node has one: a fresh token for the job (``secrets``), sent to the actors through Ray,
  but only where Ray's messages do not leave the machine (every task on a loopback address)
  or are encrypted (Ray's TLS, ``RAY_USE_TLS=1``); otherwise refused, saying how to give one.

Example::

    >>> from stratagem.launch.ray_actor import NodeReport
    >>> from stratagem.launch.ray_group import choose_token
    >>> here = NodeReport("127.0.0.1", 2222, "node-a", None, None, "/")
    >>> choose_token(["worker 0"], [here], "the-job's-token")   # stays on this machine: sent
    "the-job's-token"
    >>> held = NodeReport("10.0.0.2", 2222, "node-b", "9f86d08...", None, "/")
    >>> choose_token(["worker 0"], [held], "the-job's-token") is None   # the node's own is used
    True
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stratagem.cluster import ClusterSpec
from stratagem.errors import ClusterConfigError
from stratagem.launch.ports import format_address
from stratagem.launch.local import TOKEN_VARIABLE
from stratagem.launch.ray_actor import NodeReport, TaskRunner
from stratagem.launch.tasks import Task, tf_config, torchrun_variables

__all__ = ["GroupEvent", "RayGroup", "choose_token", "is_loopback"]

_READ_SECONDS = 0.5     # how long one read waits for output on the node
_STOP_SLACK = 15.0      # beyond the grace period, how long stopping a task may take (a busy node)
_RETRY_SECONDS = 0.5    # how soon an actor that could not be reached is asked again


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _tls_on() -> bool:
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def choose_token(names: Sequence[str], reports: Sequence[NodeReport], fresh: str) -> str | None:
    """``fresh`` (the job's token) to send to the actors, or None when the nodes' own is used.

    The rules are in the module docstring; ``names`` are the tasks of ``reports``, in order.
    Raises ClusterConfigError, naming the tasks, when the nodes' tokens are weak, differ, or
    are missing on some nodes, or when a fresh token would travel between machines in the clear.
    """
    weak = [(name, r) for name, r in zip(names, reports) if r.token_problem]
    if weak:
        raise ClusterConfigError(
            f"{', '.join(name for name, _ in weak)}: {weak[0][1].token_problem} (the node at "
            f"{weak[0][1].host}); give every node the same strong {TOKEN_VARIABLE} where Ray starts "
            "there, or none at all")
    held = [name for name, r in zip(names, reports) if r.token_digest]
    if held:
        missing = [(name, r.host) for name, r in zip(names, reports) if not r.token_digest]
        if missing:
            raise ClusterConfigError(
                f"{TOKEN_VARIABLE} is set on the nodes of {', '.join(held)} but not on the nodes of "
                f"{', '.join(f'{name} ({host})' for name, host in missing)}: set the same token in "
                "the environment of `ray start` on every node (or on none, for a one-machine cluster)")
        digests = {r.token_digest for r in reports}
        if len(digests) > 1:
            groups = {digest: [f"{name} ({r.host})" for name, r in zip(names, reports) if r.token_digest == digest]
                      for digest in sorted(digests)}
            raise ClusterConfigError(
                f"the nodes hold different {TOKEN_VARIABLE}s: "
                + "; ".join(f"one token on {', '.join(tasks)}" for tasks in groups.values())
                + ". Every node must have the same one where Ray starts there")
        return None
    remote = sorted({r.host for r in reports if not is_loopback(r.host)})
    if remote and not _tls_on():
        raise ClusterConfigError(
            f"no node has {TOKEN_VARIABLE} in its environment, and a token made here would travel "
            f"through Ray unencrypted to the nodes at {', '.join(remote)}. Make one "
            "(python -c \"import secrets; print(secrets.token_urlsafe(32))\") and set it in the "
            "environment of `ray start` on every node, or turn on Ray's TLS (RAY_USE_TLS=1 with its "
            "certificates, on every node and here)")
    return fresh


@dataclass
class GroupEvent:
    """What one poll saw of a task: its new output lines, and its exit or the actor's death."""

    index: int                 # the task's position in the job's task list
    lines: list[bytes]
    code: int | None = None    # its exit code, once it exited
    died: str | None = None    # why its actor is gone (Ray's message), if it is
    joined: bool = False


class RayGroup:
    """The actors and processes of one start of the job's tasks (see the module docstring)."""

    def __init__(self, ray: Any, tasks: Sequence[Task], *, spread: bool, resources: Mapping[str, float],
                 runtime_env: Mapping[str, Any] | None, placement_timeout: float, grace_period: float,
                 check_hosts: Callable[[Sequence[NodeReport]], None],
                 interrupted: Callable[[], bool] = lambda: False) -> None:
        self._ray, self._tasks = ray, list(tasks)
        self._grace_period = grace_period
        self._actors: list[Any] = []
        self._pending: dict[Any, int] = {}   # read() in flight: its reference -> task index
        self._dead: set[int] = set()         # the tasks whose actor is known to be gone
        self._retry: dict[int, float] = {}   # actors unreachable for now: when to read again
        self._group = None
        self._spread, self._resources, self._runtime_env = spread, dict(resources), runtime_env
        self._placement_timeout, self._check_hosts = placement_timeout, check_hosts
        self._interrupted = interrupted
        self.reports: list[NodeReport] = []
        self.started_at = time.monotonic()

    def place(self) -> None:
        """Places the tasks and makes their actors; each reports its address (call :meth:`stop` after)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ray, resources = self._ray, self._resources
        self._group = _place(ray, len(self._tasks), self._spread, resources, self._placement_timeout,
                             self._wait)
        options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
                                   "max_concurrency": 4, "max_restarts": 0}
        if self._runtime_env:
            options["runtime_env"] = dict(self._runtime_env)
        remote = ray.remote(TaskRunner)
        self._actors = [remote.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._group, placement_group_bundle_index=index)).remote(self._grace_period)
            for index in range(len(self._tasks))]
        self.reports = self._reports(self._placement_timeout)
        self._check_hosts(self.reports)

    def _wait(self, refs: list[Any], timeout: float) -> list[Any]:
        """``ray.get(refs)`` within ``timeout`` s (GetTimeoutError), or InterruptedError on a signal."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(left, 0.2)))
            if len(ready) == len(refs):
                return self._ray.get(refs)
            if self._interrupted():
                raise InterruptedError("the launcher was interrupted while the tasks were being placed")
            if left <= 0:
                raise self._ray.exceptions.GetTimeoutError(f"not ready within {timeout:g} s")

    def _reports(self, timeout: float) -> list[NodeReport]:
        names = [task.name for task in self._tasks]
        try:
            reports = self._wait([actor.report.remote() for actor in self._actors], timeout)
            taken: dict[str, set[int]] = {}
            for index, report in enumerate(reports):   # two tasks of one node given one port: ask again
                while report.port in taken.setdefault(report.host, set()):
                    report = self._wait([self._actors[index].report.remote(sorted(taken[report.host]))],
                                        timeout)[0]
                taken[report.host].add(report.port)
                reports[index] = report
            return reports
        except self._ray.exceptions.RayActorError as error:   # it could not even start
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise ClusterConfigError(
                f"a task's Ray actor failed to start: {lines[-1] if lines else error}. Every node needs "
                "stratagem (this version) importable by Ray's workers: installed in their Python, or given "
                "with runtime_env") from None
        except self._ray.exceptions.GetTimeoutError:
            raise ClusterConfigError(
                f"the actors of {', '.join(names)} did not start within {timeout:g} s (placement_timeout); "
                "see `ray status` and the Ray logs of the nodes") from None

    def start(self, restart: int, token: str | None, cwd: str) -> list[str]:
        """Starts every task; returns their addresses. Their environment adds TF_CONFIG and the rest."""
        reports = self.reports
        cluster: dict[str, list[str]] = {}
        for task, report in zip(self._tasks, reports):
            cluster.setdefault(task.task_type, []).append(format_address(report.host, report.port))
        spec = ClusterSpec(cluster)
        calls = []
        for task, actor in zip(self._tasks, self._actors):
            env = {"TF_CONFIG": tf_config(spec, task), "PYTHONUNBUFFERED": "1", "STRATAGEM_RESTART": str(restart),
                   **torchrun_variables(spec, task)}
            calls.append(actor.start.remote(task.name, list(task.command[1:]), env, cwd, token))
        try:
            self._ray.get(calls)
        except self._ray.exceptions.RayTaskError as error:   # the script is missing on a node
            if isinstance(error.cause, FileNotFoundError):
                raise ClusterConfigError(str(error.cause)) from None
            raise
        for index in range(len(self._actors)):
            self._read(index)
        self.started_at = time.monotonic()
        return [format_address(r.host, r.port) for r in reports]

    def poll(self, timeout: float) -> list[GroupEvent]:
        """The output and exits seen within ``timeout`` seconds (every task's, once ready)."""
        now = time.monotonic()
        for index, due in list(self._retry.items()):
            if due <= now:
                del self._retry[index]
                self._read(index)
        if not self._pending:
            time.sleep(timeout)
            return []
        ready, _ = self._ray.wait(list(self._pending), num_returns=len(self._pending), timeout=timeout)
        events = []
        for ref in ready:
            index = self._pending.pop(ref)
            try:
                lines, code, joined = self._ray.get(ref)
            except self._ray.exceptions.ActorUnavailableError:   # unreachable for now (its node?)
                self._retry[index] = time.monotonic() + _RETRY_SECONDS
                continue
            except self._ray.exceptions.RayActorError as error:
                self._dead.add(index)
                events.append(GroupEvent(index, [], died=_why_dead(error)))
                continue
            events.append(GroupEvent(index, lines, code, joined=joined))
            if code is None:
                self._read(index)
        return events

    def _read(self, index: int) -> None:
        self._pending[self._actors[index].read.remote(_READ_SECONDS)] = index

    def running(self) -> int:
        """How many tasks are still running (their exit not seen yet)."""
        return len(self._pending) + len(self._retry)

    def stop(self) -> None:
        """Stops every task on its node, kills the actors, removes the placement group."""
        calls = [actor.stop.remote(self._grace_period) for index, actor in enumerate(self._actors)
                 if index not in self._dead]
        if calls:
            with contextlib.suppress(Exception):   # a dead actor's task is gone with it
                self._ray.wait(calls, num_returns=len(calls), timeout=self._grace_period + _STOP_SLACK)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
        self._actors, self._pending, self._retry = [], {}, {}
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None


def _why_dead(error: Exception) -> str:
    """Ray's reason for an actor's death, on one line: where it ran and why, without advice."""
    text = " ".join(str(error).split())
    where = " on ".join(match[1] for match in (re.search(r"\bpid: (\d+)", text), re.search(r"\bip: (\S+)", text))
                        if match)
    at = max(text.find("The actor is dead because"), 0)
    reason = text[at:].split(" Some common causes")[0][:300].rstrip()
    return f"pid {where}: {reason}" if where else reason


def _place(ray: Any, count: int, spread: bool, resources: Mapping[str, float], timeout: float,
           wait: Callable[[list[Any], float], list[Any]]) -> Any:
    """A ready placement group of ``count`` bundles, or ClusterConfigError saying what is missing."""
    from ray.util.placement_group import placement_group, remove_placement_group
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if spread and len(nodes) < count:
        raise ClusterConfigError(
            f"spread=True (--ray-spread) puts each of the {count} tasks on a node of its own, but the Ray "
            f"cluster has {len(nodes)} node(s) alive: add nodes (`ray start --address ...` on each), "
            "or leave spread off to let tasks share nodes")
    bundle = {key: value for key, value in resources.items() if value}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_SPREAD" if spread else "PACK")
    try:
        wait([group.ready()], timeout)
        return group
    except ray.exceptions.GetTimeoutError:
        pass
    except BaseException:
        remove_placement_group(group)
        raise
    remove_placement_group(group)
    total: dict[str, float] = {}
    for node in nodes:
        for key in bundle:
            total[key] = total.get(key, 0.0) + node.get("Resources", {}).get(key, 0.0)
    how = "each on its own node" if spread else "on the cluster's nodes"
    raise ClusterConfigError(
        f"Ray could not place {count} tasks with {bundle} each, {how}, within {timeout:g} s "
        f"(placement_timeout): the cluster has {len(nodes)} node(s) alive with {total} in all, and "
        "other jobs may hold some. Ask for less per task (cpus_per_task, gpus_per_task), add nodes, or "
        "see `ray status`")
