"""``stratagem demo --strategy multi_worker | parameter_server``: the demo on a local cluster.

These two strategies need processes of their own, so the demo starts them itself, on
loopback, with :func:`stratagem.launch.launch_local` (what ``stratagem launch`` runs): each
task gets its TF_CONFIG and finds its place with ``sg.cluster.TFConfigClusterResolver()``
as on a real cluster. The tasks run :func:`stratagem.demo.tasks.task_main`, through a
small entry script written to a temporary folder, next to the data set (split and
standardised here once) and the file where the chief saves its result.

``multi_worker``
    Two worker processes train the digits MLP with ``MultiWorkerMirroredStrategy``
    (``replicas`` logical CPU replicas each, default 1) with the same seed and the same
    global batches as the other strategies, each worker taking its slice of every batch.
    The chief (worker 0) shows the progress bar and writes its initial and final
    parameters and its test accuracy to the result file; this process then trains plain
    PyTorch from the same initial parameters and checks equivalence, as for ``mirrored``.

``parameter_server``
    A coordinator (the launch's chief), two workers and one parameter server
    (``stratagem server``). The coordinator creates the model under
    ``ParameterServerStrategy`` (its variables live on the parameter server) and
    schedules as many steps as the other strategies run (``epochs`` x 23 with the default
    batch of 64) with ``ClusterCoordinator``; each step reads the next global batch of
    its worker's own dataset (the training set, reshuffled every epoch with a seed of
    that worker's own) and runs on whichever worker is free. Training is asynchronous:
    a worker's update is applied as it arrives, computed from parameters that other
    workers may have changed meanwhile, so the result does not follow plain PyTorch step
    by step. The demo therefore passes when test accuracy reaches ``min_accuracy``
    (:data:`stratagem.demo.run.MIN_ASYNC_ACCURACY`, 0.9: plain PyTorch reaches it in about 4
    epochs and 0.97 in the default 20), and reports plain PyTorch's accuracy after as
    many steps for comparison.

Every task runs with one intra-op thread. The tasks' output (the progress bar included)
goes to stderr, each line prefixed with its task, ``[worker 0]`` or ``[chief]``; with
``progress=False`` it is kept and shown only if the cluster fails, in the
:class:`ClusterDemoError` raised then.

Commands::

    stratagem demo --strategy multi_worker
    stratagem demo --strategy multi_worker --replicas 2 --epochs 3
    stratagem demo --strategy parameter_server --epochs 5 --quiet
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time
from typing import Any, TextIO

import torch

import stratagem as sg
from stratagem.demo.check import DemoResult, check_equivalence
from stratagem.demo.data import Digits, load_digits_split
from stratagem.demo.report import print_header
from stratagem.demo.training import TrainConfig, Trained, one_intra_op_thread, train_plain_pytorch
from stratagem.errors import StratagemError
from stratagem.launch import launch_local

__all__ = ["ClusterDemoError", "NUM_WORKERS", "NUM_PS", "run_cluster_demo"]

NUM_WORKERS = 2
NUM_PS = 1
_RESULT_FILE = "result.pt"
_DATA_FILE = "digits.pt"
_TAIL_LINES = 40
# The launch prefixes lines with the task, "[worker 0] " or "[chief]    ": the bar gets the rest.
_PREFIX_WIDTH = len("[worker 0] ")


class ClusterDemoError(StratagemError, RuntimeError):
    """The demo's local cluster failed (a task exited non-zero, or was interrupted)."""


# ---------------------------------------------------------------- this process


def run_cluster_demo(mode: str, replicas: int, config: TrainConfig, *, tolerance: float,
                     min_accuracy: float, progress: bool, out: TextIO | None) -> DemoResult:
    """Start the local cluster for ``mode`` ("multi_worker" or "parameter_server"), train, report.

    Called by :func:`stratagem.demo.run_demo`, which checked the arguments.
    """
    data = load_digits_split()
    if mode == "multi_worker":
        devices = [f"cpu:{i}" for i in range(replicas)]
        num_replicas = NUM_WORKERS * replicas
        if out is not None:
            print_header(out, f"MultiWorkerMirroredStrategy, {num_replicas} replicas: {NUM_WORKERS} worker "
                              f"processes started by the demo, each on {', '.join(devices)}",
                         data, config, num_replicas)
        saved = _launch("multi_worker", replicas, config, data, progress=progress)
        trained = _as_trained(saved)
        return check_equivalence(trained, data, config, tolerance, strategy=saved["strategy"],
                                 num_replicas=saved["num_replicas"], num_workers=NUM_WORKERS)
    if mode == "parameter_server":
        if out is not None:
            steps = config.epochs * config.steps_per_epoch(data)
            print_header(
                out, f"ParameterServerStrategy + ClusterCoordinator: a coordinator, {NUM_WORKERS} workers "
                     f"and {NUM_PS} parameter server, processes started by the demo",
                data, config, 1,
                batches_line=f"global {config.batch_size}, each step run whole by whichever worker is "
                             f"free; every worker reads its own reshuffled copy of the training set",
                training_line=f"{steps} steps ({config.epochs} epoch{'s' * (config.epochs != 1)} x "
                              f"{config.steps_per_epoch(data)}), asynchronous")
        saved = _launch("parameter_server", 1, config, data, progress=progress)
        with one_intra_op_thread():
            _, reference_accuracy = train_plain_pytorch(saved["initial"], data, config)
        accuracy = float(saved["accuracy"])
        return DemoResult(accuracy=accuracy, max_rel_diff=None, passed=accuracy >= min_accuracy,
                          steps=int(saved["steps"]), seconds=float(saved["seconds"]),
                          reference_accuracy=reference_accuracy, tolerance=tolerance,
                          strategy=saved["strategy"], num_replicas=int(saved["num_replicas"]),
                          num_workers=NUM_WORKERS, min_accuracy=min_accuracy)
    raise ValueError(f"unknown cluster mode {mode!r}")


def _as_trained(saved: dict[str, Any]) -> Trained:
    return Trained(initial_state=saved["initial"], final_state=saved["final"],
                   accuracy=float(saved["accuracy"]), seconds=float(saved["seconds"]),
                   steps=int(saved["steps"]))


class _TaskOutput(io.TextIOBase):
    """Where the launcher writes the tasks' lines: kept for an error message, echoed if asked."""

    def __init__(self, echo: TextIO | None):
        self._echo = echo
        self._chunks: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._chunks.append(text)
        if self._echo is not None:
            self._echo.write(text)
        return len(text)

    def flush(self) -> None:
        if self._echo is not None:
            self._echo.flush()

    def tail(self, count: int = _TAIL_LINES) -> str:
        """The last ``count`` lines, each as a terminal shows it (a bar's last redraw only)."""
        lines = "".join(self._chunks).split("\n")
        shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
        return "\n".join([line for line in shown if line.strip()][-count:])


def _launch(mode: str, replicas: int, config: TrainConfig, data: Digits, *,
            progress: bool) -> dict[str, Any]:
    """Run the cluster for ``mode`` and return what its chief saved; raise ClusterDemoError if it fails."""
    # the tasks' bar passes through the launcher to this process's stdout: a bar on a terminal,
    # plain lines (-1) elsewhere
    width = max(40, shutil.get_terminal_size((100, 24)).columns - _PREFIX_WIDTH - 1)
    ncols = 0 if not progress else width if sys.stdout.isatty() else -1
    log = _TaskOutput(sys.stderr if progress else None)
    with tempfile.TemporaryDirectory(prefix="stratagem-demo-") as tmp:
        entry = os.path.join(tmp, "demo_task.py")
        with open(entry, "w") as f:
            f.write(_ENTRY_SCRIPT.format(root=_package_root()))
        data_path = os.path.join(tmp, _DATA_FILE)   # the tasks need not import scikit-learn
        torch.save({"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test,
                    "y_test": data.y_test}, data_path)
        result_path = os.path.join(tmp, _RESULT_FILE)
        args = ["coordinator" if mode == "parameter_server" else mode, "--result", result_path,
                "--data", data_path,
                "--replicas", str(replicas), "--epochs", str(config.epochs),
                "--batch-size", str(config.batch_size), "--lr", repr(config.lr),
                "--optimizer", config.optimizer, "--seed", str(config.seed), "--ncols", str(ncols)]
        if mode == "parameter_server":
            status = launch_local(entry, args, num_workers=NUM_WORKERS, num_ps=NUM_PS, stdout=log, stderr=log)
        else:
            status = launch_local(entry, args, num_workers=NUM_WORKERS, stdout=log, stderr=log)
        if status == 0 and os.path.exists(result_path):
            return torch.load(result_path, weights_only=True)
    if status == 130:   # Ctrl-C: the launcher stopped the tasks
        raise KeyboardInterrupt
    if status == 143:
        raise ClusterDemoError(f"the {mode} cluster was stopped by SIGTERM")
    what = (f"failed with exit status {status}" if status
            else "ended without its chief writing a result")
    shown = "" if progress else f"; the last lines of its output:\n{log.tail()}"
    raise ClusterDemoError(f"the {mode} cluster {what}{shown}")


def _package_root() -> str:
    """The folder this ``stratagem`` was imported from, so the tasks import the same one."""
    return os.path.dirname(os.path.dirname(os.path.abspath(sg.__file__)))


_ENTRY_SCRIPT = """\
import sys
sys.path.insert(0, {root!r})  # the stratagem that started this demo
from stratagem.demo.tasks import task_main
sys.exit(task_main(sys.argv[1:]))
"""
