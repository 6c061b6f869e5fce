#!/usr/bin/env python
"""What one no-op closure costs: CPU seconds per closure (the coordinator's process, and the
whole cluster's: coordinator, workers, ps) and the round trip, on a real 2-worker, 1-ps cluster
(``stratagem launch``, loopback). CPU per closure does not depend on the machine's load, so it
compares two checkouts measured minutes apart; the round trip does only when they alternate.

    python benchmarks/ps_closure_cost.py --closures 2000 --rounds 5
    python benchmarks/ps_closure_cost.py --one-worker     # round trip of one closure at a time
    python benchmarks/ps_closure_cost.py --small-step     # each closure a small SGD step (a pull, a push)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402


def _noop() -> None:
    return None


def chief(spec: dict) -> None:
    import torch

    import stratagem as sg

    torch.set_num_threads(1)
    profiles: list = []
    if spec["profile"]:   # every thread of the coordinator (its dispatchers too, and the warm-up), CPU time
        import cProfile
        import threading

        def hook(*_: object) -> None:
            sys.setprofile(None)
            profiles.append(cProfile.Profile(time.thread_time))
            profiles[-1].enable()
        threading.setprofile(hook)
        hook()
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    fn = _noop
    if spec["small_step"]:
        with strategy.scope():
            model = torch.nn.Linear(64, 8)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def fn() -> None:
            optimizer.zero_grad()
            model(torch.ones(4, 64)).sum().backward()
            optimizer.step()
    for _ in range(200):   # warm: the function cached on both workers, the connections open
        coordinator.schedule(fn)
    coordinator.join()
    rows = []
    for _ in range(spec["rounds"]):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own, cluster, start = usage.ru_utime + usage.ru_stime, h.cluster_cpu_s(), time.perf_counter()
        if spec["one_worker"]:   # one closure in flight: each waits for the previous one's value
            for _ in range(spec["closures"]):
                coordinator.schedule(fn).fetch()
        else:
            for _ in range(spec["closures"]):
                coordinator.schedule(fn)
            coordinator.join()
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        n = spec["closures"]
        rows.append({"closures_per_s": n / wall, "wall_ms": 1e3 * wall / n,
                     "coordinator_cpu_ms": 1e3 * (usage.ru_utime + usage.ru_stime - own) / n,
                     "cluster_cpu_ms": 1e3 * (h.cluster_cpu_s() - cluster) / n})
    if profiles:
        import io
        import pstats
        for prof in profiles:
            prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiles[0], stream=text)
        for prof in profiles[1:]:
            stats.add(prof)
        stats.sort_stats("tottime").print_stats(35)
        print(text.getvalue(), flush=True)
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--closures", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one-worker", action="store_true")
    parser.add_argument("--small-step", action="store_true", help="closures that pull and push a Linear(64, 8)")
    parser.add_argument("--profile", action="store_true", help="print the coordinator's profile (all threads)")
    parser.add_argument("--chief", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chief:
        chief(json.loads(args.chief))
        return
    spec = {"closures": args.closures, "rounds": args.rounds, "one_worker": args.one_worker, "profile": args.profile, "small_step": args.small_step}
    out = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "1",
                          os.path.abspath(__file__), "--chief", json.dumps(spec)], env=h.child_env(),
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if "RESULT " in line]
    if not lines:
        sys.exit(f"the cluster failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    if args.profile:
        print(out.stdout.partition("RESULT ")[0][-12000:])
    rows = json.loads(lines[-1].partition("RESULT ")[2])
    for key in rows[0]:
        values = sorted(r[key] for r in rows)
        print(f"{key:20s} median {h.median(values):8.3f}   (rounds: {', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
