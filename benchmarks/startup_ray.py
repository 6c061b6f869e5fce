"""Start-up on Ray: seconds from ``stratagem launch --ray`` to the first step, against the local launcher.

The script is ``startup.py``'s: a ``MultiWorkerMirroredStrategy`` model and one training step,
run by two workers. Each round runs, in fresh processes and a rotated order,

- ``stratagem launch --workers 2 SCRIPT`` (the local launcher, on loopback);
- ``stratagem launch --ray ADDRESS --workers 2 SCRIPT``: the tasks as Ray actors on a
  one-machine Ray cluster on 127.0.0.1 that this benchmark starts once (its own session and
  temporary folder; stopped at the end, only its own processes);

and times the command to the first step (the later of the two workers' ``FIRST_STEP``) and to
its exit. The table gives medians over rounds with their ranges, and Ray's time over the
local launcher's, paired per round. Starting the Ray cluster itself (``ray start --head``) is
timed once and printed apart: a Ray cluster is normally running before a job comes.

Commands::

    python benchmarks/startup_ray.py              # 5 rounds
    python benchmarks/startup_ray.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Processes, Quiet, Rounds, child_env, format_table, git_commit, log, spread  # noqa: E402
from startup import _STRATAGEM_SCRIPT  # noqa: E402  (the same script as the start-up benchmark)

_ONE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # keeps Ray on 127.0.0.1


def _session(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


class RayHead:
    """A one-machine Ray cluster on loopback, in a session of its own; ``stop()`` ends that session."""

    def __init__(self, cpus: int = 4) -> None:
        from stratagem.launch.ports import free_ports
        port, client_port = free_ports(2)
        self.temp = tempfile.mkdtemp(prefix="sg-ray-", dir="/tmp")
        self.address = f"127.0.0.1:{port}"
        started = time.monotonic()
        head = subprocess.Popen(
            [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head",
             "--node-ip-address=127.0.0.1", f"--port={port}", f"--ray-client-server-port={client_port}",
             f"--num-cpus={cpus}", "--object-store-memory=200000000", "--disable-usage-stats",
             "--include-dashboard=false", f"--temp-dir={self.temp}"],
            env=child_env(**_ONE_MACHINE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.sid = head.pid
        output, _ = head.communicate(timeout=120)
        if head.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed:\n{output}")
        self.start_s = time.monotonic() - started

    def stop(self) -> None:
        for signum, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in _session(self.sid):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while _session(self.sid) and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.temp, ignore_errors=True)


def _timed(command: list[str], env: dict[str, str], timeout: float = 180.0) -> dict:
    """Seconds to the command's exit and to its last ``FIRST_STEP`` line."""
    with Processes() as procs:
        start = time.time()
        procs.start("command", command, env, graceful=True)
        procs.wait(["command"], timeout)
        result = {"exit_s": time.time() - start}
        firsts = [float(line.rpartition("FIRST_STEP ")[2]) - start
                  for line in procs.output("command").splitlines() if "FIRST_STEP " in line]
    if not firsts:
        raise RuntimeError(f"{command}: no FIRST_STEP line")
    result["first_step_s"] = max(firsts)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds to wait for a quiet machine, in all (default 120)")
    args = parser.parse_args(argv)
    head = RayHead()
    log(f"ray start --head: {head.start_s:.1f} s ({head.address})")
    try:
        with tempfile.TemporaryDirectory() as folder:
            script = os.path.join(folder, "ours.py")
            with open(script, "w") as f:
                f.write(textwrap.dedent(_STRATAGEM_SCRIPT))
            python = sys.executable
            configurations = {
                "stratagem launch --workers 2": (
                    [python, "-m", "stratagem", "launch", "--workers", "2", script],
                    child_env(OMP_NUM_THREADS="1")),
                "stratagem launch --ray ADDRESS --workers 2": (
                    [python, "-m", "stratagem", "launch", "--ray", head.address, "--workers", "2", script],
                    child_env(OMP_NUM_THREADS="1", **_ONE_MACHINE)),
            }
            rounds = Rounds(list(configurations), args.rounds, Quiet(args.max_wait, limit=0.2))
            rounds.run(lambda name, _: _timed(*configurations[name]))
    finally:
        head.stop()
    local, ray = list(configurations)
    rows = []
    for name in configurations:
        firsts = [r["first_step_s"] for r in rounds.results[name]]
        exits = [r["exit_s"] for r in rounds.results[name]]
        ratio = rounds.ratio(name, local, "first_step_s")
        rows.append([name, f"{statistics.median(firsts):.2f}" if firsts else "", spread(firsts),
                     f"{statistics.median(exits):.2f}" if exits else "", spread(exits),
                     f"{statistics.median(ratio):.2f}" if ratio else "", spread(ratio)])
    print(f"start-up on Ray, median of {args.rounds} rounds (commit {git_commit()}); "
          f"ray start --head took {head.start_s:.1f} s once, not counted")
    print(format_table(["command", "first step (s)", "range", "exit (s)", "range", "x local", "range"], rows))
    return rounds.finish()


if __name__ == "__main__":
    sys.exit(main())
