"""The local launcher: ``stratagem launch`` as a Python function.

:func:`launch_local` checks its arguments, plans the cluster (``tasks.py``), picks the
ports (``ports.py``), and hands the processes to :class:`~stratagem.launch.supervisor.Supervisor`,
which starts, watches, restarts and stops them (its docstring has the life of a task and
of a group). The job succeeds when every task that runs the script has exited 0.

An evaluator (``num_evaluators=1``, ``--evaluator 1``) runs the script beside training
with task type ``"evaluator"`` in TF_CONFIG, typically an :class:`sg.SidecarEvaluator
<stratagem.SidecarEvaluator>`. It never joins the training group, a group restart leaves
it running, and once training has succeeded the launcher waits up to
``evaluator_timeout`` seconds for it to exit; the job succeeds when it exits 0.

Restarts (``max_restarts``): in collective training (no parameter servers) a failure
stops every task and the whole group starts again, up to ``max_restarts`` times, each
time on fresh ports (the same ones with ``port_base``, once the old processes are gone),
so that no new process can meet the old group's rendezvous store or peers. A task that
exits with :data:`~stratagem.preemption.PREEMPTED_EXIT_CODE` (75: its group agreed to
stop and saved) restarts the group without spending a restart, up to ``max_preemptions``
times (default 100; then the job fails with status 75, so that a job preempted at every
start does not restart for ever). In parameter-server
training each server restarts alone, with the same TF_CONFIG and port.

Each process has the environment of the launcher plus ``TF_CONFIG``, ``PYTHONUNBUFFERED=1``,
``STRATAGEM_RESTART`` (how many restarts came before this process: ``"0"`` at first) and
``STRATAGEM_CLUSTER_TOKEN``, a secret made fresh for every job that the cluster's servers
use to refuse strangers; it is never printed. torchrun's variables inherited by the launcher
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, ...) are removed: a stale copy
would contradict TF_CONFIG. In collective training the chief and the workers get instead
the ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` that torchrun would give
them, read from their TF_CONFIG (``tasks.torchrun_variables``), so that a script's own rank
logic works under both launchers; TF_CONFIG still describes the cluster (it comes first).

SIGINT (Ctrl-C) or SIGTERM sent to the launcher stop every task (SIGTERM, then SIGKILL
after ``grace_period`` seconds) and the launcher returns 130 or 143: a script with a
:class:`~stratagem.PreemptionWatcher` saves within the grace period. A launcher that dies
without stopping its tasks (SIGKILL, the OOM killer) takes them with it: they get SIGTERM at
once, and their process groups (their children too) SIGKILL after the grace period
(``lifeline.py``).

The join timeout (``join_timeout``, ``--join-timeout``, default 600 s; 0 for none): when the
tasks of a collective group (two or more) have not all formed their process group, or the
coordinator of parameter-server training has not made its strategy, that long after they
started, the launcher stops the job and returns 1, naming them. Without it, a job whose
tasks all hang before their strategy (a deadlock, a data set that never loads) would wait
for ever: nobody else is at the rendezvous yet to time out.

Example::

    import os, io, tempfile
    from stratagem.launch import launch_local
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hello.py")
        with open(script, "w") as f:
            f.write("import json, os\\n"
                    "task = json.loads(os.environ['TF_CONFIG'])['task']\\n"
                    "print('hello from', task['type'], task['index'])\\n")
        out = io.StringIO()
        assert launch_local(script, num_workers=2, stdout=out) == 0
        assert "[worker 1] hello from worker 1" in out.getvalue()
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

from stratagem.cluster import ClusterSpec
from stratagem.cluster.joined import JOINED_VARIABLE, joined_tasks
from stratagem.cluster.spec import is_wildcard_host, validate_address
from stratagem.cluster.torchrun import TORCHRUN_VARIABLES
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.launch.output import TaskOutput
from stratagem.launch.ports import format_address, free_ports, ports_from_base
from stratagem.launch.supervisor import EXIT_STATUS_ON_SIGNAL, Supervisor
from stratagem.launch.tasks import Task, plan_cluster, tf_config, torchrun_variables
from stratagem.launch.timeline import check_timeline, write_timeline
from stratagem.observe.answer import OBSERVE_VARIABLE
from stratagem.observe.chrome import FOLDER_VARIABLE
from stratagem.observe.epochs import EPOCH_VARIABLE

__all__ = ["RESTART_VARIABLE", "TOKEN_VARIABLE", "launch_local"]

TOKEN_VARIABLE = "STRATAGEM_CLUSTER_TOKEN"
#: How many times the task's group (collective training) or the task itself (parameter-server
#: training) was restarted before this process started: "0" the first time.
RESTART_VARIABLE = "STRATAGEM_RESTART"
_PORTS_FREE_SECONDS = 10.0  # after a group was stopped, how long its --port-base ports may stay busy


@contextlib.contextmanager
def _signals_to(launcher: Supervisor) -> Iterator[None]:
    """Routes SIGINT and SIGTERM to ``launcher.interrupt`` (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = lambda signum, frame: launcher.interrupt(signum)  # noqa: E731
    previous = {signum: signal.signal(signum, handler) for signum in EXIT_STATUS_ON_SIGNAL}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _check_count(value: object, flag: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{flag} must be an integer >= {minimum}, got {value!r}.")
    return value


def check_script(script: str | os.PathLike[str]) -> str:
    path = os.fspath(script)
    if not os.path.exists(path):
        raise InvalidArgumentError(
            f"script {path!r} not found (looked from {os.getcwd()!r}); give the path of the "
            "Python script that the tasks run, like 'train.py'.")
    if os.path.isdir(path):
        raise InvalidArgumentError(
            f"script {path!r} is a directory; give the path of a Python script, like "
            f"{os.path.join(path, 'train.py')!r}.")
    return path


def task_env(base: Mapping[str, str], spec: ClusterSpec, task: Task, token: str,
              restart: int) -> dict[str, str]:
    # torchrun's variables: inherited ones would be stale; the task's own follow its TF_CONFIG.
    env = {key: value for key, value in base.items() if key not in TORCHRUN_VARIABLES
           and not key.startswith("TORCHELASTIC_")}
    env.update({"TF_CONFIG": tf_config(spec, task), TOKEN_VARIABLE: token, "PYTHONUNBUFFERED": "1",
                RESTART_VARIABLE: str(restart), EPOCH_VARIABLE: "1", **torchrun_variables(spec, task)})
    return env


def _ports_once_free(base: int, count: int, host: str) -> list[int]:
    """``ports_from_base``, waiting a little for a stopped group's processes to let go."""
    deadline = time.monotonic() + _PORTS_FREE_SECONDS
    while True:
        try:
            return ports_from_base(base, count, host)
        except ClusterConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def launch_local(script: str | os.PathLike[str], args: Sequence[str] = (), *,
                 num_workers: int = 2, num_ps: int = 0, chief: bool = False,
                 max_restarts: int = 0, max_preemptions: int = 100,
                 port_base: int | None = None, host: str = "127.0.0.1",
                 grace_period: float = 5.0, stdout: TextIO | None = None,
                 stderr: TextIO | None = None,
                 server_command: Sequence[str] | None = None, num_evaluators: int = 0,
                 evaluator_timeout: float = 600.0, join_timeout: float = 600.0,
                 hang_timeout: float = 0.0, timeline: "str | os.PathLike[str] | None" = None) -> int:
    """Runs ``script`` as a local cluster on ``host``; returns the job's exit status.

    The tasks are a chief (with ``chief=True``, or whenever ``num_ps > 0``), ``num_workers``
    workers and ``num_ps`` parameter servers, each one process with its TF_CONFIG and its
    own port (consecutive from ``port_base``, else free ones). A failure restarts the
    group (collective training) or the failed server (parameter-server training) up to
    ``max_restarts`` times; a preempted group restarts without spending one, up to
    ``max_preemptions`` times (the next preemption fails the job with status 75). An evaluator
    (``num_evaluators=1``) runs the script too; the job also needs it to exit 0 within
    ``evaluator_timeout`` seconds of training's end. Tasks that have not joined their
    cluster ``join_timeout`` seconds after they started (0: no limit) stop the job, with
    status 1; so does a job in which no task made progress (a step, a collective) for
    ``hang_timeout`` seconds (0, the default: no limit), after saying where each task stands. The status
    is 0 when the job succeeded, the failed task's exit code (1 if it was killed by a
    signal) when it failed, 130/143 when the launcher got SIGINT/SIGTERM. Task output goes to ``stdout`` (default
    ``sys.stdout``) and the launcher's messages to ``stderr``, each line prefixed with
    its task. ``server_command`` replaces ``stratagem server`` for the workers and
    parameter servers of parameter-server training.

    Bad arguments (a missing script, no task to run, a busy port, a wildcard ``host``
    such as "0.0.0.0") raise
    :class:`~stratagem.errors.InvalidArgumentError` or
    :class:`~stratagem.errors.ClusterConfigError` before anything starts.
    """
    path = check_script(script)
    if isinstance(args, (str, bytes)) or not all(isinstance(arg, str) for arg in args):
        raise InvalidArgumentError(
            f"args must be a sequence of strings (the script's command line), got {args!r}.")
    _check_count(num_workers, "--workers (num_workers)")
    _check_count(num_ps, "--ps (num_ps)")
    _check_count(max_restarts, "--max-restarts (max_restarts)")
    _check_count(max_preemptions, "--max-preemptions (max_preemptions)")
    if _check_count(num_evaluators, "--evaluator (num_evaluators)") > 1:
        raise InvalidArgumentError(
            f"--evaluator (num_evaluators) must be 0 or 1, got {num_evaluators}: as in TensorFlow a "
            "cluster has at most one evaluator task.")
    if isinstance(evaluator_timeout, bool) or not isinstance(evaluator_timeout, (int, float)) \
            or not evaluator_timeout > 0:
        raise InvalidArgumentError(
            f"--evaluator-timeout (evaluator_timeout) must be a number of seconds > 0, got "
            f"{evaluator_timeout!r}.")
    if num_workers == 0 and not chief and not num_ps:
        raise InvalidArgumentError(
            "nothing to launch: --workers is 0 and there is no chief; ask for at least one "
            "worker (--workers 1) or a chief (--chief).")
    if num_ps and not num_workers:
        raise InvalidArgumentError(
            f"parameter-server training (--ps {num_ps}) needs at least one worker to run the "
            "coordinator's steps; add --workers 1 or more.")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"--host must be a host name or IP address, got {host!r}.")
    validate_address(format_address(host, 1), where=f"--host {host!r}")
    if is_wildcard_host(host):  # as a parameter server refuses it, for every kind of job
        raise ClusterConfigError(
            f"--host {host!r} means every interface: the tasks' sockets (gloo's, the rendezvous "
            "store's, the servers') would accept connections from any host that reaches this "
            "one. A local launch runs every task on this machine: keep the default loopback "
            "address '127.0.0.1', or give one address of this machine.")
    for value, flag in ((grace_period, "--grace-period (grace_period)"),
                        (join_timeout, "--join-timeout (join_timeout)"),
                        (hang_timeout, "--hang-timeout (hang_timeout)")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise InvalidArgumentError(f"{flag} must be a number of seconds >= 0, got {value!r}.")

    num_tasks = int(chief or num_ps > 0) + num_workers + num_ps + num_evaluators
    if port_base is not None:
        port_base = _check_count(port_base, "--port-base (port_base)", 1)
    token = secrets.token_hex(32)  # one per job; never printed

    def plan(restart: int) -> tuple[list[Task], list[dict[str, str]]]:
        # Every start of the group gets its own ports: a new process never meets the old
        # group's store or peers (with --port-base, the same ports once they are free).
        if port_base is None:
            ports = free_ports(num_tasks, host)
        elif restart == 0:
            ports = ports_from_base(port_base, num_tasks, host)
        else:
            ports = _ports_once_free(port_base, num_tasks, host)
        spec, tasks = plan_cluster([path, *args], num_workers=num_workers, num_ps=num_ps,
                                   chief=chief, ports=ports, host=host, server=server_command,
                                   num_evaluators=num_evaluators)
        return tasks, [task_env(os.environ, spec, task, token, restart) for task in tasks]

    trace_path = check_timeline(timeline)
    joined = tempfile.mkdtemp(prefix="stratagem-joined-")   # where tasks say they took part
    observe = tempfile.mkdtemp(prefix="stratagem-observe-")  # where they answer "where are you?"
    traces = {FOLDER_VARIABLE: tempfile.mkdtemp(prefix="stratagem-timeline-")} if trace_path else {}

    def environments(restart: int) -> list[dict[str, str]]:
        return [{**env, JOINED_VARIABLE: joined, OBSERVE_VARIABLE: observe, **traces}
                for env in (plan(restart)[1] if restart else first)]

    tasks, first = plan(0)
    errors = sys.stderr if stderr is None else stderr
    output = TaskOutput(sys.stdout if stdout is None else stdout, errors)
    launcher = Supervisor(tasks, environments, max_restarts=max_restarts,
                          max_preemptions=max_preemptions, output=output,
                          grace_period=float(grace_period), evaluator_timeout=float(evaluator_timeout),
                          join_timeout=float(join_timeout), joined_folder=joined,
                          observe_folder=observe, hang_timeout=float(hang_timeout))
    try:
        with _signals_to(launcher):
            status = launcher.run()
        if status == 0 and server_command is None:
            status = _check_joined(tasks, joined_tasks(joined), os.path.basename(path), errors)
        return status
    finally:
        shutil.rmtree(joined, ignore_errors=True)
        shutil.rmtree(observe, ignore_errors=True)
        if traces:
            write_timeline(traces[FOLDER_VARIABLE], trace_path, output)


def _check_joined(tasks: Sequence[Task], joined: set[str], script: str, errors: TextIO) -> int:
    """After a successful job: say so when its tasks did not train as one cluster.

    Collective training whose tasks never formed a process group ran independent
    trainings (a warning: the script may mean it); parameter-server training whose
    servers never received a variable, nor a worker a step, certainly did not use them
    (an error: status 1). Returns the job's status.
    """
    names = [task.name for task in tasks if task.trains]
    servers = [task.name for task in tasks if not task.runs_script]
    if not servers:
        if len(names) > 1 and not joined & set(names):
            print(f"[launch] warning: the {len(names)} tasks never formed a cluster: each ran {script} "
                  f"on its own, so this was {len(names)} independent trainings, not one distributed "
                  "training. Create the strategy with sg.MultiWorkerMirroredStrategy() in the script "
                  "(it reads the TF_CONFIG the launcher sets).", file=errors, flush=True)
        return 0
    unused = [name for name in servers if name not in joined]
    if len(unused) == len(servers):
        print(f"[launch] error: the parameter servers never received a variable and no worker ran a "
              f"step: {script} did not train with them. In the script, create "
              "sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver()), the model and "
              "optimizer in its scope, and schedule steps with sg.ClusterCoordinator "
              "(see examples/train_ps.py).", file=errors, flush=True)
        return 1
    for name in unused:
        what = ("never received a variable (a partitioner such as sg.MinSizePartitioner spreads "
                "large variables over the parameter servers)" if name.startswith("ps")
                else "never ran a step")
        print(f"[launch] warning: {name} {what}.", file=errors, flush=True)
    return 0
