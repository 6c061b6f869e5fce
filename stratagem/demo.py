"""``stratagem demo``: train a small classifier under a strategy and check it against plain PyTorch.

The first thing to run on a fresh machine. It trains a two-layer MLP on scikit-learn's
handwritten digits (1,797 8x8 images shipped inside scikit-learn, so nothing is
downloaded) with the custom training loop of SPEC §1, under ``MirroredStrategy`` on two
logical CPU replicas by default. Then it trains the same model again with plain
single-device PyTorch -- same initial weights, same batches in the same order,
``F.cross_entropy`` with its mean -- and compares the final parameters: the equivalence
guarantee of SPEC §7, checked on real data.

The default global batch of 64 does not divide the 1,437 training images: the last batch
of every epoch has 29 rows, split 15/14 over two replicas, and
``sg.nn.compute_average_loss`` still divides by the true global size.

``--strategy multi_worker`` and ``--strategy parameter_server`` start a local cluster of
processes themselves (:mod:`stratagem.demo_cluster`): two workers under
``MultiWorkerMirroredStrategy``, checked for equivalence like the others; or a
coordinator, two workers and a parameter server under ``ParameterServerStrategy``, whose
asynchronous training cannot be equivalent to plain PyTorch step by step and passes
instead when test accuracy reaches :data:`MIN_ASYNC_ACCURACY` (0.9; about 5 epochs).

Commands::

    stratagem demo                                  # MirroredStrategy on cpu:0, cpu:1
    stratagem demo --replicas 3 --optimizer adam    # three replicas, Adam
    stratagem demo --strategy one_device --quiet    # results only
    stratagem demo --strategy multi_worker          # 2 worker processes, 1 replica each
    stratagem demo --strategy parameter_server      # coordinator + 2 workers + 1 ps
    python -m stratagem demo --help

In Python::

    from stratagem.demo import run_demo
    result = run_demo(strategy="mirrored", replicas=2, epochs=1, progress=False)
    assert result.passed, result.max_rel_diff
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError

# ----------------------------------------------------------------- strategies


@dataclass(frozen=True)
class StrategyChoice:
    """One value of ``--strategy``: how to build it, and whether ``--replicas`` applies.

    ``build(replicas)`` makes the strategy in this process. Strategies that need processes
    of their own (multi-worker, parameter server) have ``build=None`` and a ``cluster``
    job instead, the name of what :mod:`stratagem.demo_cluster` starts: the demo launches
    a local cluster, trains there and reads the result back. ``default_replicas`` is what
    ``--replicas`` means when not given (per worker for multi-worker).
    """

    build: Callable[[int], sg.Strategy] | None
    uses_replicas: bool
    help: str
    default_replicas: int = 1
    cluster: str | None = None


def _mirrored(replicas: int) -> sg.Strategy:
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


DEFAULT_REPLICAS = 2

STRATEGIES: dict[str, StrategyChoice] = {
    "mirrored": StrategyChoice(_mirrored, True, "MirroredStrategy on --replicas logical CPU devices",
                               default_replicas=DEFAULT_REPLICAS),
    "one_device": StrategyChoice(lambda _: sg.OneDeviceStrategy("cpu"), False, 'OneDeviceStrategy("cpu")'),
    "default": StrategyChoice(lambda _: sg.get_strategy(), False, "the default strategy (sg.get_strategy())"),
    "multi_worker": StrategyChoice(
        None, True, "MultiWorkerMirroredStrategy on 2 local worker processes that the demo starts, "
                    "--replicas logical CPU devices each (default 1)", cluster="multi_worker"),
    "parameter_server": StrategyChoice(
        None, False, "ParameterServerStrategy + ClusterCoordinator on a local cluster that the demo "
                     "starts (coordinator, 2 workers, 1 parameter server); asynchronous, so it passes "
                     "on test accuracy (>= 0.9) instead of equivalence", cluster="parameter_server"),
}

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 0.1),     # class, default learning rate
    "adam": (torch.optim.Adam, 0.01),
}

DEFAULT_EPOCHS = 20
DEFAULT_BATCH_SIZE = 64
DEFAULT_TOLERANCE = 1e-4
# parameter_server's pass criterion: plain PyTorch reaches 0.92 in 4 epochs, 0.97 in the default 20
MIN_ASYNC_ACCURACY = 0.9
MAX_REPLICAS = 64   # each logical CPU replica is a thread; a typo like --replicas 6400 should not start them


@dataclass(frozen=True)
class DemoResult:
    """What one demo run measured.

    ``max_rel_diff`` is, over every parameter tensor, the largest absolute difference
    between the strategy's and plain PyTorch's final values, divided by the largest
    absolute value of that tensor in plain PyTorch; ``passed`` means it is within
    ``tolerance``. ``seconds`` is the strategy's training time (not the reference's, not
    data loading or starting processes).

    Asynchronous training (``parameter_server``) does not follow plain PyTorch step by
    step, so there ``max_rel_diff`` is None and ``passed`` means ``accuracy >=
    min_accuracy``; ``reference_accuracy`` is still plain PyTorch's after as many steps.
    ``num_workers`` counts the worker processes (1 for the strategies of one process).
    """

    accuracy: float
    max_rel_diff: float | None
    passed: bool
    steps: int
    seconds: float
    reference_accuracy: float
    tolerance: float
    strategy: str
    num_replicas: int
    num_workers: int = 1
    min_accuracy: float | None = None


# ----------------------------------------------------------------------- data


@dataclass(frozen=True)
class Digits:
    """The digits data set: standardised float32 features, a fixed stratified split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    """Load scikit-learn's digits, split 80/20 (stratified) and standardise on the train part.

    Example::

        from stratagem.demo import load_digits_split
        data = load_digits_split()
        assert data.x_train.shape == (1437, 64) and data.x_test.shape == (360, 64)
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)
    return Digits(as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test))


class ShuffledBatches:
    """A re-iterable of global ``(x, y)`` batches, reshuffled per epoch like ``DistributedSampler``.

    The order depends only on ``seed`` and the epoch set with :meth:`set_epoch`, so the
    strategy and the plain-PyTorch reference see the same batches in the same order.
    ``shuffle=False`` keeps the stored order (for evaluation).

    Example::

        import torch
        from stratagem.demo import ShuffledBatches
        batches = ShuffledBatches(torch.zeros(10, 2), torch.arange(10), batch_size=4, seed=0)
        assert [len(y) for _, y in batches] == [4, 4, 2]
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        self._x, self._y = x, y
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0

    @property
    def num_examples(self) -> int:
        return len(self._y)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return math.ceil(len(self._y) / self._batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed * 100_003 + self._epoch)
            order = torch.randperm(len(self._y), generator=generator)
        else:
            order = torch.arange(len(self._y))
        for start in range(0, len(order), self._batch_size):
            index = order[start:start + self._batch_size]
            yield self._x[index], self._y[index]


def make_model(num_features: int = 64, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    """The demo's network: a two-layer MLP."""
    return nn.Sequential(nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


# ------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    """The demo's training settings, resolved (``lr`` filled in); the cluster tasks get the same."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str
    seed: int

    def make_optimizer(self, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer][0](params, lr=self.lr)

    def train_batches(self, data: "Digits") -> "ShuffledBatches":
        return ShuffledBatches(data.x_train, data.y_train, batch_size=self.batch_size, seed=self.seed)

    def test_batches(self, data: "Digits") -> "ShuffledBatches":
        return ShuffledBatches(data.x_test, data.y_test, batch_size=self.batch_size, shuffle=False)

    def steps_per_epoch(self, data: "Digits") -> int:
        return math.ceil(len(data.y_train) / self.batch_size)


@dataclass
class Trained:
    """A strategy's training run: the initial and final parameters, test accuracy, time."""

    initial_state: dict[str, torch.Tensor]
    final_state: dict[str, torch.Tensor]
    accuracy: float
    seconds: float
    steps: int


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
    (:mod:`stratagem.demo_cluster`) and raise
    :class:`~stratagem.demo_cluster.ClusterDemoError` if it fails. Parameter-server
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
        from stratagem.demo_cluster import run_cluster_demo

        return run_cluster_demo(choice.cluster, replicas, config, tolerance=tolerance,
                                min_accuracy=min_accuracy, progress=progress, out=out)
    with _one_intra_op_thread():
        return _run_local(choice, replicas, config, tolerance, progress, out)


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run with one intra-op thread per replica, as ``torch.set_num_threads(1)``.

    A 64-wide MLP is too small to gain from splitting a matmul over threads; on a busy
    machine, OpenMP threads waiting for each other made the plain-PyTorch loop 10-30x
    slower (4-8 s instead of 0.3 s). Mirrored replicas still run in parallel, one per
    thread.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run_local(choice: StrategyChoice, replicas: int, config: TrainConfig, tolerance: float,
               progress: bool, out: TextIO | None) -> DemoResult:
    data = load_digits_split()
    dist_strategy = choice.build(replicas)
    if out is not None:
        print_header(out, _local_strategy_line(dist_strategy), data, config,
                     dist_strategy.num_replicas_in_sync)
    trained = train_with_strategy(dist_strategy, data, config, progress=progress)
    return check_equivalence(trained, data, config, tolerance, strategy=repr(dist_strategy),
                             num_replicas=dist_strategy.num_replicas_in_sync)


def train_with_strategy(dist_strategy: sg.Strategy, data: "Digits", config: TrainConfig, *,
                        progress: bool, ncols: int | None = None) -> Trained:
    """The custom training loop of SPEC §1 under ``dist_strategy``, then its test accuracy.

    Every worker of a multi-worker strategy runs this same function.
    """
    train, test = config.train_batches(data), config.test_batches(data)
    with dist_strategy.scope():
        torch.manual_seed(config.seed)
        model = make_model(data.num_features)
        dist_optimizer = config.make_optimizer(model.parameters())
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    dist_train = dist_strategy.experimental_distribute_dataset(train)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        per_example = F.cross_entropy(model(x), y, reduction="none")
        # global_batch_size=None: divide by the true global size, also for the short last batch
        loss = sg.nn.compute_average_loss(per_example)
        dist_optimizer.zero_grad()
        loss.backward()
        dist_optimizer.step()   # gradients summed over replicas, the same update everywhere
        return loss.detach()

    epochs = config.epochs
    bar = progress_bar(epochs * len(train), enabled=progress, ncols=ncols)
    started = time.perf_counter()
    for epoch in range(epochs):
        train.set_epoch(epoch)
        for batch in dist_train:
            per_replica = dist_strategy.run(train_step, args=(batch,))
            loss = dist_strategy.reduce(sg.ReduceOp.SUM, per_replica, axis=None)
            bar.set_postfix_str(f"epoch {epoch + 1}/{epochs} loss {loss.item():.4f}", refresh=False)
            bar.update(1)
    seconds = time.perf_counter() - started
    bar.close()
    accuracy = _distributed_accuracy(dist_strategy, model, test)
    final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trained(initial_state, final_state, accuracy, seconds, epochs * len(train))


def train_plain_pytorch(initial_state: dict[str, torch.Tensor], data: "Digits",
                        config: TrainConfig) -> tuple[nn.Module, float]:
    """The same training in plain single-device PyTorch; returns the model and its test accuracy."""
    train, test = config.train_batches(data), config.test_batches(data)
    reference = make_model(data.num_features)
    reference.load_state_dict(initial_state)
    reference_optimizer = config.make_optimizer(reference.parameters())
    for epoch in range(config.epochs):
        train.set_epoch(epoch)
        for x, y in train:
            loss = F.cross_entropy(reference(x), y)
            reference_optimizer.zero_grad()
            loss.backward()
            reference_optimizer.step()
    return reference, accuracy_of(reference, test)


def check_equivalence(trained: Trained, data: "Digits", config: TrainConfig, tolerance: float, *,
                      strategy: str, num_replicas: int, num_workers: int = 1) -> DemoResult:
    """Train plain PyTorch from the same initial weights and compare the final parameters."""
    with _one_intra_op_thread():
        reference, reference_accuracy = train_plain_pytorch(trained.initial_state, data, config)
    diff = max_relative_difference(trained.final_state, reference.state_dict())
    return DemoResult(accuracy=trained.accuracy, max_rel_diff=diff, passed=diff <= tolerance,
                      steps=trained.steps, seconds=trained.seconds, reference_accuracy=reference_accuracy,
                      tolerance=tolerance, strategy=strategy, num_replicas=num_replicas,
                      num_workers=num_workers)


def _distributed_accuracy(strategy: sg.Strategy, model: nn.Module, test: ShuffledBatches) -> float:
    """Count correct predictions on every replica's slice, then add them up."""
    def eval_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            return (model(x).argmax(dim=1) == y).sum()

    correct = 0
    for batch in strategy.experimental_distribute_dataset(test):
        correct += int(strategy.reduce("sum", strategy.run(eval_step, args=(batch,)), axis=None))
    return correct / test.num_examples


def accuracy_of(model: nn.Module, test: ShuffledBatches) -> float:
    """The fraction of ``test`` that ``model`` classifies right."""
    with torch.no_grad():
        correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in test)
    return correct / test.num_examples


def max_relative_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max over tensors of ``max|a - b| / max|b|``: float32 rounding gives about 1e-6.

    Example::

        import torch
        from stratagem.demo import max_relative_difference
        a = {"w": torch.tensor([1.0, -2.0])}
        assert max_relative_difference(a, {"w": torch.tensor([1.0, -2.002])}) < 1e-3
    """
    if state.keys() != reference.keys():
        raise InvalidArgumentError(
            f"the two models have different parameters: {sorted(state)} vs {sorted(reference)}")
    worst = 0.0
    for key, ref in reference.items():
        ref = ref.detach().double().cpu()
        value = state[key].detach().double().cpu()
        scale = max(ref.abs().max().item(), 1e-12) if ref.numel() else 1.0
        diff = (value - ref).abs().max().item() if ref.numel() else 0.0
        worst = max(worst, diff / scale) if not math.isnan(diff) else math.inf
    return worst


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


# --------------------------------------------------------------------- output


def progress_bar(total: int, enabled: bool, ncols: int | None = None):
    """The demo's tqdm bar on stderr; ``ncols`` fixes its width (a cluster task's stderr is a pipe)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=ncols is None, ncols=ncols, leave=True)


def print_header(out: TextIO, strategy_line: str, data: Digits, config: TrainConfig, num_replicas: int,
                 *, batches_line: str | None = None, training_line: str | None = None) -> None:
    """The header before training: the data, the strategy, how batches are cut, the settings."""
    train_rows = len(data.y_train)
    batch_size, epochs = config.batch_size, config.epochs
    steps_per_epoch = config.steps_per_epoch(data)
    last = train_rows - (steps_per_epoch - 1) * batch_size
    if batches_line is None:
        batches_line = (f"global {batch_size} -> {_split(batch_size, num_replicas)} per replica; "
                        f"last batch {last} -> {_split(last, num_replicas)}")
    if training_line is None:
        training_line = f"{epochs} epoch{'s' * (epochs != 1)} x {steps_per_epoch} steps"
    lines = [
        f"stratagem demo: MLP on scikit-learn digits ({train_rows} train / {len(data.y_test)} test "
        f"images, 64 features, 10 classes)",
        f"  strategy   {strategy_line}",
        f"  batches    {batches_line}",
        f"  training   {training_line}, {config.optimizer} lr {config.lr:g}, seed {config.seed}",
    ]
    print("\n".join(lines), file=out, flush=True)


def _local_strategy_line(strategy: sg.Strategy) -> str:
    num_replicas = strategy.num_replicas_in_sync
    name = type(strategy).__name__.lstrip("_")   # the default strategy's class is private
    return (f"{name}, {num_replicas} replica{'s' * (num_replicas != 1)} on "
            f"{', '.join(strategy.worker_devices)}")


def _split(rows: int, num_replicas: int) -> str:
    """How the strategy cuts ``rows`` (earlier replicas take the extra rows), as ``"15/14"``."""
    base, extra = divmod(rows, num_replicas)
    sizes = [base + (r < extra) for r in range(num_replicas)]
    return "/".join(map(str, sizes))


def format_result(result: DemoResult) -> str:
    """The results block that ``stratagem demo`` prints."""
    verdict = "PASS" if result.passed else "FAIL"
    lines = [
        "results",
        f"  test accuracy   {result.accuracy:.4f}   (plain PyTorch: {result.reference_accuracy:.4f})",
        f"  training time   {result.seconds:.2f} s for {result.steps} steps "
        f"({result.steps / max(result.seconds, 1e-9):.0f} steps/s)",
    ]
    if result.max_rel_diff is not None:
        lines.append(f"  equivalence     {verdict}: max relative parameter difference vs plain PyTorch "
                     f"{result.max_rel_diff:.1e} (tolerance {result.tolerance:.0e})")
    else:   # asynchronous training: judged on accuracy
        relation = ">=" if result.passed else "<"
        lines += [
            "  equivalence     not applicable: asynchronous training applies each worker's update "
            "as it comes, not in plain PyTorch's order",
            f"  accuracy check  {verdict}: test accuracy {result.accuracy:.4f} {relation} "
            f"{result.min_accuracy:g}",
        ]
        if not result.passed:
            lines.append("                  train longer (the threshold needs about --epochs 5)")
    return "\n".join(lines)


# ------------------------------------------------------------------------ CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {value}; e.g. 2")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_subcommand(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``stratagem demo`` on the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "demo", help="train a small classifier under a strategy and check it against plain PyTorch",
        description="Train an MLP on scikit-learn's handwritten digits under a strategy (2 logical "
                    "CPU replicas by default), report test accuracy, and check that the final "
                    "parameters equal those of plain single-device PyTorch (exit 1 if not). "
                    "multi_worker and parameter_server start their local processes themselves; "
                    "parameter_server, being asynchronous, passes on test accuracy >= "
                    f"{MIN_ASYNC_ACCURACY:g} instead.")
    strategies = "; ".join(f"{name}: {c.help}" for name, c in STRATEGIES.items())
    parser.add_argument("--strategy", choices=list(STRATEGIES), default="mirrored",
                        help=f"which strategy to train under (default: mirrored). {strategies}")
    parser.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                        help=f"logical CPU devices for --strategy mirrored (default: {DEFAULT_REPLICAS}), "
                             f"or per worker process for --strategy multi_worker (default: 1); "
                             f"1 to {MAX_REPLICAS}")
    parser.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS,
                        help=f"passes over the training set (default: {DEFAULT_EPOCHS}); parameter_server "
                             f"runs as many steps")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"global batch size, split over the replicas (default: {DEFAULT_BATCH_SIZE}, "
                             f"which leaves an uneven last batch of 29)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="learning rate (default: 0.1 for sgd, 0.01 for adam)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                        help="optimizer (default: sgd)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the results, no header or progress bar (nor, for the cluster "
                             "strategies, the output of their processes unless they fail)")
    parser.set_defaults(handler=_main, parser=parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    choice = STRATEGIES[args.strategy]
    if args.replicas is not None and not choice.uses_replicas:
        with_replicas = " and ".join(name for name, c in STRATEGIES.items() if c.uses_replicas)
        args.parser.error(f"--replicas applies to --strategy {with_replicas} only; --strategy "
                          f"{args.strategy} has one replica per worker. Drop --replicas or use "
                          f"--strategy mirrored")
    from stratagem.demo_cluster import ClusterDemoError

    try:
        result = run_demo(strategy=args.strategy, replicas=args.replicas, epochs=args.epochs,
                          batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                          progress=not args.quiet, out=None if args.quiet else sys.stdout)
    except ClusterDemoError as err:
        print(f"stratagem demo: {err}", file=sys.stderr, flush=True)
        return 1
    print(format_result(result), flush=True)
    return 0 if result.passed else 1
