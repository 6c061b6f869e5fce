"""Start-up under Slurm: ``srun --ntasks 2`` of a MultiWorkerMirroredStrategy step, beside
``stratagem launch --workers 2`` and ``torchrun --standalone --nproc-per-node 2`` (DDP) on the same
one-node Slurm cluster's machine.

A real Slurm (Debian's ``slurm-wlm`` and ``munge``; root) is started for the run in a
loopback-only network namespace, as the tests do (``tests/cluster/slurm_harness.py``), and
stopped at the end; its own start-up (until ``sinfo`` shows the node idle) is printed apart,
since a cluster is normally already running. Each round times, in a rotated order, the seconds
from the command to worker 0's first training step. Medians over rounds, with the range.

Commands::

    python benchmarks/startup_slurm.py              # 5 rounds (as root)
    python benchmarks/startup_slurm.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))   # the repository: the tests' Slurm harness
from _harness import Rounds, child_env, format_table, git_commit, spread  # noqa: E402
from multi_node import _OURS, _THEIRS  # noqa: E402
from tests.cluster.slurm_harness import SlurmCluster, missing_requirements  # noqa: E402


def _first_step(command: list[str], env: dict[str, str], cwd: str, timeout: float = 240.0) -> dict:
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"exit status {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    first = [float(line.split()[-1]) for line in result.stdout.splitlines() if "FIRST_STEP " in line]
    if not first:
        raise RuntimeError(f"no first step reported:\n{result.stdout[-3000:]}")
    return {"first_step_s": first[0] - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        ours, theirs = os.path.join(folder, "ours.py"), os.path.join(folder, "theirs.py")
        for path, text in ((ours, _OURS.replace('os.environ["STRATAGEM_RESTART"]',
                                                'os.environ.get("STRATAGEM_RESTART", "0")')),
                           (theirs, _THEIRS)):
            Path(path).write_text(textwrap.dedent(text))
        cluster = SlurmCluster(Path(folder))
        try:
            problem = cluster.make_namespace()
            if problem:
                print(f"cannot run: {problem}", file=sys.stderr)
                return 2
            ready = cluster.start()
            env = cluster.env(**{k: v for k, v in child_env(OMP_NUM_THREADS="1").items()
                                 if k in ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")})
            python = sys.executable
            commands = {
                "torchrun --standalone --nproc-per-node 2 (DDP)":
                    cluster.inside(python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", theirs),
                "stratagem launch --workers 2": cluster.inside(python, "-m", "stratagem", "launch", "--workers", "2", ours),
                "srun --ntasks 2 (Slurm)": cluster.inside("srun", "--ntasks=2", python, ours),
            }
            rounds = Rounds(list(commands), args.rounds)
            rounds.run(lambda name, _: _first_step(commands[name], env, folder))
        finally:
            cluster.stop()
    rows = []
    for name in commands:
        values = [r["first_step_s"] for r in rounds.results[name]]
        rows.append([name, f"{statistics.median(values):.2f}" if values else "", spread(values)])
    print(f"start-up under Slurm, median of {args.rounds} rounds (commit {git_commit()}); the Slurm cluster "
          f"itself was ready in {ready:.1f} s")
    print(format_table(["command (in the Slurm node's namespace)", "first step (s)", "range"], rows))
    return rounds.finish()


if __name__ == "__main__":
    sys.exit(main())
