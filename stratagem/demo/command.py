"""``stratagem demo`` on the command line: its flags, their checks, and what it prints.

:func:`add_subcommand` registers the subcommand with :mod:`stratagem.cli`; the handler runs
:func:`stratagem.demo.run_demo`, prints the results block, and exits 1 when the check fails.
"""

from __future__ import annotations

import argparse
import math
import sys

from stratagem.demo.cluster import ClusterDemoError
from stratagem.demo.report import format_result
from stratagem.demo.run import (DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS, DEFAULT_REPLICAS, MAX_REPLICAS,
                                MIN_ASYNC_ACCURACY, STRATEGIES, run_demo)
from stratagem.demo.training import OPTIMIZERS

__all__ = ["add_subcommand"]


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
                        help=f"logical CPU devices for --strategy mirrored and central_storage "
                             f"(default: {DEFAULT_REPLICAS}), "
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
    try:
        result = run_demo(strategy=args.strategy, replicas=args.replicas, epochs=args.epochs,
                          batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                          progress=not args.quiet, out=None if args.quiet else sys.stdout)
    except ClusterDemoError as err:
        print(f"stratagem demo: {err}", file=sys.stderr, flush=True)
        return 1
    print(format_result(result), flush=True)
    return 0 if result.passed else 1
