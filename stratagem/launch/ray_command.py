"""``stratagem launch --ray ADDRESS``: the command line of the launcher on Ray.

``command.py`` adds these options to ``stratagem launch`` (:func:`add_ray_arguments`) and
hands a command with ``--ray`` to :func:`run_ray`. The other options (``--workers``,
``--chief``, ``--ps``, ``--max-restarts``, ``--max-preemptions``, ``--grace-period``,
``--join-timeout``) mean what they mean locally; ``--port-base``, ``--host`` and
``--evaluator`` are the local launcher's and are refused with ``--ray`` (the actors pick
their ports on their nodes).

Commands::

    stratagem launch --ray 10.0.0.1:6379 --workers 4 train.py           # 4 workers as Ray actors
    stratagem launch --ray auto --workers 4 --ray-spread train.py       # each on a node of its own
    stratagem launch --ray 10.0.0.1:6379 --ray-gpus-per-task 1 --max-restarts 3 train.py
"""

from __future__ import annotations

import argparse

from stratagem.errors import InvalidArgumentError
from stratagem.launch.ray_launch import launch_ray

__all__ = ["add_ray_arguments", "run_ray"]

#: The local launcher's options that mean nothing on Ray, with their defaults.
_LOCAL_ONLY = {"port_base": ("--port-base", None), "host": ("--host", None), "evaluator": ("--evaluator", 0),
               "nnodes": ("--nnodes", None), "rdzv": ("--rdzv", None), "node_rank": ("--node-rank", None)}


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--ray ADDRESS`` and the ``--ray-*`` options to ``stratagem launch``'s parser."""
    group = parser.add_argument_group("on a Ray cluster (pip install 'stratagem[ray]'; see docs/ray.md)")
    group.add_argument("--ray", metavar="ADDRESS", default=None,
                       help="run the tasks as Ray actors on the Ray cluster at ADDRESS (its head's "
                            "host:port, 'auto', or ray://host:port) instead of on this machine")
    group.add_argument("--ray-spread", action="store_true",
                       help="put every task on a node of its own (Ray's STRICT_SPREAD placement)")
    group.add_argument("--ray-cpus-per-task", type=float, default=1.0, metavar="C",
                       help="CPUs each task's actor reserves (default: 1)")
    group.add_argument("--ray-gpus-per-task", type=float, default=0.0, metavar="G",
                       help="GPUs each task's actor reserves (default: 0)")
    group.add_argument("--ray-placement-timeout", type=float, default=60.0, metavar="S",
                       help="seconds Ray gets to place the tasks and start their actors (default: 60)")


def run_ray(args: argparse.Namespace) -> int:
    """Launches on Ray from ``stratagem launch``'s parsed arguments; returns the exit status."""
    for name, (flag, default) in _LOCAL_ONLY.items():
        if getattr(args, name) != default:
            raise InvalidArgumentError(
                f"{flag} is for stratagem's own launcher; with --ray, Ray places the tasks and each task's "
                "actor picks its port on its own node. Leave it out.")
    return launch_ray(args.script, args.args, address=args.ray,
                      num_workers=2 if args.workers is None else args.workers, num_ps=args.ps,
                      chief=args.chief, max_restarts=args.max_restarts, max_preemptions=args.max_preemptions,
                      spread=args.ray_spread, cpus_per_task=args.ray_cpus_per_task,
                      gpus_per_task=args.ray_gpus_per_task, grace_period=args.grace_period,
                      join_timeout=args.join_timeout, placement_timeout=args.ray_placement_timeout)
