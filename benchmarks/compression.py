"""Gradient compression on slow links: step time and loss, ours beside DistributedDataParallel's hooks.

Two workers, each in a network namespace of its own (:mod:`stratagem.testing.hosts`: addresses
10.214.0.x on a bridge that only those namespaces see; root needed), train the same MLP with
the same data. The link is shaped on both veth ends with a token bucket (``tc qdisc replace dev
sgeth root tbf rate R``), so each direction carries at most R. For each link the benchmark times
steps of:

- ours: ``MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(compression=C))``
  with C = None (exact), "bf16", "fp16", "powersgd" (rank ``--rank``);
- theirs: ``DistributedDataParallel`` with no hook (exact), ``bf16_compress_hook`` (under
  another name: DDP refuses it by name without CUDA, though gloo sums bfloat16),
  ``fp16_compress_hook``, ``powerSGD_hook`` (``PowerSGDState(matrix_approximation_rank=rank,
  start_powerSGD_iter=S)``, S = ``--powersgd-start``, default 2, the least DDP accepts: both sides
  sum the first S steps exactly, ours with ``powersgd_start_step=S``; warm start and error
  feedback on, as ours; in one bucket: on gloo, the chained all-reduces of several buckets
  interleave in a different order on each rank, and the workers abort on a size mismatch);

and then, on the unshaped veth link (the loss does not depend on the link), trains each for
``--loss-steps`` steps and reports the mean loss of the last 10 against the exact sum's. One
intra-op thread per worker (two processes on a shared machine). Step times are medians over the
timed steps of each run; with ``--rounds`` > 1 the configurations run again in a rotated order
and the median of the runs' medians is printed with its spread. The machine's load average is
printed with the table: on a shared machine compute slows down, the link does not.

Commands (as root)::

    python benchmarks/compression.py                       # 1 Gbit/s and 100 Mbit/s, 300 loss steps
    python benchmarks/compression.py --quick               # smoke test: 100mbit, 3 timed steps, 20 loss steps
    python benchmarks/compression.py --links 1gbit --rounds 3 --rank 4
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Processes, child_env, format_table, git_commit, loadavg, spread  # noqa: E402

from stratagem.launch.ports import free_ports  # noqa: E402
from stratagem.testing.hosts import HostsUnavailable, network_hosts  # noqa: E402

LAYERS = (256, 1024, 1024, 10)   # 1.33 M parameters, 5.3 MB of float32 gradients per step
GLOBAL_BATCH = 256
COMPRESSIONS = ("exact", "bf16", "fp16", "powersgd")
BURST = {"1gbit": "1mb", "100mbit": "128kb"}


# ------------------------------------------------------------------------ one worker

def _data(step: int, rank: int):
    """A global batch labelled by a fixed random teacher (learnable); this worker's half of it."""
    import torch

    teacher = torch.randn(LAYERS[0], LAYERS[-1], generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, LAYERS[0], generator=g)
    y = (x @ teacher).argmax(dim=1)
    return x[rank::2], y[rank::2]


def _model():
    import torch

    torch.manual_seed(0)
    layers: list = []
    for i, (n_in, n_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        layers += [torch.nn.Linear(n_in, n_out)] + ([torch.nn.ReLU()] if i < len(LAYERS) - 2 else [])
    return torch.nn.Sequential(*layers)


def worker(args: argparse.Namespace) -> None:
    """One worker of one run: prints a JSON line with its step times and its part of each loss."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rank, compression = args.rank_of, None if args.compression == "exact" else args.compression
    if args.kind == "ours":
        import stratagem as sg

        powersgd = compression == "powersgd"
        options = sg.CommunicationOptions(compression=compression, powersgd_rank=args.rank if powersgd else None,
                                          powersgd_start_step=args.powersgd_start if powersgd else None)
        strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
        with strategy.scope():
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def train(x, y):
            def step():
                optimizer.zero_grad()
                loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                                  global_batch_size=GLOBAL_BATCH)
                loss.backward()
                optimizer.step()
                return loss.detach()
            return strategy.run(step).item()
    else:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        dist.init_process_group("gloo", init_method=f"tcp://{args.chief}", rank=rank, world_size=2)
        # DDP's PowerSGD hook chains its all-reduces in future callbacks; on gloo the buckets' chains
        # interleave in a different order on each rank (a collective mismatch): one bucket for it
        model = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=64 if compression == "powersgd"
                                                          else None)
        if compression == "bf16":
            # DDP refuses to register torch's bf16 hook, by name, without CUDA and NCCL; the hook
            # itself runs on gloo (which sums bfloat16): the same function under another name
            def bf16_on_gloo(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)
            model.register_comm_hook(None, bf16_on_gloo)
        elif compression == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                                start_powerSGD_iter=args.powersgd_start)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def train(x, y):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)   # DDP averages: the global batch's mean
            loss.backward()
            optimizer.step()
            return loss.item() / 2   # this worker's part of the global mean
    times, losses = [], []
    for step in range(args.steps):
        x, y = _data(step, rank)
        start = time.perf_counter()
        losses.append(train(x, y))
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "losses": losses}), flush=True)
    if args.kind == "theirs":
        # a DDP script's ending: the model (its reducer holds the group, and with it gloo's threads)
        # dropped, then the group destroyed; otherwise a gloo thread may still hold a collective's
        # tensors while the interpreter finalizes, and the process aborts after a good run
        # ("terminate called without an active exception": once in 12 runs here, on a busy machine)
        import gc

        import torch.distributed as dist
        del train, model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------ the parent

def _shape(hosts, link: str | None) -> None:
    for namespace, _ in hosts:
        command = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
        if link is None:
            subprocess.run(command + ["del", "dev", "sgeth", "root"], capture_output=True)
            continue
        subprocess.run(command + ["replace", "dev", "sgeth", "root", "tbf", "rate", link,
                                  "burst", BURST.get(link, "256kb"), "latency", "100ms"], check=True)


def _run(hosts, kind: str, compression: str, steps: int, args: argparse.Namespace, timeout: float) -> dict:
    """Both workers of one run; their step times (the slower worker's, per step) and global losses."""
    port = free_ports(1)[0]
    addresses = [f"{address}:{port}" for _, address in hosts]
    env = child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="sgeth",
                    STRATAGEM_CLUSTER_TOKEN=secrets.token_urlsafe(32))
    with Processes() as procs:
        for r, (namespace, _) in enumerate(hosts):
            task = {**env, "TF_CONFIG": json.dumps({"cluster": {"worker": addresses},
                                                     "task": {"type": "worker", "index": r}})}
            procs.start(f"worker {r}", ["ip", "netns", "exec", namespace, sys.executable, os.path.abspath(__file__),
                                        "--worker", kind, "--compression", compression, "--rank-of", str(r),
                                        "--chief", addresses[0], "--steps", str(steps), "--rank", str(args.rank),
                                        "--powersgd-start", str(args.powersgd_start)], task)
        names = ["worker 0", "worker 1"]
        procs.wait(names, timeout)
        results = [json.loads([ln for ln in procs.output(n).splitlines() if ln.startswith("{")][-1]) for n in names]
    return {"times": [max(a, b) for a, b in zip(results[0]["times"], results[1]["times"])],
            "losses": [a + b for a, b in zip(results[0]["losses"], results[1]["losses"])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"], help="tc rates (default 1gbit 100mbit)")
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=COMPRESSIONS)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's rank (default 2)")
    parser.add_argument("--powersgd-start", type=int, default=2,
                        help="steps summed exactly before PowerSGD starts, on both sides (default 2; DDP needs >= 2)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--loss-steps", type=int, default=300, help="steps of the loss comparison (default 300)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke test: 100mbit, 3 timed steps, 20 loss steps")
    parser.add_argument("--worker", choices=["ours", "theirs"], dest="kind", help=argparse.SUPPRESS)
    parser.add_argument("--compression", help=argparse.SUPPRESS)
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chief", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.powersgd_start < 2:
        parser.error(f"--powersgd-start must be >= 2 (DDP's PowerSGDState refuses less with error feedback), "
                     f"got {args.powersgd_start}")
    if args.kind:
        worker(args)
        return 0
    if args.quick:
        args.links, args.warmup, args.steps, args.loss_steps = ["100mbit"], 1, 3, 20
    configurations = [(kind, c) for c in args.compressions for kind in ("ours", "theirs")]
    times: dict = {}
    losses: dict = {}
    loads = []
    try:
        with network_hosts(2) as hosts:
            for link in args.links:
                _shape(hosts, link)
                for round_ in range(args.rounds):
                    shift = round_ % len(configurations)
                    for kind, c in configurations[shift:] + configurations[:shift]:
                        run = _run(hosts, kind, c, args.warmup + args.steps, args, timeout=600)
                        times.setdefault((link, kind, c), []).append(statistics.median(run["times"][args.warmup:]))
                        loads.append(loadavg())
            _shape(hosts, None)
            for kind, c in configurations:
                run = _run(hosts, kind, c, args.loss_steps, args, timeout=900)
                losses[(kind, c)] = (run["losses"][0], statistics.mean(run["losses"][-10:]))
    except HostsUnavailable as reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    for link in args.links:
        for c in args.compressions:
            ours, theirs = (statistics.median(times[(link, k, c)]) for k in ("ours", "theirs"))
            exact = statistics.median(times[(link, "ours", "exact")]) if "exact" in args.compressions else None
            rows.append([link, c, f"{ours * 1e3:.1f}", spread([t * 1e3 for t in times[(link, "ours", c)]], 1),
                         f"{theirs * 1e3:.1f}", f"{ours / theirs:.2f}", f"{exact / ours:.2f}" if exact else ""])
    print(f"compression, 2 workers in network namespaces, MLP {'-'.join(map(str, LAYERS))} "
          f"(commit {git_commit()}; load average {min(loads):.1f}-{max(loads):.1f} during the timed runs)")
    print(format_table(["link", "compression", "ours ms/step", "range", "DDP ms/step", "ours/DDP",
                        "speed-up vs exact"], rows))
    print(f"\nloss after {args.loss_steps} steps (mean of the last 10; first step's in brackets), unshaped veth link")
    print(format_table(["compression", "ours", "DDP"],
                       [[c] + [f"{losses[(k, c)][1]:.4f} ({losses[(k, c)][0]:.3f})" for k in ("ours", "theirs")]
                        for c in args.compressions]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
