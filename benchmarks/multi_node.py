"""Many machines: start-up and restart of ``stratagem launch --nnodes`` beside torchrun's, on namespace hosts.

The "hosts" are network namespaces on one bridge (:mod:`stratagem.testing.hosts`; root
needed), each with its own address, one worker per host. Each round runs, in fresh processes
and a rotated order:

- start-up: seconds from the command to worker 0's first training step, for
  ``stratagem launch --workers 2`` (one machine), ``stratagem launch --nnodes 2`` (two hosts),
  and ``torchrun`` on the same two hosts (``--rdzv-backend c10d``) running the same step under
  ``DistributedDataParallel``; ``torchrun --standalone --nproc-per-node 2`` for one machine;
- restart: worker 1 SIGKILLs itself after its first step; seconds from the kill to worker 0's
  first step of the restarted group, for the local launcher, the two-host launcher and torchrun
  on two hosts (``--max-restarts 3`` on the nodes: torchrun's agents each count the failure, so
  with 1 the surviving node's agent sometimes gives up; 1 on one machine).

Numbers are medians over rounds with the range; the parent waits for a quiet machine before
each measurement. Slurm's and Ray's start-up are measured by ``benchmarks/startup_slurm.py`` and
``benchmarks/startup_ray.py`` where those are installed.

Commands::

    python benchmarks/multi_node.py              # 5 rounds (as root)
    python benchmarks/multi_node.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Processes, Quiet, Rounds, child_env, format_table, git_commit, spread  # noqa: E402

from stratagem.launch.ports import free_ports  # noqa: E402
from stratagem.testing.hosts import HostsUnavailable, network_hosts  # noqa: E402

_OURS = """
import os, signal, time
import stratagem as sg
import torch
strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=20))
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

def step():
    optimizer.zero_grad()
    sg.nn.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none")).backward()
    optimizer.step()

restart, rank = int(os.environ["STRATAGEM_RESTART"]), strategy.cluster_resolver.worker_rank
for count in range(3):
    strategy.run(step)
    if count == 0 and rank == 0:
        print(f"FIRST_STEP {restart} {time.time():.6f}", flush=True)
    if count == 0 and rank == 1 and restart == 0 and os.environ.get("BENCH_KILL"):
        print(f"KILLED {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""

_THEIRS = """
import os, signal, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
for count in range(3):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if count == 0 and rank == 0:
        print(f"FIRST_STEP {restart} {time.time():.6f}", flush=True)
    if count == 0 and rank == 1 and restart == 0 and os.environ.get("BENCH_KILL"):
        print(f"KILLED {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""


def _nodes_commands(kind: str, hosts, script: str, restarts: int) -> list[list[str]]:
    """One command per host, run there with `ip netns exec`."""
    port, python = free_ports(1)[0], sys.executable
    rdzv = f"{hosts[0][1]}:{port}"
    commands = []
    for rank, (namespace, _) in enumerate(hosts):
        if kind == "ours":
            node = [python, "-m", "stratagem", "launch", "--nnodes", str(len(hosts)), "--node-rank", str(rank),
                    "--rdzv", rdzv, "--workers", "1", "--max-restarts", str(restarts), script]
        else:
            # torchrun's gloo finds its address from the host name (loopback here): name the interface
            node = ["env", "GLOO_SOCKET_IFNAME=sgeth", python, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "bench",
                    "--rdzv-conf", f"is_host={int(rank == 0)}", "--max-restarts", str(restarts),
                    "--local-addr", hosts[rank][1], script]
        commands.append(["ip", "netns", "exec", namespace, *node])
    return commands


def _measure(commands: list[list[str]], env: dict[str, str], *, timeout: float = 180.0) -> dict:
    """Seconds to worker 0's first step, and from a kill to the restarted group's first step."""
    with Processes() as procs:
        start = time.time()
        names = [f"node {i}" for i in range(len(commands))]
        for name, command in zip(names, commands):
            procs.start(name, command, env, graceful=True)
        procs.wait(names, timeout)
        lines = [line for name in names for line in procs.output(name).splitlines()]
    first = {int(line.split()[-2]): float(line.split()[-1]) for line in lines if "FIRST_STEP " in line}
    killed = [float(line.split()[-1]) for line in lines if "KILLED " in line]
    later = [first[restart] for restart in sorted(first) if restart > 0]   # (torchrun may count 2 restarts)
    if 0 not in first or (killed and not later):
        raise RuntimeError(f"no first step seen (of the first start, or after the kill): {sorted(first)}")
    result = {"first_step_s": first[0] - start}
    if killed:
        result["restart_s"] = later[0] - killed[0]
    return result


def _configurations(folder: str, hosts) -> dict[str, tuple[list[list[str]], dict[str, str]]]:
    ours, theirs = os.path.join(folder, "ours.py"), os.path.join(folder, "theirs.py")
    for path, text in ((ours, _OURS), (theirs, _THEIRS)):
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
    python = sys.executable
    env = child_env(OMP_NUM_THREADS="1", STRATAGEM_CLUSTER_TOKEN=secrets.token_urlsafe(32))
    kill = {**env, "BENCH_KILL": "1"}
    local = [[python, "-m", "stratagem", "launch", "--workers", "2", "--max-restarts", "1", ours]]
    return {
        "start: torchrun --standalone (1 machine)": ([[python, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node", "2", theirs]], env),
        "start: stratagem launch (1 machine)": (local, env),
        "start: torchrun, 2 hosts": (_nodes_commands("theirs", hosts, theirs, 0), env),
        "start: stratagem launch --nnodes 2": (_nodes_commands("ours", hosts, ours, 0), env),
        "restart: stratagem launch (1 machine)": (local, kill),
        "restart: torchrun, 2 hosts": (_nodes_commands("theirs", hosts, theirs, 3), kill),
        "restart: stratagem launch --nnodes 2": (_nodes_commands("ours", hosts, ours, 3), kill),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds to wait for a quiet machine, in all (default 120)")
    args = parser.parse_args(argv)
    try:
        with network_hosts(2) as hosts, tempfile.TemporaryDirectory() as folder:
            configurations = _configurations(folder, hosts)
            rounds = Rounds(list(configurations), args.rounds, Quiet(args.max_wait, limit=0.2))
            rounds.run(lambda name, _: _measure(*configurations[name]))
    except HostsUnavailable as reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    for name in configurations:
        key = "restart_s" if name.startswith("restart") else "first_step_s"
        values = [r[key] for r in rounds.results[name] if key in r]
        rows.append([name, f"{statistics.median(values):.2f}" if values else "", spread(values)])
    print(f"many machines, median of {args.rounds} rounds (commit {git_commit()}); start: command to worker 0's "
          "first step; restart: a worker's kill to the restarted group's first step")
    print(format_table(["what", "seconds", "range"], rows))
    return rounds.finish()


if __name__ == "__main__":
    sys.exit(main())
