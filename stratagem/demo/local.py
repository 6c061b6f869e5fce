"""The demo's strategies of one process: ``mirrored``, ``one_device`` and ``default``.

They train here, in this process, and are checked for equivalence with plain PyTorch.
"""

from __future__ import annotations

from typing import Callable, TextIO

import stratagem as sg
from stratagem.demo.check import DemoResult, check_equivalence
from stratagem.demo.data import load_digits_split
from stratagem.demo.report import print_header
from stratagem.demo.training import TrainConfig, train_with_strategy

__all__ = ["build_central_storage", "build_default", "build_mirrored", "build_one_device", "run_local"]


def build_mirrored(replicas: int) -> sg.Strategy:
    """``MirroredStrategy`` on ``replicas`` logical CPU devices, ``cpu:0`` to ``cpu:<replicas - 1>``."""
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


def build_central_storage(replicas: int) -> sg.Strategy:
    """``CentralStorageStrategy`` computing on ``replicas`` logical CPU devices, parameters on the CPU."""
    return sg.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])


def build_one_device(replicas: int) -> sg.Strategy:
    """``OneDeviceStrategy("cpu")``; ``replicas`` does not apply."""
    return sg.OneDeviceStrategy("cpu")


def build_default(replicas: int) -> sg.Strategy:
    """The default strategy, what ``sg.get_strategy()`` returns outside any scope."""
    return sg.get_strategy()


def run_local(build: Callable[[int], sg.Strategy], replicas: int, config: TrainConfig, *, tolerance: float,
              progress: bool, out: TextIO | None) -> DemoResult:
    """Build the strategy, train under it, and check it against plain PyTorch.

    Called by :func:`stratagem.demo.run_demo`, which checked the arguments and set one
    intra-op thread.
    """
    data = load_digits_split()
    dist_strategy = build(replicas)
    if out is not None:
        print_header(out, _strategy_line(dist_strategy), data, config, dist_strategy.num_replicas_in_sync)
    trained = train_with_strategy(dist_strategy, data, config, progress=progress)
    return check_equivalence(trained, data, config, tolerance, strategy=repr(dist_strategy),
                             num_replicas=dist_strategy.num_replicas_in_sync)


def _strategy_line(strategy: sg.Strategy) -> str:
    num_replicas = strategy.num_replicas_in_sync
    name = type(strategy).__name__.lstrip("_")   # the default strategy's class is private
    return (f"{name}, {num_replicas} replica{'s' * (num_replicas != 1)} on "
            f"{', '.join(strategy.worker_devices)}")
