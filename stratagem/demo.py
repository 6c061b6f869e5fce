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

Commands::

    stratagem demo                                  # MirroredStrategy on cpu:0, cpu:1
    stratagem demo --replicas 3 --optimizer adam    # three replicas, Adam
    stratagem demo --strategy one_device --quiet    # results only
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

    Strategies that need processes of their own (multi-worker, parameter server) get an
    entry here whose ``build`` starts them.
    """

    build: Callable[[int], sg.Strategy]
    uses_replicas: bool
    help: str


def _mirrored(replicas: int) -> sg.Strategy:
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


STRATEGIES: dict[str, StrategyChoice] = {
    "mirrored": StrategyChoice(_mirrored, True, "MirroredStrategy on --replicas logical CPU devices"),
    "one_device": StrategyChoice(lambda _: sg.OneDeviceStrategy("cpu"), False, 'OneDeviceStrategy("cpu")'),
    "default": StrategyChoice(lambda _: sg.get_strategy(), False, "the default strategy (sg.get_strategy())"),
}

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 0.1),     # class, default learning rate
    "adam": (torch.optim.Adam, 0.01),
}

DEFAULT_REPLICAS = 2
DEFAULT_EPOCHS = 20
DEFAULT_BATCH_SIZE = 64
DEFAULT_TOLERANCE = 1e-4
MAX_REPLICAS = 64   # each logical CPU replica is a thread; a typo like --replicas 6400 should not start them


@dataclass(frozen=True)
class DemoResult:
    """What one demo run measured.

    ``max_rel_diff`` is, over every parameter tensor, the largest absolute difference
    between the strategy's and plain PyTorch's final values, divided by the largest
    absolute value of that tensor in plain PyTorch. ``seconds`` is the strategy's
    training time (not the reference's, not data loading).
    """

    accuracy: float
    max_rel_diff: float
    passed: bool
    steps: int
    seconds: float
    reference_accuracy: float
    tolerance: float
    strategy: str
    num_replicas: int


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


def run_demo(strategy: str = "mirrored", replicas: int = DEFAULT_REPLICAS, epochs: int = DEFAULT_EPOCHS,
             batch_size: int = DEFAULT_BATCH_SIZE, lr: float | None = None, optimizer: str = "sgd",
             seed: int = 0, tolerance: float = DEFAULT_TOLERANCE, progress: bool = True,
             out: TextIO | None = None) -> DemoResult:
    """Train the digits MLP under a strategy, then check it against plain PyTorch.

    ``strategy`` is a key of :data:`STRATEGIES`; ``replicas`` applies to ``"mirrored"``
    only. ``lr=None`` takes the optimizer's default (0.1 for SGD, 0.01 for Adam).
    ``progress`` shows a tqdm bar on stderr; ``out`` (e.g. ``sys.stdout``) receives a
    header naming the strategy and the data before training starts.

    Example::

        from stratagem.demo import run_demo
        result = run_demo("mirrored", replicas=3, epochs=1, progress=False)
        print(f"{result.accuracy:.3f}", result.passed)
    """
    choice = _validate(strategy, replicas, epochs, batch_size, lr, optimizer, tolerance)
    with _one_intra_op_thread():
        return _run(choice, replicas, epochs, batch_size, lr, optimizer, seed, tolerance, progress, out)


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


def _run(choice: StrategyChoice, replicas: int, epochs: int, batch_size: int, lr: float | None,
         optimizer: str, seed: int, tolerance: float, progress: bool, out: TextIO | None) -> DemoResult:
    optimizer_class, default_lr = OPTIMIZERS[optimizer]
    lr = default_lr if lr is None else lr
    data = load_digits_split()
    train = ShuffledBatches(data.x_train, data.y_train, batch_size=batch_size, seed=seed)
    test = ShuffledBatches(data.x_test, data.y_test, batch_size=batch_size, shuffle=False)

    dist_strategy = choice.build(replicas)
    if out is not None:
        _print_header(out, dist_strategy, data, batch_size, epochs, len(train), optimizer, lr, seed)

    # --- the custom training loop of SPEC §1 --------------------------------------
    with dist_strategy.scope():
        torch.manual_seed(seed)
        model = make_model(data.num_features)
        dist_optimizer = optimizer_class(model.parameters(), lr=lr)
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

    bar = _progress_bar(epochs * len(train), enabled=progress)
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

    # --- the same training in plain single-device PyTorch --------------------------
    reference = make_model(data.num_features)
    reference.load_state_dict(initial_state)
    reference_optimizer = optimizer_class(reference.parameters(), lr=lr)
    for epoch in range(epochs):
        train.set_epoch(epoch)
        for x, y in train:
            loss = F.cross_entropy(reference(x), y)
            reference_optimizer.zero_grad()
            loss.backward()
            reference_optimizer.step()
    reference_accuracy = _accuracy(reference, test)

    diff = max_relative_difference(model.state_dict(), reference.state_dict())
    return DemoResult(accuracy=accuracy, max_rel_diff=diff, passed=diff <= tolerance,
                      steps=epochs * len(train), seconds=seconds, reference_accuracy=reference_accuracy,
                      tolerance=tolerance, strategy=repr(dist_strategy),
                      num_replicas=dist_strategy.num_replicas_in_sync)


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


def _accuracy(model: nn.Module, test: ShuffledBatches) -> float:
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


def _validate(strategy: str, replicas: int, epochs: int, batch_size: int, lr: float | None,
              optimizer: str, tolerance: float) -> StrategyChoice:
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise InvalidArgumentError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name, value in (("replicas", replicas), ("epochs", epochs), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    if replicas > MAX_REPLICAS:
        raise InvalidArgumentError(
            f"replicas={replicas} is more than the demo allows: every logical CPU replica is a thread; "
            f"use {MAX_REPLICAS} or fewer")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InvalidArgumentError(f"lr must be a positive number (or None for the default), got {lr!r}")
    if not tolerance > 0:
        raise InvalidArgumentError(f"tolerance must be positive, got {tolerance!r}")
    return STRATEGIES[strategy]


# --------------------------------------------------------------------- output


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, leave=True)


def _print_header(out: TextIO, strategy: sg.Strategy, data: Digits, batch_size: int, epochs: int,
                  steps_per_epoch: int, optimizer: str, lr: float, seed: int) -> None:
    num_replicas = strategy.num_replicas_in_sync
    train_rows = len(data.y_train)
    last = train_rows - (steps_per_epoch - 1) * batch_size
    name = type(strategy).__name__.lstrip("_")   # the default strategy's class is private
    lines = [
        f"stratagem demo: MLP on scikit-learn digits ({train_rows} train / {len(data.y_test)} test "
        f"images, 64 features, 10 classes)",
        f"  strategy   {name}, {num_replicas} replica{'s' * (num_replicas != 1)} on "
        f"{', '.join(strategy.worker_devices)}",
        f"  batches    global {batch_size} -> {_split(batch_size, num_replicas)} per replica; "
        f"last batch {last} -> {_split(last, num_replicas)}",
        f"  training   {epochs} epoch{'s' * (epochs != 1)} x {steps_per_epoch} steps, "
        f"{optimizer} lr {lr:g}, seed {seed}",
    ]
    print("\n".join(lines), file=out, flush=True)


def _split(rows: int, num_replicas: int) -> str:
    """How the strategy cuts ``rows`` (earlier replicas take the extra rows), as ``"15/14"``."""
    base, extra = divmod(rows, num_replicas)
    sizes = [base + (r < extra) for r in range(num_replicas)]
    return "/".join(map(str, sizes))


def format_result(result: DemoResult) -> str:
    """The results block that ``stratagem demo`` prints."""
    verdict = "PASS" if result.passed else "FAIL"
    return "\n".join([
        "results",
        f"  test accuracy   {result.accuracy:.4f}   (plain PyTorch: {result.reference_accuracy:.4f})",
        f"  training time   {result.seconds:.2f} s for {result.steps} steps "
        f"({result.steps / max(result.seconds, 1e-9):.0f} steps/s)",
        f"  equivalence     {verdict}: max relative parameter difference vs plain PyTorch "
        f"{result.max_rel_diff:.1e} (tolerance {result.tolerance:.0e})",
    ])


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
                    "parameters equal those of plain single-device PyTorch (exit 1 if not).")
    strategies = "; ".join(f"{name}: {c.help}" for name, c in STRATEGIES.items())
    parser.add_argument("--strategy", choices=list(STRATEGIES), default="mirrored",
                        help=f"which strategy to train under (default: mirrored). {strategies}")
    parser.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                        help=f"logical CPU devices for --strategy mirrored, 1 to {MAX_REPLICAS} "
                             f"(default: {DEFAULT_REPLICAS})")
    parser.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS,
                        help=f"passes over the training set (default: {DEFAULT_EPOCHS})")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"global batch size, split over the replicas (default: {DEFAULT_BATCH_SIZE}, "
                             f"which leaves an uneven last batch of 29)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="learning rate (default: 0.1 for sgd, 0.01 for adam)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                        help="optimizer (default: sgd)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order")
    parser.add_argument("--quiet", action="store_true", help="print only the results, no header or progress bar")
    parser.set_defaults(handler=_main, parser=parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    choice = STRATEGIES[args.strategy]
    if args.replicas is not None and not choice.uses_replicas:
        args.parser.error(f"--replicas applies to --strategy mirrored only; --strategy "
                          f"{args.strategy} has one replica. Drop --replicas or use --strategy mirrored")
    replicas = DEFAULT_REPLICAS if args.replicas is None else args.replicas
    result = run_demo(strategy=args.strategy, replicas=replicas, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                      progress=not args.quiet, out=None if args.quiet else sys.stdout)
    print(format_result(result), flush=True)
    return 0 if result.passed else 1
