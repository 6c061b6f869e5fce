"""``stratagem demo --strategy multi_worker | parameter_server``: the demo on a local cluster.

These two strategies need processes of their own, so the demo starts them itself, on
loopback, with :func:`stratagem.launch.launch_local` (what ``stratagem launch`` runs): each
task gets its TF_CONFIG and finds its place with ``sg.cluster.TFConfigClusterResolver()``
as on a real cluster. The tasks run :func:`task_main` of this module, through a small
entry script written to a temporary folder, next to the data set (split and
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
    (:data:`stratagem.demo.MIN_ASYNC_ACCURACY`, 0.9: plain PyTorch reaches it in about 4
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

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence, TextIO

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.demo import (DemoResult, Digits, ShuffledBatches, TrainConfig, Trained, _one_intra_op_thread,
                            accuracy_of, check_equivalence, load_digits_split, make_model, print_header,
                            progress_bar, train_plain_pytorch, train_with_strategy)
from stratagem.errors import StratagemError

__all__ = ["ClusterDemoError", "NUM_WORKERS", "NUM_PS", "run_cluster_demo", "task_main"]

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
        with _one_intra_op_thread():
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
    from stratagem.launch import launch_local

    ncols = max(40, shutil.get_terminal_size((100, 24)).columns - _PREFIX_WIDTH - 1) if progress else 0
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
from stratagem.demo_cluster import task_main
sys.exit(task_main(sys.argv[1:]))
"""


# ------------------------------------------------------------------ the tasks


def task_main(argv: Sequence[str] | None = None) -> int:
    """What a task of the demo's cluster runs: ``multi_worker`` (every worker) or ``coordinator``.

    Only the chief writes the result file (``torch.save`` of a dict of tensors and numbers).
    """
    parser = argparse.ArgumentParser(prog="python -m stratagem.demo_cluster",
                                     description="a task of `stratagem demo`'s local cluster "
                                                 "(started by the demo, with TF_CONFIG)")
    parser.add_argument("role", choices=["multi_worker", "coordinator"])
    parser.add_argument("--result", required=True, help="where the chief saves its result")
    parser.add_argument("--data", help="the split data set, saved by the demo (default: load it here)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--ncols", type=int, default=0, help="progress bar width; 0: no bar")
    args = parser.parse_args(argv)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         optimizer=args.optimizer, seed=args.seed)
    with _one_intra_op_thread():
        data = Digits(**torch.load(args.data, weights_only=True)) if args.data else load_digits_split()
        if args.role == "multi_worker":
            saved = _multi_worker_task(data, config, args.replicas, args.ncols)
        else:
            saved = _coordinator_task(data, config, args.ncols)
    if saved is not None:
        partial = args.result + ".partial"
        torch.save(saved, partial)
        os.replace(partial, args.result)
    return 0


def _multi_worker_task(data: Digits, config: TrainConfig, replicas: int, ncols: int) -> dict[str, Any] | None:
    strategy = sg.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    show = ncols > 0 and strategy.is_chief
    trained = train_with_strategy(strategy, data, config, progress=show, ncols=ncols or None)
    if not strategy.is_chief:
        return None
    return {"initial": trained.initial_state, "final": trained.final_state, "accuracy": trained.accuracy,
            "seconds": trained.seconds, "steps": trained.steps, "strategy": repr(strategy),
            "num_replicas": strategy.num_replicas_in_sync}


def worker_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int,
                   worker: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A parameter-server worker's dataset: the training set in global batches, epoch after epoch.

    Each worker reshuffles with a seed of its own, so two workers do not compute the same
    batch at the same time.
    """
    batches = ShuffledBatches(x, y, batch_size=batch_size, seed=seed * 1_000 + 1 + worker)
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


def _coordinator_task(data: Digits, config: TrainConfig, ncols: int) -> dict[str, Any]:
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    with strategy.scope():
        torch.manual_seed(config.seed)
        model = make_model(data.num_features)
        optimizer = config.make_optimizer(model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    x_train, y_train = data.x_train, data.y_train
    batch_size, seed = config.batch_size, config.seed

    def dataset_fn(context: sg.InputContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return worker_batches(x_train, y_train, batch_size, seed, context.input_pipeline_id)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(worker_iterator: Any) -> torch.Tensor:   # runs on a worker
        x, y = next(worker_iterator)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()    # the gradients go to the parameter server, which applies them
        return loss.detach()

    steps_per_epoch = config.steps_per_epoch(data)
    steps = config.epochs * steps_per_epoch
    bar = progress_bar(steps, enabled=ncols > 0, ncols=ncols or None)
    started = time.perf_counter()
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    for index, value in enumerate(values):   # roughly in the order they finish
        loss = value.fetch()
        bar.set_postfix_str(f"epoch {index // steps_per_epoch + 1}/{config.epochs} loss {loss.item():.4f}",
                            refresh=False)
        bar.update(1)
    coordinator.join()
    seconds = time.perf_counter() - started
    bar.close()
    accuracy = accuracy_of(model, config.test_batches(data))
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"initial": initial, "final": final, "accuracy": accuracy, "seconds": seconds, "steps": steps,
            "strategy": repr(strategy), "num_replicas": strategy.num_replicas_in_sync}


if __name__ == "__main__":
    sys.exit(task_main())
