"""The multi-node launcher: ``stratagem launch --nnodes N --rdzv HOST:PORT`` on every node.

The same command runs on each node (torchrun's way). One node, the *host*, serves the
rendezvous at ``--rdzv``: the node started with ``--node-rank 0``, or, without node ranks, the
node whose address the rendezvous address is (the first such launcher to bind it). Each node
runs ``--workers`` workers (per node: torchrun's ``--nproc-per-node``); the host also runs
the chief (``--chief``) and the evaluator (``--evaluator 1``). Every round of the job
(``rendezvous.py``) gives each task its TF_CONFIG for the whole cluster, the job's token and
``STRATAGEM_RESTART``; the tasks listen on their node's ``--host`` address (default: the
address this node reaches the rendezvous host from).

What the local launcher does for one machine holds across the nodes: a task that fails on
any node restarts every task on every node with a new rendezvous (up to ``--max-restarts``);
a task that exits with 75 (preempted, after its group saved) restarts them without spending a
restart; SIGTERM (or SIGINT) on one node stops its tasks (a ``PreemptionWatcher`` in the
script makes the whole group save and exit 75) and that node leaves the job, which restarts
without it: an elastic job (``--nnodes MIN:MAX``) goes on with the nodes left, a fixed-size
one waits for the node's return (its replacement runs the same command). A node that stops
answering for ``--node-timeout`` seconds is lost, the same way, and one whose launcher dies
at once (its connection to the rendezvous closes). A rendezvous that does not complete
within ``--rdzv-timeout`` seconds fails the job, naming the missing nodes. The host is the
one node the job cannot lose: without it the others stop, saying so.

**The same command line.** Every node must be started with the same options but the
per-node ones (``--node-rank``, ``--host``, ``--rdzv``, ``--token-file``), the same script
(its contents: their SHA-256 is compared) and, without ``--per-node-args``, the same script
arguments: the rendezvous compares them and names each difference with both values.

**The token.** Every node must hold the same cluster token: the user's secret, from the file
``--token-file`` (readable by its owner alone) or the environment variable
``STRATAGEM_CLUSTER_TOKEN``, and random (the rule of :mod:`stratagem.rpc.tokens`). It never
appears in a command line and never travels: the rendezvous' messages carry codes made with
it (:mod:`stratagem.rpc.auth`), so a node with another token is refused, and the host says
from which address. The tasks get it in their environment, as in a local launch.

Example (two nodes, 10.0.0.1 and 10.0.0.2)::

    # on both: the token, made once and copied to each node's ~/.stratagem-token (mode 600)
    stratagem launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --token-file ~/.stratagem-token train.py
    stratagem launch --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --token-file ~/.stratagem-token train.py
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from stratagem.cluster import ClusterSpec
from stratagem.cluster.joined import JOINED_VARIABLE
from stratagem.cluster.spec import is_wildcard_host, validate_address
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.launch.local import TOKEN_VARIABLE, task_env
from stratagem.launch.node_agent import NodeAgent, NodeSupervisor, RendezvousLost
from stratagem.launch.output import TaskOutput
from stratagem.launch.job_shape import JobShape
from stratagem.launch.rendezvous import Rendezvous
from stratagem.launch.supervisor import EXIT_STATUS_ON_SIGNAL
from stratagem.launch.tasks import Task
from stratagem.observe.answer import OBSERVE_VARIABLE
from stratagem.rpc import RpcServer
from stratagem.rpc.server import caller_gone
from stratagem.rpc.tokens import MAKE_TOKEN, check_token_strength

__all__ = ["launch_nodes", "parse_nnodes", "read_token"]


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """``"3"`` -> (3, 3); ``"2:3"`` -> (2, 3) (elastic: at least 2, at most 3 nodes)."""
    text = str(value)
    low, colon, high = text.partition(":")
    try:
        least = int(low)
        most = int(high) if colon else least
    except ValueError:
        least = most = 0
    if not 1 <= least <= most:
        raise InvalidArgumentError(
            f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2, or 2:3 for an elastic job of "
            f"2 to 3 nodes), got {text!r}.")
    return least, most


def read_token(token_file: str | None, environ: dict[str, str] | None = None) -> str:
    """The cluster token of a multi-node job: ``token_file``, else STRATAGEM_CLUSTER_TOKEN."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            mode = os.stat(token_file).st_mode
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as error:
            raise ClusterConfigError(f"cannot read --token-file {token_file!r}: {error.strerror or error}.") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterConfigError(
                f"--token-file {token_file!r} can be read by other users (mode {stat.filemode(mode)}): "
                f"anyone who reads it can run code on every node. Run `chmod 600 {token_file}`.")
        source = f"--token-file {token_file!r}"
    elif env.get(TOKEN_VARIABLE):
        token, source = env[TOKEN_VARIABLE], TOKEN_VARIABLE
    else:
        raise ClusterConfigError(
            f"a multi-node launch needs the cluster token on every node: write one with `{MAKE_TOKEN}` "
            f"to a file readable only by you, copy it to each node, and give --token-file PATH (or "
            f"export {TOKEN_VARIABLE}); it never goes on a command line.")
    check_token_strength(token, source=source)
    return token


#: launch_nodes' parameters that are not options every node shares (the rest are, named as
#: on the command line: ``grace_period`` is ``--grace-period``).
_NOT_SHARED = frozenset({"script", "args", "token", "node_rank", "host", "rdzv", "options", "stdout", "stderr"})


def _keyword_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """launch_nodes' shared keyword arguments as the options of its command line."""
    names = inspect.signature(launch_nodes).parameters
    return {"--" + name.replace("_", "-"): given[name] for name in names if name not in _NOT_SHARED}


def _digest(script: str) -> str:
    """The SHA-256 of the script's contents: the nodes compare it, not its path."""
    try:
        with open(script, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read the script {script!r}: {error.strerror or error}.") from None


def _route_address(host: str) -> str:
    """This machine's address on the way to ``host`` (a UDP connect sends nothing)."""
    bare = host.strip("[]")
    try:
        family, _, _, _, target = socket.getaddrinfo(bare, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return probe.getsockname()[0]
    except OSError as error:
        raise ClusterConfigError(
            f"cannot find this node's way to the rendezvous host {host!r} ({error}); check the --rdzv "
            "address, or give this node's address with --host.") from None


class _Signals:
    """SIGINT/SIGTERM while the launcher runs: remembered, and passed to the supervisor once there."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.supervisor: NodeSupervisor | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in EXIT_STATUS_ON_SIGNAL}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, old in self._previous.items():
            signal.signal(signum, old)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.supervisor is not None:
            self.supervisor.interrupt(signum)


class _SayRefusals(logging.Handler):
    """The rendezvous server's refusals (a wrong token, with the caller's address), in the launcher's output."""

    def __init__(self, output: TaskOutput) -> None:
        super().__init__(logging.WARNING)
        self._output = output

    def emit(self, record: logging.LogRecord) -> None:
        self._output.say(record.getMessage())


def launch_nodes(script: str, args: Sequence[str] = (), *, nnodes: str | int, rdzv: str,
                 token: str, node_rank: int | None = None, host: str | None = None,
                 workers: int = 1, chief: bool = False, evaluator: int = 0, max_restarts: int = 0,
                 max_preemptions: int = 100, grace_period: float = 5.0, join_timeout: float = 600.0,
                 evaluator_timeout: float = 600.0, node_timeout: float = 30.0, rdzv_timeout: float = 600.0,
                 per_node_args: bool = False, options: Mapping[str, Any] | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Runs this node's part of a multi-node job; returns the job's exit status.

    The arguments are ``stratagem launch``'s (see the module docstring); ``token`` is the
    job's cluster token (:func:`read_token`). Bad arguments raise InvalidArgumentError or
    ClusterConfigError before anything starts.

    Every node must agree on ``options`` (the command line's options by name, all but
    :data:`~stratagem.launch.job_shape.PER_NODE_OPTIONS`; default: this call's keyword
    arguments, named so), on the script's contents and, unless ``per_node_args``, on ``args``:
    the rendezvous refuses a node that differs, naming each difference with both values.
    """
    if options is None:
        options = _keyword_options(locals())
    least, most = parse_nnodes(nnodes)
    validate_address(rdzv, where=f"--rdzv {rdzv!r}")
    rdzv_host = rdzv.rpartition(":")[0]
    if is_wildcard_host(rdzv_host) or (host is not None and is_wildcard_host(host)):
        raise ClusterConfigError(
            f"--rdzv {rdzv!r} / --host {host!r}: a wildcard address means every interface. Give the "
            "rendezvous host's own address in --rdzv, and this node's address in --host.")
    if node_rank is not None and not 0 <= node_rank < most:
        raise InvalidArgumentError(f"--node-rank must be 0 to {most - 1} for --nnodes {nnodes}, got {node_rank}.")
    if workers < 1:
        raise InvalidArgumentError(f"--workers (per node) must be 1 or more in a multi-node launch, got {workers}.")
    check_token_strength(token, source="the cluster token")
    host = host or _route_address(rdzv_host)
    shape = JobShape(max_nodes=most, min_nodes=least if least < most else 0, workers_per_node=workers,
                     chief=chief, evaluator=evaluator, max_restarts=max_restarts,
                     max_preemptions=max_preemptions, script=os.path.basename(script),
                     options=tuple(options.items()), script_digest=_digest(script),
                     script_args=None if per_node_args else tuple(args))
    output = TaskOutput(sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr)
    if evaluator not in (0, 1):
        raise InvalidArgumentError(f"--evaluator must be 0 or 1, got {evaluator}: a cluster has at most one "
                                   "evaluator task (it runs on node 0).")
    server = _serve(rdzv, token, shape, node_rank, node_timeout, rdzv_timeout, output)
    joined = tempfile.mkdtemp(prefix="stratagem-joined-")
    observe = tempfile.mkdtemp(prefix="stratagem-observe-")   # this node's tasks answer there

    def environment(task: Task, spec: ClusterSpec, round_: int) -> dict[str, str]:
        return {**task_env(os.environ, spec, task, token, round_), JOINED_VARIABLE: joined, OBSERVE_VARIABLE: observe}

    command = (sys.executable, script, *args)
    try:
        with _Signals() as signals:
            agent = NodeAgent(rdzv, token, host=host, rank=node_rank, shape=shape, command=command,
                              environment=environment, output=output, node_timeout=node_timeout,
                              rdzv_timeout=rdzv_timeout, first=server is not None, stop_requested=lambda: bool(signals.received))
            try:
                return _run(agent, signals, output, grace_period=grace_period, join_timeout=join_timeout,
                            evaluator_timeout=evaluator_timeout, joined=joined, server=server)
            except RendezvousLost as lost:
                output.say(f"error: {lost}")
                return 1
            finally:
                agent.close()
    finally:
        if server is not None:
            _close(*server, node_timeout)
        shutil.rmtree(joined, ignore_errors=True)
        shutil.rmtree(observe, ignore_errors=True)


def _run(agent: NodeAgent, signals: _Signals, output: TaskOutput, *, grace_period: float,
         join_timeout: float, evaluator_timeout: float, joined: str,
         server: tuple[RpcServer, Rendezvous, logging.Handler] | None) -> int:
    environments = agent.next_round()
    if environments is None:
        if agent.ended is not None:
            output.say(f"the job {agent.ended['state']}: {agent.ended['message']}")
            return int(agent.ended["status"])
        return EXIT_STATUS_ON_SIGNAL.get(signals.received[0], 1)
    supervisor = NodeSupervisor(agent, environments, max_restarts=0, output=output,
                                grace_period=float(grace_period), evaluator_timeout=float(evaluator_timeout),
                                join_timeout=float(join_timeout), joined_folder=joined)
    signals.supervisor = supervisor
    for signum in signals.received:
        supervisor.interrupt(signum)
    status = supervisor.run()
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        if server is not None:   # the host is going: so is the job
            server[1].stop(status, f"the rendezvous host (node-rank 0) got {name}")
        else:
            supervisor.leave(signals.received[0])
    return status


def _serve(rdzv: str, token: str, shape: JobShape, node_rank: int | None, node_timeout: float,
           rdzv_timeout: float, output: TaskOutput) -> tuple[RpcServer, Rendezvous, logging.Handler] | None:
    """Starts the rendezvous when this node hosts it; None when another node does."""
    if node_rank is not None and node_rank > 0:
        return None
    state = Rendezvous(shape, node_timeout=node_timeout, rdzv_timeout=rdzv_timeout, say=output.say,
                       caller_gone=caller_gone)
    try:   # (every node holds a thread with its attend call, and polls beside it)
        server = RpcServer(rdzv, state.handlers(), token, name="rendezvous",
                           max_workers=16 + 2 * shape.max_nodes).start()
    except ClusterConfigError as error:
        if node_rank == 0:
            raise ClusterConfigError(
                f"node-rank 0 hosts the rendezvous, but it cannot listen on --rdzv {rdzv!r}: {error} "
                "--rdzv must be an address of the node started with --node-rank 0.") from None
        return None   # another launcher on this machine has it, or it is another machine's
    handler = _SayRefusals(output)
    logging.getLogger("stratagem.rpc").addHandler(handler)
    output.say(f"serving the rendezvous of {shape.least if shape.elastic else shape.max_nodes}"
               f"{f'-{shape.max_nodes}' if shape.elastic else ''} node(s) at {server.address}")
    return server, state, handler


def _close(server: RpcServer, state: Rendezvous, handler: logging.Handler, node_timeout: float) -> None:
    """Keeps serving until every node heard how the job ended (or is lost), then stops."""
    deadline = time.monotonic() + node_timeout + 2.0
    while time.monotonic() < deadline and state.ended is not None and not state.ended_for_everyone():
        time.sleep(0.1)
    logging.getLogger("stratagem.rpc").removeHandler(handler)
    server.stop(grace=1.0)
