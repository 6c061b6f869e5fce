"""Measures the transport against a real ``stratagem server`` ps task (not a test).

    python tests/rpc/measure_rpc.py [--seconds 3]

Prints no-op round trips per second (ParameterServer.ping, one client shared by 1 and by 4
threads), pull and push bandwidth for one 4 MiB float32 variable, and the bytes of
pull_rows against the rows asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from stratagem.ps import ParameterServerClient  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rate(fn, seconds: float, threads: int) -> float:
    def loop() -> int:
        count, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            fn()
            count += 1
        return count

    with futures.ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        total = sum(pool.map(lambda _: loop(), range(threads)))
        return total / (time.perf_counter() - started)


def _best_seconds(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "STRATAGEM_CLUSTER_TOKEN": token, "PYTHONPATH": str(REPO_ROOT),
           "TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:2"], "ps": [f"127.0.0.1:{port}"]},
                                    "task": {"type": "ps", "index": 0}})}
    server = subprocess.Popen([sys.executable, "-m", "stratagem", "server"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        print(server.stdout.readline().strip())
        client = ParameterServerClient(f"127.0.0.1:{port}", token, task="ps 0")
        client.call("ping")
        results = {}
        for threads in (1, 4):
            results[f"noop_calls_per_s_{threads}_thread"] = _rate(lambda: client.call("ping"), args.seconds, threads)
        value = torch.randn(1 << 20)   # 4 MiB
        client.call("create", var_id="w", value=value, optimizer_spec=(torch.optim.SGD, {"lr": 0.0}))
        best, median = _best_seconds(lambda: client.call("pull", var_ids=["w"]), 30)
        results["pull_4MiB_ms_best"], results["pull_4MiB_ms_median"] = best * 1e3, median * 1e3
        results["pull_4MiB_GB_per_s_best"] = (4 << 20) / best / 1e9
        results["pull_4MiB_GB_per_s_median"] = (4 << 20) / median / 1e9
        best, median = _best_seconds(lambda: client.call("push", grads={"w": value}), 30)
        results["push_4MiB_GB_per_s_best"] = (4 << 20) / best / 1e9
        results["push_4MiB_GB_per_s_median"] = (4 << 20) / median / 1e9
        client.call("create", var_id="table", value=torch.zeros(100_000, 64), optimizer_spec=(torch.optim.Adagrad, {"lr": 0.1}))
        for rows in (64, 4096):
            before = client.call("stats")["ops"].get("pull_rows", {}).get("bytes_out", 0)
            client.call("pull_rows", var_id="table", row_ids=torch.randint(0, 100_000, (rows,)))
            results[f"pull_rows_{rows}_bytes"] = client.call("stats")["ops"]["pull_rows"]["bytes_out"] - before
        for key, number in results.items():
            print(f"{key:32s} {number:12.3f}" if isinstance(number, float) else f"{key:32s} {number:12d}")
        client.close()
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
