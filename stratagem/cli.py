"""The ``stratagem`` command: one subcommand per module.

Each subcommand lives in its own module, which exposes
``add_subcommand(subparsers) -> argparse.ArgumentParser`` and sets a ``handler``
default: a function ``handler(args) -> int`` that returns the exit status. Adding a
subcommand (``launch``, ``server``) means adding its module to :data:`SUBCOMMANDS`.

Commands::

    stratagem demo --help
    python -m stratagem demo --replicas 3
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from stratagem import __version__
from stratagem.errors import StratagemError

#: The module providing each subcommand's ``add_subcommand``, in the order ``--help`` lists them.
SUBCOMMANDS: dict[str, str] = {
    "demo": "stratagem.demo",
    "launch": "stratagem.launch",
    "server": "stratagem.ps.server",
    "timeline": "stratagem.observe.command",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser: with ``command`` only that subcommand, else every one.

    A command line that names its subcommand imports only that subcommand's module:
    ``stratagem launch`` starts its tasks without importing torch first (about a second).
    """
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="TensorFlow's tf.distribute strategies for PyTorch.")
    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module_name).add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stratagem`` command line; return the exit status.

    Example::

        from stratagem.cli import main
        status = main(["demo", "--epochs", "1", "--quiet"])   # 0 when equivalence holds
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except StratagemError as err:
        # Input we could not check in argparse: report it like a usage error, without a traceback.
        print(f"stratagem: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stratagem: interrupted", file=sys.stderr)
        return 130
