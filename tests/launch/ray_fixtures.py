"""What the Ray launcher's tests share: Ray nodes started and stopped exactly, /proc, the oracle.

A Ray node is started with ``ray start`` in a session of its own (``start_new_session``), and
every Ray process of that node (its raylet, its workers, the actors) stays in that session, so
:func:`stop_session` ends exactly the node's processes: never another Ray on the machine,
which ``ray stop`` (it matches process names) would.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ray_script.py")
ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (Ray's workers import it too),
    without Ray's one-machine switch unless ``extra`` sets it."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {key: value for key, value in os.environ.items() if key != ONE_MACHINE}
    return {**env, "PYTHONPATH": path, **extra}


def start_node(args: Sequence[str], env: dict[str, str], prefix: Sequence[str] = ()) -> int:
    """Runs ``ray start ARGS`` (behind ``prefix``, e.g. ``ip netns exec NS``); returns the node's session."""
    node = subprocess.Popen([*prefix, sys.executable, "-c", "from ray.scripts.scripts import main; main()",
                             "start", "--disable-usage-stats", "--object-store-memory=200000000", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = node.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_session(node.pid)
        raise
    if node.returncode != 0:
        stop_session(node.pid)
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{output}")
    return node.pid


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def assert_gone(pids: Sequence[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if not gone(pid)]
    for pid in alive:   # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes {alive} outlived their job"


def session(sid: int) -> list[int]:
    """The live processes of session ``sid``."""
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


def stop_session(*sids: int) -> None:
    """SIGTERM to every process of the sessions ``sids``, up to 3 s, then SIGKILL to what is left."""
    for signum, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for pid in [pid for sid in sids for pid in session(sid)]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while any(session(sid) for sid in sids) and time.monotonic() < deadline:
            time.sleep(0.1)


def listeners(pids: Sequence[int], prefix: Sequence[str] = ()) -> list[str]:
    """``address:port [pids]`` of every TCP socket one of ``pids`` listens on (``ss``, behind ``prefix``)."""
    lines = subprocess.run([*prefix, "ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    wanted, found = set(pids), []
    for line in lines.splitlines():
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)} & wanted
        if owners:
            found.append(f"{line.split()[3]} {sorted(owners)}")
    return found


def _load_script():
    spec = importlib.util.spec_from_file_location("ray_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_as_plain_pytorch(out: Path) -> None:
    """``ray_script.py``'s final parameters in ``out`` equal plain PyTorch's from its initial ones."""
    script = _load_script()
    model = script.make_model()
    model.load_state_dict(torch.load(out / "initial.pt", weights_only=True))
    optimizer = script.make_optimizer(model.parameters())
    for _ in range(script.EPOCHS):
        for x, y in torch.utils.data.DataLoader(script.samples(), batch_size=script.GLOBAL_BATCH):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    final = torch.load(out / "final.pt", weights_only=True)
    assert final.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert final[name].dtype == torch.float64
        torch.testing.assert_close(final[name], value, msg=lambda m: f"{name}: {m}")
