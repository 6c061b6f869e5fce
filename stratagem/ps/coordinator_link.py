"""What a coordinator's threads may use of it: the link it hands them.

A :class:`~stratagem.ClusterCoordinator` runs a dispatcher thread per worker
(:mod:`stratagem.ps.dispatcher`) and a parameter-server watchdog (:mod:`stratagem.ps.health`).
Neither holds the coordinator: the coordinator builds one :class:`CoordinatorLink` and hands
it to each of them, and they reach it through nothing else. So the modules import one way
(coordinator -> dispatcher -> health -> this module), and each can be read alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from stratagem.ps.closure_queue import _Queue
from stratagem.ps.strategy import ParameterServerStrategy
from stratagem.ps.traffic import WorkerTraffic

__all__ = ["CoordinatorLink"]


@dataclass(frozen=True)
class CoordinatorLink:
    """The part of a coordinator its dispatchers and its watchdog share: the coordinator's own
    queue, event and dict, and three of its methods as callbacks (built in its ``__init__``)."""

    id: str                                   # names the coordinator's requests, leases and fences
    strategy: ParameterServerStrategy         # its placement (values, metrics) and cluster (ps, token, tenure)
    queue: _Queue                             # the closures scheduled and not finished
    stopping: threading.Event                 # set by shutdown: every thread of the coordinator ends
    datasets: Mapping[str, Callable]          # per-worker datasets each worker creates before running closures
    closure_key: Callable[[Callable], str]    # the name a function is cached under on the workers
    check: Callable[[], None]                 # raises what makes waiting pointless: a fatal error, a lost ps, shutdown
    fail: Callable[[BaseException], None]     # a fatal error: every closure fails with it, the API raises it from then on
    traffic: WorkerTraffic                    # each worker's calls to the ps, summed over the closures it ran
