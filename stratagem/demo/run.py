""":func:`run_demo`: the demo's Python entry point, and the strategies ``--strategy`` offers.

It checks the arguments, resolves the training settings, and hands over to
:mod:`stratagem.demo.local` (strategies of this process) or :mod:`stratagem.demo.cluster`
(strategies that need processes of their own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, TextIO

import stratagem as sg
from stratagem.demo.check import DemoResult
from stratagem.demo.cluster import run_cluster_demo
from stratagem.demo.local import build_central_storage, build_default, build_mirrored, build_one_device, run_local
from stratagem.demo.training import OPTIMIZERS, TrainConfig, one_intra_op_thread
from stratagem.errors import InvalidArgumentError

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_EPOCHS", "DEFAULT_REPLICAS", "DEFAULT_TOLERANCE", "MAX_REPLICAS",
           "MIN_ASYNC_ACCURACY", "STRATEGIES", "StrategyChoice", "run_demo"]


@dataclass(frozen=True)
class StrategyChoice:
    """One value of ``--strategy``: how to build it, and whether ``--replicas`` applies.

    ``build(replicas)`` makes the strategy in this process. Strategies that need processes
    of their own (multi-worker, parameter server) have ``build=None`` and a ``cluster``
    job instead, the name of what :mod:`stratagem.demo.cluster` starts: the demo launches
    a local cluster, trains there and reads the result back. ``default_replicas`` is what
    ``--replicas`` means when not given (per worker for multi-worker).
    """

    build: Callable[[int], sg.Strategy] | None
    uses_replicas: bool
    help: str
    default_replicas: int = 1
    cluster: str | None = None


DEFAULT_REPLICAS = 2

STRATEGIES: dict[str, StrategyChoice] = {
    "mirrored": StrategyChoice(build_mirrored, True, "MirroredStrategy on --replicas logical CPU devices",
                               default_replicas=DEFAULT_REPLICAS),
    "one_device": StrategyChoice(build_one_device, False, 'OneDeviceStrategy("cpu")'),
    "central_storage": StrategyChoice(build_central_storage, True, "CentralStorageStrategy computing on "
                                      "--replicas logical CPU devices", default_replicas=DEFAULT_REPLICAS),
    "default": StrategyChoice(build_default, False, "the default strategy (sg.get_strategy())"),
    "multi_worker": StrategyChoice(
        None, True, "MultiWorkerMirroredStrategy on 2 local worker processes that the demo starts, "
                    "--replicas logical CPU devices each (default 1)", cluster="multi_worker"),
    "parameter_server": StrategyChoice(
        None, False, "ParameterServerStrategy + ClusterCoordinator on a local cluster that the demo "
                     "starts (coordinator, 2 workers, 1 parameter server); asynchronous, so it passes "
                     "on test accuracy (>= 0.9) instead of equivalence", cluster="parameter_server"),
}

DEFAULT_EPOCHS = 20
DEFAULT_BATCH_SIZE = 64
DEFAULT_TOLERANCE = 1e-4
# parameter_server's pass criterion: plain PyTorch reaches 0.92 in 4 epochs, 0.97 in the default 20
MIN_ASYNC_ACCURACY = 0.9
MAX_REPLICAS = 64   # each logical CPU replica is a thread; a typo like --replicas 6400 should not start them


def run_demo(strategy: str = "mirrored", replicas: int | None = None, epochs: int = DEFAULT_EPOCHS,
             batch_size: int = DEFAULT_BATCH_SIZE, lr: float | None = None, optimizer: str = "sgd",
             seed: int = 0, tolerance: float = DEFAULT_TOLERANCE, progress: bool = True,
             out: TextIO | None = None, min_accuracy: float = MIN_ASYNC_ACCURACY) -> DemoResult:
    """Train the digits MLP under a strategy, then check it against plain PyTorch.

    ``strategy`` is a key of :data:`STRATEGIES`. ``replicas`` applies to ``"mirrored"``
    (default 2) and ``"multi_worker"`` (replicas per worker process, default 1).
    ``lr=None`` takes the optimizer's default (0.1 for SGD, 0.01 for Adam).
    ``progress`` shows a tqdm bar on stderr; ``out`` (e.g. ``sys.stdout``) receives a
    header naming the strategy and the data before training starts.

    ``"multi_worker"`` and ``"parameter_server"`` start a local cluster of processes
    (:mod:`stratagem.demo.cluster`) and raise
    :class:`~stratagem.demo.cluster.ClusterDemoError` if it fails. Parameter-server
    training is asynchronous: it passes when its test accuracy is at least
    ``min_accuracy`` (0.9, which needs about 5 epochs) instead of on equivalence.

    Example::

        from stratagem.demo import run_demo
        result = run_demo("mirrored", replicas=3, epochs=1, progress=False)
        print(f"{result.accuracy:.3f}", result.passed)
    """
    choice = _validate(strategy, replicas, epochs, batch_size, lr, optimizer, tolerance, min_accuracy)
    replicas = choice.default_replicas if replicas is None else replicas
    config = TrainConfig(epochs=epochs, batch_size=batch_size,
                         lr=OPTIMIZERS[optimizer][1] if lr is None else float(lr),
                         optimizer=optimizer, seed=seed)
    if choice.cluster is not None:
        return run_cluster_demo(choice.cluster, replicas, config, tolerance=tolerance,
                                min_accuracy=min_accuracy, progress=progress, out=out)
    with one_intra_op_thread():
        return run_local(choice.build, replicas, config, tolerance=tolerance, progress=progress, out=out)


def _validate(strategy: str, replicas: int | None, epochs: int, batch_size: int, lr: float | None,
              optimizer: str, tolerance: float, min_accuracy: float) -> StrategyChoice:
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise InvalidArgumentError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name, value in (("replicas", replicas), ("epochs", epochs), ("batch_size", batch_size)):
        if name == "replicas" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    if replicas is not None and replicas > MAX_REPLICAS:
        raise InvalidArgumentError(
            f"replicas={replicas} is more than the demo allows: every logical CPU replica is a thread; "
            f"use {MAX_REPLICAS} or fewer")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InvalidArgumentError(f"lr must be a positive number (or None for the default), got {lr!r}")
    if not tolerance > 0:
        raise InvalidArgumentError(f"tolerance must be positive, got {tolerance!r}")
    if not 0 <= min_accuracy <= 1:
        raise InvalidArgumentError(f"min_accuracy must be between 0 and 1, got {min_accuracy!r}")
    return STRATEGIES[strategy]
