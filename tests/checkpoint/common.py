"""Shared pieces of the checkpoint tests: a small model, its training step, state comparisons, a
process killed at a line it prints."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.testing import start_task


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, hidden)
        self.fc2 = nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def batches(n: int, size: int = 6, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 5, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def make_strategy(kind: str) -> sg.Strategy:
    if kind == "one_device":
        return sg.OneDeviceStrategy("cpu")
    if kind.startswith("central"):
        return sg.CentralStorageStrategy([f"cpu:{i}" for i in range(int(kind.removeprefix("central")))])
    replicas = int(kind.removeprefix("mirrored"))
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


def build(strategy: sg.Strategy | None, seed: int = 0, hidden: int = 8):
    """A model, Adam and a step LR schedule, in ``strategy``'s scope (plain PyTorch for None)."""
    torch.manual_seed(seed)
    if strategy is None:
        model = Net(hidden)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        with strategy.scope():
            model = Net(hidden)
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(strategy: sg.Strategy | None, model, optimizer, scheduler, data) -> None:
    """One optimizer and scheduler step per batch, with the global mean loss."""
    for x, y in data:
        if strategy is None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        else:
            def step(batch):
                bx, by = batch
                loss = sg.nn.compute_average_loss(F.cross_entropy(model(bx), by, reduction="none"))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            dist = strategy.experimental_distribute_dataset([(x, y)])
            for batch in dist:
                strategy.run(step, args=(batch,))
        scheduler.step()


def assert_same_state(model_a, opt_a, model_b, opt_b, rtol: float = 0.0, atol: float = 0.0) -> None:
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index in sa["state"]:
        for key, value in sa["state"][index].items():
            torch.testing.assert_close(value, sb["state"][index][key], rtol=rtol, atol=atol,
                                       msg=lambda m: f"optimizer state {index}/{key}: {m}")


def killed_at_line(command: list[str], wanted: str, timeout: float = 90.0) -> list[str]:
    """Starts ``command`` (``python SCRIPT ...``, forked from the test fork server), waits until it
    prints a line that starts with ``wanted``, then SIGKILLs its process group; returns the lines it
    printed, that one last. Fails if it exits or ``timeout`` passes first (killing it)."""
    handle, log = tempfile.mkstemp(prefix="killed-at-line-", suffix=".log")
    os.close(handle)
    task = start_task(command, env=dict(os.environ), log=log)
    try:
        deadline, lines, read = time.monotonic() + timeout, [], 0
        while time.monotonic() < deadline:
            exited = task.poll() is not None   # (before reading: every line it wrote is then in the log)
            with open(log, "rb") as file:
                file.seek(read)
                chunk = file.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            read += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                lines.append(line)
                if line.startswith(wanted):
                    return lines
            if exited:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line starting {wanted!r} (exit {task.poll()}); output:\n"
                             + "\n".join(lines) + open(log, errors="replace").read()[read:])
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
        task.wait(60)
        os.unlink(log)
