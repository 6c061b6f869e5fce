"""``stratagem server``: serve one worker or parameter-server task until told to stop.

In parameter-server training only the coordinator (the chief) runs the user's script; every
worker and parameter server runs ``stratagem server``, which reads TF_CONFIG (or a Kubernetes
JobSet pod's variables, docs/kubernetes.md), finds its own task and address in the cluster,
and serves that task's RPC service on exactly that address until SIGTERM or SIGINT (then it
stops within about a second). ``stratagem launch --ps M`` starts them for a local cluster;
on a real cluster run one per host::

    TF_CONFIG='{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"], "ps": ["h2:2222"]},
                "task": {"type": "ps", "index": 0}}' \\
    STRATAGEM_CLUSTER_TOKEN=... stratagem server

It prints one line once it accepts calls, ``[stratagem server] ps 0 listening on
h2:2222``, and answers only callers that hold the cluster token.

What a task serves is looked up in :data:`SERVICES`, task type -> service factory: a
callable ``factory(task: TaskInfo)`` returning an object with ``handlers() -> {name:
handler}`` (and optionally ``close()``, called on stop), or the "module:attribute" name of
one, imported when needed. "ps" serves a :class:`~stratagem.ps.service.ParameterServer`,
"worker" a :class:`~stratagem.ps.worker.WorkerService`; :func:`register_service` adds or
replaces one.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

import torch

from stratagem.cluster import ClusterSpec, resolve
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc import DEFAULT_MAX_MESSAGE_BYTES, Handler, RpcServer, cluster_token

__all__ = ["SERVICES", "Service", "ServiceFactory", "TaskInfo", "add_subcommand",
           "register_service", "resolve_task", "serve"]

PREFIX = "[stratagem server]"


@dataclass(frozen=True)
class TaskInfo:
    """The task a server runs: its place in the cluster and the address it listens on."""

    task_type: str
    task_id: int
    address: str
    cluster_spec: ClusterSpec

    @property
    def name(self) -> str:
        """``"ps 0"``, ``"worker 1"``: how logs and errors name the task."""
        return f"{self.task_type} {self.task_id}"


class Service(Protocol):
    """What a service factory returns: the RPC handlers of the task."""

    def handlers(self) -> Mapping[str, Handler]: ...


ServiceFactory = Callable[[TaskInfo], Service]

#: Task type -> service factory (or its "module:attribute" name, imported when needed).
SERVICES: dict[str, Union[ServiceFactory, str]] = {
    "ps": "stratagem.ps.service:ps_service",
    "worker": "stratagem.ps.worker:WorkerService",
}

_NOT_SERVED = {
    "chief": "the chief runs the training script (it is the coordinator), not `stratagem server`",
    "evaluator": "an evaluator runs the training script itself (an sg.SidecarEvaluator there; "
                 "`stratagem launch --evaluator 1` starts one), not `stratagem server`",
}


def register_service(task_type: str, factory: ServiceFactory | str) -> None:
    """Makes ``stratagem server`` serve ``factory(task)`` for tasks of ``task_type``."""
    if not isinstance(task_type, str) or not task_type:
        raise InvalidArgumentError(f"task_type must be a non-empty str, got {task_type!r}.")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise InvalidArgumentError(
            f"a service factory is a callable or a 'module:attribute' string, got {factory!r}.")
    SERVICES[task_type] = factory


def _factory(task_type: str) -> ServiceFactory:
    factory = SERVICES.get(task_type)
    if factory is None:
        why = _NOT_SERVED.get(task_type, "no service is registered for it yet (register one with "
                              f"stratagem.ps.server.register_service({task_type!r}, factory))")
        raise ClusterConfigError(
            f"the cluster (TF_CONFIG, or a Kubernetes pod's variables) makes this a {task_type!r} "
            f"task, which `stratagem server` cannot serve: {why}. It serves {sorted(SERVICES)} "
            "tasks.")
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attribute)
    return factory  # type: ignore[return-value]


def resolve_task(environ: Mapping[str, str] | None = None) -> TaskInfo:
    """This process's task, from TF_CONFIG, a Slurm step's or a Kubernetes pod's environment
    (``resolve``); a clear error when there is none."""
    resolver = resolve(environ)
    if resolver.task_type is None or resolver.task_id is None:
        raise ClusterConfigError(
            "`stratagem server` needs TF_CONFIG naming the cluster and this task, like "
            '\'{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": '
            '["host2:2222"]}, "task": {"type": "ps", "index": 0}}\'; `stratagem launch --ps N` '
            "sets it for local clusters, a TFJob for its pods; a JobSet's pods describe it with "
            "STRATAGEM_JOBS instead (docs/kubernetes.md), and under srun STRATAGEM_SLURM_JOBS names "
            "the jobs (docs/slurm.md).")
    spec = resolver.cluster_spec()
    address = spec.task_address(resolver.task_type, resolver.task_id)
    return TaskInfo(resolver.task_type, resolver.task_id, address, spec)


def serve(task: TaskInfo, token: str, stop: threading.Event, *,
          max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_workers: int = 16,
          announce: Callable[[str], None] = print) -> None:
    """Serves ``task``'s service on its address until ``stop`` is set.

    ``announce`` gets the "listening" line once calls are accepted.
    """
    service = _factory(task.task_type)(task)
    server = RpcServer(task.address, service.handlers(), token, name=task.name,
                       max_message_bytes=max_message_bytes, max_workers=max_workers).start()
    try:
        announce(f"{PREFIX} {task.name} listening on {server.address}")
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(grace=1.0)
        close = getattr(service, "close", None)
        if callable(close):
            close()


def _keep_large_buffers() -> None:
    """Ask glibc to reuse the buffers of large messages instead of returning them to the OS
    after every call: otherwise each pull and push page-faults its megabytes in again
    (measured: about a third of a ps's CPU time)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, 256 << 20)   # M_MMAP_THRESHOLD: allocate below 256 MiB from the heap
    libc.mallopt(-1, 1 << 30)     # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"{PREFIX} %(levelname)s %(name)s: %(message)s")
    task = resolve_task()
    token = cluster_token()
    if args.torch_threads < 1:
        raise InvalidArgumentError(f"--torch-threads must be >= 1, got {args.torch_threads}.")
    torch.set_num_threads(args.torch_threads)
    _keep_large_buffers()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve(task, token, stop, max_message_bytes=args.max_message_bytes,
              max_workers=args.max_workers, announce=lambda line: print(line, flush=True))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        print(f"{PREFIX} {task.name} stopped ({signal.Signals(received[0]).name})", flush=True)
    return 0


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``stratagem server`` (see the module docstring)."""
    parser = subparsers.add_parser(
        "server", help="serve this worker or parameter-server task (from TF_CONFIG) until stopped",
        description="Serve the worker or parameter-server task that TF_CONFIG describes, on its "
                    "address in the cluster, until SIGTERM or SIGINT. Callers must hold the "
                    "cluster token STRATAGEM_CLUSTER_TOKEN.")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest request or reply, in bytes (default: 1 GiB)")
    parser.add_argument("--max-workers", type=int, default=16,
                        help="threads serving requests (default: 16)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads (default: 1; requests already run in "
                             "parallel, and on a shared host more threads slow small copies)")
    parser.set_defaults(handler=_run)
    return parser


if __name__ == "__main__":   # python -m stratagem.ps.server
    from stratagem.cli import main
    sys.exit(main(["server", *sys.argv[1:]]))
