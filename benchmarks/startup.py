"""Start-up: how long from the command to training, stratagem against plain PyTorch's tools.

Each round runs, in fresh processes and in a rotated order:

- ``import``: ``python -c "import stratagem"`` against ``python -c "import torch"``;
- ``demo``: the whole ``stratagem demo`` (two trainings of 460 steps and the check);
- ``launch``: ``stratagem launch --workers 2`` of a script that builds a
  ``MultiWorkerMirroredStrategy`` model and runs one training step, against ``torchrun
  --standalone --nproc-per-node 2`` of the same step under ``DistributedDataParallel``; the time is from
  the command to the moment worker 0 finished its first step (and to the launcher's exit).

Numbers are medians over rounds, with the range; the parent waits for a quiet machine
before each measurement (start-up is mostly single-core work, so other load shows at once).

Commands::

    python benchmarks/startup.py              # 5 rounds
    python benchmarks/startup.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Processes, Quiet, Rounds, child_env, format_table, git_commit, log, spread  # noqa: E402

_STRATAGEM_SCRIPT = """
import time
import stratagem as sg
import torch
strategy = sg.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

def step():
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y) / strategy.num_replicas_in_sync
    loss.backward()
    optimizer.step()

strategy.run(step)
print(f"FIRST_STEP {time.time():.6f}", flush=True)
"""

_TORCHRUN_SCRIPT = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
optimizer.zero_grad()
torch.nn.functional.cross_entropy(model(x), y).backward()
optimizer.step()
if dist.get_rank() == 0:
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
dist.destroy_process_group()
"""


def _timed(command: list[str], *, timeout: float = 120.0) -> dict:
    """Seconds to the command's exit and to its first ``FIRST_STEP`` line (if it prints one)."""
    with Processes() as procs:
        start = time.time()
        procs.start("command", command, child_env(OMP_NUM_THREADS="1"), graceful=True)
        try:
            procs.wait(["command"], timeout)
            failure = None
        except RuntimeError as error:   # a non-zero exit
            failure = error
        result = {"exit_s": time.time() - start}
        for line in procs.output("command").splitlines():
            if "FIRST_STEP " in line:
                result["first_step_s"] = float(line.rpartition("FIRST_STEP ")[2]) - start
    if failure is not None:
        if "first_step_s" not in result:
            raise failure
        # a process that failed after its first step (seen: torchrun's rank 0 with SIGABRT at
        # exit, 2 rounds of 5 once): the start-up was measured, the failed exit is reported
        result["bad_exit"] = 1
        log(f"  {command[2] if len(command) > 2 else command[0]}: exited with an error after its first step")
    return result


def _configurations(folder: str) -> dict[str, list[str]]:
    ours, theirs = os.path.join(folder, "ours.py"), os.path.join(folder, "theirs.py")
    with open(ours, "w") as f:
        f.write(textwrap.dedent(_STRATAGEM_SCRIPT))
    with open(theirs, "w") as f:
        f.write(textwrap.dedent(_TORCHRUN_SCRIPT))
    python = sys.executable
    return {
        "python -c 'import torch'": [python, "-c", "import torch"],
        "python -c 'import stratagem'": [python, "-c", "import stratagem"],
        "... and sg.MultiWorkerMirroredStrategy": [python, "-c", "import stratagem as sg; sg.MultiWorkerMirroredStrategy"],
        "stratagem demo": [python, "-m", "stratagem", "demo", "--quiet"],
        "torchrun --nproc-per-node 2 (DDP)": [python, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc-per-node", "2", theirs],
        "stratagem launch --workers 2": [python, "-m", "stratagem", "launch", "--workers", "2", ours],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds to wait for a quiet machine, in all (default 120)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        configurations = _configurations(folder)
        rounds = Rounds(list(configurations), args.rounds, Quiet(args.max_wait, limit=0.2))
        rounds.run(lambda name, _: _timed(configurations[name]))
    rows, bad_exits = [], []
    for name in configurations:
        bad = sum(r.get("bad_exit", 0) for r in rounds.results[name])
        if bad:
            bad_exits.append(f"{name}: {bad} of {len(rounds.results[name])} rounds exited with an error "
                             "after its first step")
        exits = [r["exit_s"] for r in rounds.results[name]]
        firsts = [r["first_step_s"] for r in rounds.results[name] if "first_step_s" in r]
        rows.append([name, f"{statistics.median(firsts):.2f}" if firsts else "", spread(firsts),
                     f"{statistics.median(exits):.2f}" if exits else "", spread(exits)])
    print(f"start-up, median of {args.rounds} rounds (commit {git_commit()})")
    print(format_table(["command", "first step (s)", "range", "exit (s)", "range"], rows))
    for note in bad_exits:
        print(f"NOTE: {note}")
    return rounds.finish()


if __name__ == "__main__":
    sys.exit(main())
