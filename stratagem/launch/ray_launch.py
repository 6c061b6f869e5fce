"""The launcher on Ray: a job's tasks as Ray actors, ``stratagem launch --ray ADDRESS``.

:func:`launch_ray` runs the same job as :func:`~stratagem.launch.launch_local` -- the same
tasks (``tasks.py``), each with its TF_CONFIG, ``STRATAGEM_RESTART`` and the cluster token,
output lines prefixed with their task, the same exit statuses -- on the nodes of a Ray
cluster instead of this machine's loopback. Each task is a Ray actor (``ray_actor.py``) that
runs the script as a process on its node, on a port it picked there; the launcher builds the
ClusterSpec from what the actors report (``ray_group.py``).

Restarts: a task that fails or whose actor dies (``ray.kill``, its worker process killed,
its node lost) stops every task, and the whole group starts again, up to ``max_restarts``
times: new actors, placed again, new ports, so a new rendezvous; the script resumes from
its checkpoint (``sg.callbacks.BackupAndRestore``). A task that exits 75 (preempted, its
group saved) restarts the group without spending a restart, up to ``max_preemptions``
times. Beyond them the job fails with the failed task's exit code (1 for a signal or a lost
actor), naming it. In parameter-server training (``num_ps > 0``) a failed server also
restarts the whole group: its replacement may land on another node, at another address.

SIGINT or SIGTERM sent to the launcher stop every task on its node (SIGTERM, the grace
period, SIGKILL), kill the actors, and the launcher returns 130 or 143. A launcher killed
outright takes the tasks with it: Ray kills the actors of a driver that is gone, and each
task dies with its actor (``ray_actor.py``).

The join timeout: the tasks of a collective group (or the coordinator) that have not joined
their cluster ``join_timeout`` seconds after they started stop the job with status 1, naming
them, as in the local launcher. What listens where, the token and the restarts are described
in ``docs/ray.md``.

Example (a one-machine Ray cluster on loopback; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
keeps Ray on the address given instead of the machine's own)::

    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address=127.0.0.1 --port=6379
    import io
    from stratagem.launch.ray_launch import launch_ray
    out = io.StringIO()
    status = launch_ray("train.py", ["--epochs", "3"], address="127.0.0.1:6379",
                        num_workers=2, max_restarts=2, stdout=out)
    # out: "[worker 0] ..." lines; status 0 once both workers exited 0
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

from stratagem.errors import ClusterConfigError, InvalidArgumentError, MissingDependencyError
from stratagem.launch.output import TaskOutput
from stratagem.launch.ray_actor import NodeReport
from stratagem.launch.ray_group import RayGroup, choose_token, is_loopback
from stratagem.launch.ray_job import RayJob
from stratagem.launch.tasks import plan_cluster

__all__ = ["launch_ray"]

_CONNECT_SECONDS = 10.0   # how long the head's address gets to accept a connection
_ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            "launch_ray (stratagem launch --ray) needs Ray: pip install 'stratagem[ray]' "
            "(or pip install ray)") from None
    return ray


def _check_number(value: object, flag: str, minimum: float, integer: bool = True) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= minimum:
        what = "an integer" if integer else "a number"
        raise InvalidArgumentError(f"{flag} must be {what} >= {minimum:g}, got {value!r}.")


def _split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or ``ray://host:port``; None for ``auto`` and the like."""
    bare = address.removeprefix("ray://")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _one_machine_mode(ray: Any) -> bool:
    """Whether Ray keeps a loopback address as it is (else it swaps in the machine's own)."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    enabled = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if enabled is None:
        enabled = os.environ.get(_ONE_MACHINE, "1").lower() not in ("0", "false")
    return not enabled


def _connect(ray: Any, address: str | None) -> bool:
    """Connects to the cluster unless this process is already; returns whether it did."""
    if ray.is_initialized():
        if address is not None:
            raise InvalidArgumentError(
                f"this process is already connected to Ray (ray.init was called), so address={address!r} "
                "cannot be used: leave address out to launch on that connection, or call ray.shutdown() first.")
        return False
    if not isinstance(address, str) or not address:
        raise InvalidArgumentError(
            f"address (--ray ADDRESS) must name the Ray cluster: its head's host:port (the port `ray start "
            f"--head` printed, 6379 by default), 'auto', or ray://host:port; got {address!r}.")
    hostport = _split_address(address)
    if hostport is not None:
        host, port = hostport
        if is_loopback(host) and not _one_machine_mode(ray):
            raise ClusterConfigError(
                f"--ray {address}: a loopback address, but Ray on Linux replaces it with this machine's own "
                f"address, where its servers and the tasks would listen. For a one-machine cluster on loopback, "
                f"set {_ONE_MACHINE}=0 in the environment of `ray start` and of this launcher; for a cluster of "
                "machines, give the head's address.")
        try:
            socket.create_connection((host, port), timeout=_CONNECT_SECONDS).close()
        except OSError as error:
            raise ClusterConfigError(
                f"no Ray cluster answers at {address} ({error.strerror or error}): start one there with "
                f"`ray start --head --port={port}`, or give the address its head printed.") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as error:   # no cluster, another version, ...
        raise ClusterConfigError(f"could not connect to the Ray cluster at {address}: {error}") from None
    return True


@contextlib.contextmanager
def _signals_to(job: RayJob) -> Iterator[None]:
    """Routes SIGINT and SIGTERM to ``job.interrupt`` (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = lambda signum, frame: job.interrupt(signum)  # noqa: E731
    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def launch_ray(script: str | os.PathLike[str], args: Sequence[str] = (), *, address: str | None = None,
               num_workers: int = 2, num_ps: int = 0, chief: bool = False, max_restarts: int = 0,
               max_preemptions: int = 100, spread: bool = False, cpus_per_task: float = 1.0,
               gpus_per_task: float = 0.0, runtime_env: Mapping[str, Any] | None = None,
               grace_period: float = 5.0, join_timeout: float = 600.0, placement_timeout: float = 60.0,
               stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Runs ``script`` as a cluster of Ray actors; returns the job's exit status.

    ``address`` is the Ray cluster's (``host:port`` of its head, ``"auto"``, ``ray://...``);
    None uses this process's connection when ``ray.init`` was called already. The tasks are
    those of :func:`~stratagem.launch.launch_local`: a chief (``chief=True``, or whenever
    ``num_ps > 0``), ``num_workers`` workers and ``num_ps`` parameter servers, each an actor
    reserving ``cpus_per_task`` CPUs and ``gpus_per_task`` GPUs, with ``runtime_env`` (Ray's:
    ``working_dir``, ``env_vars``, ...; no secrets: it travels in the clear). ``spread=True``
    puts every task on a node of its own (Ray's STRICT_SPREAD placement; refused when the
    cluster has too few nodes), else Ray packs them. Placing the tasks and starting their
    actors may take ``placement_timeout`` seconds, then the launch is refused.

    The script must be at the same path on every node (relative paths from this process's
    working directory, when it exists there), or come with ``runtime_env={"working_dir": ...}``;
    it runs under the nodes' Python. Restarts, the join timeout, the grace period, signals and
    the exit status are as in :func:`~stratagem.launch.launch_local` (see the module docstring).
    Task output goes to ``stdout`` (default ``sys.stdout``), the launcher's messages to
    ``stderr``, each line prefixed with its task.

    Bad arguments, a cluster that does not answer, a placement that cannot be satisfied, or a
    token that cannot reach the tasks safely raise :class:`~stratagem.errors.InvalidArgumentError`
    or :class:`~stratagem.errors.ClusterConfigError` before any task starts.
    """
    path = os.fspath(script)
    if not path:
        raise InvalidArgumentError("script must be the path of the Python script the tasks run, like 'train.py'.")
    if isinstance(args, (str, bytes)) or not all(isinstance(arg, str) for arg in args):
        raise InvalidArgumentError(f"args must be a sequence of strings (the script's command line), got {args!r}.")
    for value, flag in ((num_workers, "--workers (num_workers)"), (num_ps, "--ps (num_ps)"),
                        (max_restarts, "--max-restarts (max_restarts)"),
                        (max_preemptions, "--max-preemptions (max_preemptions)")):
        _check_number(value, flag, 0)
    for value, flag in ((grace_period, "--grace-period (grace_period)"),
                        (join_timeout, "--join-timeout (join_timeout)"),
                        (cpus_per_task, "cpus_per_task"), (gpus_per_task, "gpus_per_task")):
        _check_number(value, flag, 0, integer=False)
    if isinstance(placement_timeout, bool) or not isinstance(placement_timeout, (int, float)) \
            or not placement_timeout > 0:
        raise InvalidArgumentError(f"--ray-placement-timeout (placement_timeout) must be a number of seconds > 0, "
                                   f"got {placement_timeout!r}.")
    if num_workers == 0 and not chief and not num_ps:
        raise InvalidArgumentError("nothing to launch: --workers is 0 and there is no chief; ask for at least "
                                   "one worker (--workers 1) or a chief (--chief).")
    if num_ps and not num_workers:
        raise InvalidArgumentError(f"parameter-server training (--ps {num_ps}) needs at least one worker to run "
                                   "the coordinator's steps; add --workers 1 or more.")
    num_tasks = int(chief or num_ps > 0) + num_workers + num_ps
    _, tasks = plan_cluster([path, *args], num_workers=num_workers, num_ps=num_ps, chief=chief,
                            ports=range(1, num_tasks + 1))   # placeholders: the actors pick the ports
    ray = _import_ray()
    connected = _connect(ray, address)
    hostport = _split_address(address) if address else None
    loopback = hostport is not None and is_loopback(hostport[0])

    def check_hosts(reports: Sequence[NodeReport]) -> None:
        away = sorted({r.host for r in reports if not is_loopback(r.host)})
        if loopback and away:
            raise ClusterConfigError(
                f"--ray {address} is a loopback address, but Ray placed tasks on nodes at {', '.join(away)}, "
                "where they would listen: give the head's own address for a cluster of machines")

    def make_group() -> RayGroup:
        return RayGroup(ray, tasks, spread=spread, resources={"CPU": cpus_per_task, "GPU": gpus_per_task},
                        runtime_env=runtime_env, placement_timeout=float(placement_timeout),
                        grace_period=float(grace_period), check_hosts=check_hosts,
                        interrupted=lambda: job.interrupted)

    working_dir = None if runtime_env and "working_dir" in runtime_env else os.getcwd()
    output = TaskOutput(sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr)
    job = RayJob(tasks, make_group, lambda reports, fresh: choose_token([t.name for t in tasks], reports, fresh),
                 output=output, max_restarts=max_restarts, max_preemptions=max_preemptions,
                 join_timeout=float(join_timeout), cwd=working_dir)
    try:
        with _signals_to(job):
            return job.run()
    finally:
        if connected:
            with contextlib.suppress(Exception):
                ray.shutdown()
