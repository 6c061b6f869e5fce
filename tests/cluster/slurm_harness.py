"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd from Debian's packages.

Everything runs in a network namespace of its own that has only a loopback interface (with a
second loopback address, 127.0.0.2, because Slurm resolves addresses with AI_ADDRCONFIG, which
finds no IPv4 address where 127.0.0.1 is the only one): Slurm's daemons listen on every
interface there is (Slurm has no setting to bind one address), and in that namespace every
interface is loopback. The ports are Slurm's defaults (6817, 6818) and the training tasks'
8888: nothing else listens in a fresh namespace, so no port is borrowed from the machine.

``MinJobAge=4``: ``sbatch --wait`` asks for its job's state after 2 s, and waits four times longer
each time while its wait is under half of MinJobAge (32 s at most): with Slurm's default (300)
a job of 12 s was seen finished after 42 s, with 4 after 16 s (every 2 s). A finished job's record
is kept at least MinJobAge, twice that wait (slurmctld raises 0, "for ever", to 2).

:meth:`SlurmCluster.start` writes a munge key, slurm.conf and cgroup.conf into a temporary
directory, starts the three daemons in the foreground (their pids are ours) and waits until
``sinfo`` shows the node idle; :meth:`SlurmCluster.stop` kills every process in the namespace
(daemons, slurmstepd, tasks) by pid and deletes the namespace, whatever state it is in.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scancel", "ip", "ss")
NODE = "localhost"
CPUS = 8   # more than this machine has: slurmd takes the configured count (config_overrides)


def missing_requirements() -> str | None:
    """Why the real-Slurm tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "the real-Slurm tests start slurmctld, slurmd and munged as root; run them as root"
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return (f"{', '.join(missing)} not found: install Debian's slurm-wlm and munge (and "
                "iproute2) packages (`apt-get install slurm-wlm munge`; .ci/run does it)")
    return None


def _cgroup_config() -> str:
    """slurmd 22.05 always starts a cgroup plugin (nothing here is constrained by it)."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():   # cgroup v2 only
        return "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n"
    return "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


class SlurmCluster:
    """One node (``localhost``), one partition, root as the Slurm user; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.namespace = f"stratagem-slurm-{os.getpid()}-{secrets.token_hex(3)}"
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._namespace_made = False

    # ------------------------------------------------------------------ start

    def _write_config(self) -> None:
        for name in ("state", "spool", "munge", "log"):
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=stratagem
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=4
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "cgroup.conf").write_text(_cgroup_config())

    def _ip(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)

    def make_namespace(self) -> str | None:
        """Creates the namespace; returns why it could not be, or None."""
        made = self._ip("netns", "add", self.namespace)
        if made.returncode != 0:
            return f"cannot create a network namespace (ip netns add): {made.stderr.strip()}"
        self._namespace_made = True
        for command in (["link", "set", "lo", "up"], ["addr", "add", "127.0.0.2/8", "dev", "lo"]):
            step = self._ip("-n", self.namespace, *command)
            if step.returncode != 0:
                return f"cannot set up the namespace (ip {' '.join(command)}): {step.stderr.strip()}"
        return None

    def inside(self, *command: str) -> list[str]:
        """``command`` run in the cluster's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm's commands: this cluster's slurm.conf, no stale cluster."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "STRATAGEM_", "TF_CONFIG"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                             "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def _daemon(self, name: str, *command: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self.daemons[name] = subprocess.Popen(self.inside(*command), stdout=log, stderr=subprocess.STDOUT,
                                              env=self.env(), cwd=self.root)
        log.close()

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").strip().splitlines()
            parts.append(f"--- {path.name} (last lines)\n" + "\n".join(text[-15:]))
        return "\n".join(parts)

    def start(self, timeout: float = 180.0) -> float:
        """Starts the daemons; returns the seconds until the node was idle (raises if never)."""
        started = time.monotonic()
        self._write_config()
        m = self.root / "munge"
        self._daemon("munged", "munged", "--foreground", "--force", f"--key-file={m}/munge.key",
                     f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                     f"--log-file={self.root}/log/munged.log", f"--seed-file={m}/munged.seed")
        self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged's socket")
        self._daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        self._daemon("slurmd", "slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self._wait(lambda: self.node_state() == "idle", timeout - (time.monotonic() - started),
                   "sinfo to show the node idle")
        return time.monotonic() - started

    def node_state(self) -> str:
        result = subprocess.run(self.inside("sinfo", "-h", "-n", NODE, "-o", "%t"), capture_output=True,
                                text=True, env=self.env(), timeout=60)
        return result.stdout.strip()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = {name: p.returncode for name, p in self.daemons.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"while waiting for {what}, {dead} exited (name: exit status):\n"
                                   + self.logs())
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout:.0f} s:\n" + self.logs())
            time.sleep(0.2)

    # ------------------------------------------------------------------ use

    def srun(self, args: list[str], *, timeout: float, **env: str) -> subprocess.CompletedProcess:
        """``srun ARGS`` in the namespace; on a timeout, the job is cancelled and TimeoutExpired raised."""
        command = self.inside("srun", *args)
        try:
            return subprocess.run(command, capture_output=True, text=True, env=self.env(**env),
                                  timeout=timeout, cwd=self.root)
        except subprocess.TimeoutExpired:
            subprocess.run(self.inside("scancel", "--full", "--signal=KILL", "--user=root"),
                           env=self.env(), capture_output=True, timeout=30)
            raise

    def listening(self) -> str:
        """``ss -ltnp`` in the namespace."""
        return subprocess.run(self.inside("ss", "-ltnp"), capture_output=True, text=True,
                              timeout=30).stdout

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Kills every process of the namespace and deletes it; safe to call in any state."""
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.daemons.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=15)
        if self._namespace_made:
            for _ in range(3):   # slurmstepd and tasks that outlived slurmd, by pid
                pids = self._ip("netns", "pids", self.namespace).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.2)
            self._ip("netns", "del", self.namespace)
            self._namespace_made = False
