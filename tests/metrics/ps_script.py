"""Coordinator script: every metric updated inside steps scheduled onto parameter-server
workers equals the metric computed on all rows, and a step executed twice counts once.

Run as the chief of `stratagem launch --workers 2 --ps 1 ps_script.py OUT`; writes OUT/report.json.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torchmetrics  # noqa: E402

import stratagem as sg  # noqa: E402
from tests.metrics import oracle  # noqa: E402
from tests.ps.failures_ps import task_pid  # noqa: E402


def main():
    out = Path(sys.argv[1])
    report = {}
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    with strategy.scope():
        metrics = oracle.make_metrics()
        steps = sg.metrics.get(torchmetrics.SumMetric())
    executions = out / "executions"

    def step(batch, delay=0.0):
        oracle.update(metrics, batch)
        steps.update_state(None, torch.ones(1))
        with open(executions, "a") as f:   # every execution, also one abandoned later
            f.write(f"{json.loads(os.environ['TF_CONFIG'])['task']['index']}\n")
        time.sleep(delay)
        return json.loads(os.environ["TF_CONFIG"])["task"]["index"], os.getpid()

    # 1. every metric, steps spread over both workers, plus updates made on the coordinator
    data = oracle.make_data(30, seed=7)
    batches = oracle.batches(data, 4)
    values = [coordinator.schedule(step, args=(b, 0.2)) for b in batches[:-1]]
    oracle.update(metrics, batches[-1])
    coordinator.join()
    report["workers_used"] = sorted({v.fetch()[0] for v in values})
    oracle.check(metrics, data)
    report["all_equal"] = True

    # 2. reset_state, then a worker stopped in the middle of its steps: they run again on the
    #    other worker, and the stopped worker's updates (already made) never count
    for metric in [*metrics.values(), steps]:
        metric.reset_state()
    executions.write_text("")
    data = oracle.make_data(40, seed=8)
    batches = oracle.batches(data, 4)
    victim = task_pid("worker", 1)
    for b in batches:
        coordinator.schedule(step, args=(b, 0.4))
    deadline = time.monotonic() + 60
    while "1" not in executions.read_text().split():   # worker 1 is inside a step (it sleeps 0.4 s)
        assert time.monotonic() < deadline, "worker 1 never started a step"
        time.sleep(0.02)
    os.kill(victim, signal.SIGSTOP)
    try:
        coordinator.join(timeout=120)
    finally:
        os.kill(victim, signal.SIGCONT)
    oracle.check(metrics, data)
    report["executions"] = len(executions.read_text().split())
    report["steps"] = len(batches)
    report["steps_counted"] = steps.result().item()

    # 3. a metric created outside the strategy's scope cannot be updated by scheduled steps
    outside = sg.metrics.Mean(name="outside")
    coordinator.schedule(lambda: outside.update_state(torch.ones(2)))
    try:
        coordinator.join()
    except Exception as error:   # noqa: BLE001 - the test checks its text
        report["outside_error"] = str(error)
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
