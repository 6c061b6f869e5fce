"""``stratagem timeline PATH``: what a trace says without a browser -- its tasks and steps, the
straggler table read back from it, and with ``--png OUT`` a picture of it.

Commands::

    stratagem timeline trace.json                     # the tasks, steps and straggler table
    stratagem timeline trace.json --png trace.png     # and a picture (needs matplotlib)
"""

from __future__ import annotations

import argparse
import sys

from stratagem.observe.chrome import load
from stratagem.observe.draw import draw, trace_steps
from stratagem.observe.report import format_report, summarize

__all__ = ["add_subcommand", "run_timeline"]


def run_timeline(args: argparse.Namespace) -> int:
    """The subcommand's handler: print the trace's summary, draw it with ``--png``; 0 on success,
    2 when the file is not a trace or cannot be drawn (said on stderr)."""
    try:
        trace = load(args.path)
    except (OSError, ValueError) as err:
        print(f"stratagem timeline: error: {err}", file=sys.stderr)
        return 2
    steps = trace_steps(trace)
    spans = sum(e.get("ph") == "X" for e in trace["traceEvents"])
    print(f"{args.path}: {spans} spans from {len(steps)} task{'s' if len(steps) != 1 else ''} with steps")
    if steps:
        print(format_report([dict(summarize(rows, worker=0), worker=task) for task, rows in steps.items()]))
    if args.png:
        try:
            draw(trace, args.png, title=args.title or args.path, everything=args.all)
        except (ImportError, ValueError, OSError) as err:
            print(f"stratagem timeline: error: {err}", file=sys.stderr)
            return 2
        print(f"picture written to {args.png}")
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``timeline`` on the ``stratagem`` command's subparsers."""
    parser = subparsers.add_parser(
        "timeline", help="read a trace of `stratagem launch --timeline`: steps, straggler, a picture",
        description="Print what a Chrome/Perfetto trace written by `stratagem launch --timeline` or "
                    "sg.experimental.Timeline says (its tasks, the straggler table of its steps) and, "
                    "with --png, draw it (a lane per task and thread, spans colored by kind).")
    parser.add_argument("path", metavar="PATH", help="the trace (JSON)")
    parser.add_argument("--png", default=None, metavar="OUT", help="draw the trace to this PNG file (needs matplotlib)")
    parser.add_argument("--title", default=None, help="the picture's title (default: PATH)")
    parser.add_argument("--all", action="store_true",
                        help="draw the whole trace (start-up and shutdown too), not only the steps")
    parser.set_defaults(func=run_timeline, handler=run_timeline)
    return parser
