"""``stratagem launch``: the command line of the local launcher.

:func:`add_launch_parser` registers the subcommand on the ``stratagem`` command's
subparsers; ``python -m stratagem.launch`` runs it on its own (:func:`main`). Everything
after the script is the script's own command line. Bad input is reported as
``stratagem launch: error: ...`` with exit status 2, before any process starts.

Commands::

    stratagem launch --workers 2 train.py --epochs 3      # 2 workers run train.py
    stratagem launch --chief --workers 2 train.py         # a chief and 2 workers run it
    stratagem launch --ps 2 --workers 2 train.py          # train.py is the coordinator;
                                                          # 2 workers, 2 ps run `stratagem server`
    stratagem launch --max-restarts 3 train.py            # after a failure, restart every task
                                                          # together, up to 3 times
    stratagem launch --grace-period 30 train.py           # tasks get 30 s to save when stopped
    stratagem launch --workers 2 --evaluator 1 train.py   # an evaluator task runs train.py too
                                                          # (TF_CONFIG task type "evaluator")
    stratagem launch --join-timeout 1800 train.py         # the tasks may take 30 minutes to
                                                          # reach their strategy (default: 600 s)
    stratagem launch --hang-timeout 300 train.py          # 5 minutes without a step or a collective
                                                          # anywhere: say where each task stands, stop
    stratagem launch --timeline trace.json train.py       # one Chrome/Perfetto trace of every task
    python -m stratagem.launch --workers 2 train.py       # the same, without the stratagem command
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence

from stratagem.errors import InvalidArgumentError, StratagemError
from stratagem.launch.local import check_script, launch_local
from stratagem.launch.ray_command import add_ray_arguments, run_ray
from stratagem.launch.job_shape import PER_NODE_OPTIONS

__all__ = ["add_launch_parser", "add_subcommand", "build_parser", "main", "run_launch", "shared_options"]

_DESCRIPTION = (
    "Start a local cluster on loopback and run SCRIPT in it: every task gets TensorFlow's "
    "TF_CONFIG (without --ps the chief and workers also get torchrun's RANK, WORLD_SIZE, "
    "LOCAL_RANK and LOCAL_WORLD_SIZE to match) and a fresh cluster token "
    "(STRATAGEM_CLUSTER_TOKEN), each output line is "
    "prefixed with its task, a failure restarts the job up to --max-restarts times (every "
    "task together, with a new rendezvous; with --ps the failed server alone), a task that "
    "exits with 75 (preempted, after its group saved) restarts the group without spending a "
    "restart (up to --max-preemptions times), tasks that have not joined their cluster after "
    "--join-timeout seconds stop the job, the tasks die with the launcher (also when it is "
    "killed), and the exit status is non-zero, naming the task, when the job fails. "
    "Without --ps every worker (and the chief) runs SCRIPT; with --ps, SCRIPT is the coordinator (the chief) and the "
    "workers and parameter servers run `stratagem server`.")
_DESCRIPTION = textwrap.fill(_DESCRIPTION, width=88)  # the epilog's layout is kept as written

_EPILOG = """examples:
  stratagem launch --workers 2 train.py --epochs 3
  stratagem launch --chief --workers 2 --max-restarts 2 train.py
  stratagem launch --ps 1 --workers 2 train_ps.py
  stratagem launch --workers 2 --evaluator 1 train.py
  stratagem launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --token-file ~/.token train.py
  stratagem launch --nnodes 2:3 --rdzv 10.0.0.1:29400 --max-restarts 3 train.py   # elastic"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="worker tasks (default: 2); with --nnodes, on each node (default: 1)")
    parser.add_argument("--ps", type=int, default=0, metavar="M",
                        help="parameter-server tasks; with M > 0 SCRIPT runs as the chief "
                             "(the coordinator) and the other tasks run `stratagem server` "
                             "(default: 0)")
    parser.add_argument("--chief", action="store_true",
                        help="add a chief task (index 0) that runs SCRIPT too; implied by --ps")
    parser.add_argument("--evaluator", type=int, default=0, metavar="E",
                        help="evaluator tasks (0 or 1): runs SCRIPT beside training with task type "
                             "'evaluator' (e.g. an sg.SidecarEvaluator); the job succeeds when it "
                             "also exits 0 after training (default: 0)")
    parser.add_argument("--evaluator-timeout", type=float, default=600.0, metavar="S",
                        help="seconds the evaluator gets to finish once training has ended, "
                             "before the job fails (default: 600)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="after a failure, restart up to K times: every task together on "
                             "fresh ports (STRATAGEM_RESTART=1, 2, ... tells the script), or with "
                             "--ps the failed server alone, same TF_CONFIG and port (default: 0)")
    parser.add_argument("--max-preemptions", type=int, default=100, metavar="N",
                        help="restart the group after a preemption (a task exits with 75) up to "
                             "N times; these restarts do not spend --max-restarts, and the next "
                             "preemption fails the job with status 75 (default: 100)")
    parser.add_argument("--grace-period", type=float, default=5.0, metavar="S",
                        help="seconds the tasks get to exit after SIGTERM (to save a checkpoint) "
                             "before SIGKILL, when the job is stopped or restarted (default: 5)")
    parser.add_argument("--join-timeout", type=float, default=600.0, metavar="S",
                        help="seconds the tasks get, from their start, to join their cluster "
                             "(the workers' strategy forms its group; with --ps the coordinator's "
                             "strategy reaches the servers) before the job is stopped with "
                             "status 1, naming them; 0 waits for ever (default: 600)")
    parser.add_argument("--hang-timeout", type=float, default=0.0, metavar="S",
                        help="once training has begun, seconds without progress in any task (a step, "
                             "a collective) after which the job is hung: the launcher prints where each "
                             "task stands (its last collective, the one it waits in, its line of the "
                             "script), writes every stack to a file it names, and stops the job with "
                             "status 1; 0 waits for ever (default: 0)")
    parser.add_argument("--port-base", type=int, default=None, metavar="P",
                        help="give the tasks the ports P, P+1, ... (chief, workers, ps) "
                             "(default: free ports)")
    parser.add_argument("--host", default=None,
                        help="the address every task listens on (default: 127.0.0.1; with --nnodes, the "
                             "address this node reaches the rendezvous host from)")
    nodes = parser.add_argument_group(
        "many nodes", "run the same command on every node; node-rank 0 (or the node whose address "
        "--rdzv is) serves the rendezvous")
    nodes.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="nodes in the job; MIN:MAX for an elastic job that goes on with MIN or more "
                            "when nodes are lost (default: one machine, no rendezvous)")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="I",
                       help="this node's rank, 0 to N-1 (node 0 hosts the rendezvous); without it, "
                            "nodes are ranked in the order they join")
    nodes.add_argument("--rdzv", default=None, metavar="HOST:PORT",
                       help="the rendezvous address: an address of the node that hosts it")
    nodes.add_argument("--token-file", default=None, metavar="PATH",
                       help="a file (mode 600) holding the job's cluster token, the same on every node "
                            "(default: the environment variable STRATAGEM_CLUSTER_TOKEN)")
    nodes.add_argument("--node-timeout", type=float, default=30.0, metavar="S",
                       help="a node silent this long is lost (one whose launcher dies is lost at once); "
                            "an elastic job first waits this long for more nodes before it starts with "
                            "fewer (default: 30)")
    nodes.add_argument("--rdzv-timeout", type=float, default=600.0, metavar="S",
                       help="seconds for all nodes (MIN in an elastic job) to join, before the job "
                            "fails naming the missing ones (default: 600)")
    nodes.add_argument("--per-node-args", action="store_true",
                       help="let the script's arguments differ from node to node (give it on every "
                            "node); without it a node started with other arguments is refused, as is "
                            "one with other options or another script")
    parser.add_argument("--timeline", default=None, metavar="PATH",
                        help="record every task's steps and write them, merged, to PATH as one "
                             "Chrome/Perfetto trace when the job ends (docs/observability.md)")
    add_ray_arguments(parser)   # --ray ADDRESS and the --ray-* options (ray_command.py)
    parser.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's own arguments")


def run_launch(args: argparse.Namespace) -> int:
    """The subcommand's handler: launch, and return the exit status (2 for bad input)."""
    try:
        if args.hang_timeout and (args.ray or args.nnodes is not None or args.rdzv is not None):
            raise InvalidArgumentError("--hang-timeout watches the tasks of a launch on one machine; it is not "
                                       "available with --nnodes or --ray yet (leave it out there)")
        if args.timeline is not None and (args.ray or args.nnodes is not None or args.rdzv is not None):
            raise InvalidArgumentError(
                "--timeline merges the traces of the tasks of one machine; with --nnodes or --ray, open "
                "sg.experimental.Timeline(path) in the script instead (docs/observability.md).")
        if args.ray:   # on a Ray cluster (ray_command.py)
            return run_ray(args)
        if args.nnodes is not None or args.rdzv is not None or args.node_rank is not None:
            return _run_nodes(args)
        return launch_local(args.script, args.args, num_workers=2 if args.workers is None else args.workers,
                            num_ps=args.ps,
                            chief=args.chief, max_restarts=args.max_restarts,
                            max_preemptions=args.max_preemptions,
                            port_base=args.port_base, host=args.host or "127.0.0.1",
                            grace_period=args.grace_period, num_evaluators=args.evaluator,
                            evaluator_timeout=args.evaluator_timeout,
                            join_timeout=args.join_timeout, hang_timeout=args.hang_timeout,
                            timeline=args.timeline)
    except StratagemError as err:
        print(f"stratagem launch: error: {err}", file=sys.stderr)
        return 2


def _run_nodes(args: argparse.Namespace) -> int:
    # gRPC (the rendezvous) is imported here only; its fork handlers would log at every task start
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from stratagem.launch.nodes import launch_nodes, read_token

    if args.nnodes is None or args.rdzv is None:
        raise InvalidArgumentError("a multi-node launch needs both --nnodes and --rdzv HOST:PORT (the "
                                   "rendezvous address, on node-rank 0), the same on every node.")
    if args.ps or args.port_base is not None:
        raise InvalidArgumentError(
            "--ps and --port-base are for one machine; across nodes, run collective training "
            "(--workers per node), or parameter-server training under a scheduler whose "
            "TF_CONFIG names every task (see docs/slurm.md and docs/kubernetes.md).")
    if args.workers is None:
        args.workers = 1   # per node: a node given --workers 1 agrees with one given none
    return launch_nodes(check_script(args.script), args.args, nnodes=args.nnodes, rdzv=args.rdzv,
                        token=read_token(args.token_file), node_rank=args.node_rank,
                        host=args.host, workers=args.workers, chief=args.chief,
                        evaluator=args.evaluator, max_restarts=args.max_restarts,
                        max_preemptions=args.max_preemptions, grace_period=args.grace_period,
                        join_timeout=args.join_timeout, evaluator_timeout=args.evaluator_timeout,
                        node_timeout=args.node_timeout, rdzv_timeout=args.rdzv_timeout,
                        per_node_args=args.per_node_args, options=shared_options(args))


def shared_options(args: argparse.Namespace) -> dict[str, object]:
    """The options every node of a multi-node launch must agree on, by name, with their values.

    Every option of ``stratagem launch`` is one, except :data:`PER_NODE_OPTIONS`: a new
    option is compared by default. The script and its arguments are compared apart (by the
    rendezvous: the script's contents, and the arguments unless ``--per-node-args``).

    Example::

        >>> from stratagem.launch.command import build_parser, shared_options
        >>> args = build_parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--grace-period", "30", "t.py"])
        >>> options = shared_options(args)
        >>> options["--grace-period"], options["--nnodes"], "--node-rank" in options
        (30.0, '2', False)
    """
    defaults = vars(build_parser().parse_args(["SCRIPT"]))   # every option's name, none given
    skipped = {*PER_NODE_OPTIONS, "--script", "--args"}
    named = {"--" + dest.replace("_", "-"): dest for dest in defaults}
    return {name: getattr(args, dest) for name, dest in named.items() if name not in skipped}


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``launch`` on the ``stratagem`` command's subparsers.

    The handler is set as both ``func`` and ``handler`` (the name ``stratagem.cli`` uses):
    a function of the parsed arguments returning the exit status.
    """
    parser = subparsers.add_parser(
        "launch", help="run a script as a local cluster (TF_CONFIG for every task)",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run_launch, handler=run_launch)
    return parser


#: The name ``stratagem.cli`` looks for in each subcommand module.
add_subcommand = add_launch_parser


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for ``python -m stratagem.launch``."""
    parser = argparse.ArgumentParser(prog="stratagem launch", description=_DESCRIPTION,
                                     epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stratagem.launch ...``: parse, launch, return the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_launch(args)
