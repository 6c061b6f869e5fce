"""Coordinator script: a metric kept in a module buffer that scheduled steps increment.

Run as the chief of `stratagem launch --workers 1 --ps 1 buffer_metric_ps.py OUT`. Worker-side
buffers are not sent back: reading one on the coordinator must warn (once, naming it) and
show the coordinator's last known value, never NaN.
"""

import json
import os
import sys
import warnings

import torch
from torch import nn

import stratagem as sg


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("correct", torch.zeros(()))


def main():
    out = sys.argv[1]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    with strategy.scope():
        model = Counter()

    def step():
        model.correct.add_(1)
        return model.correct.clone()

    def plain_step():
        return model.linear(torch.ones(1, 4)).sum().detach()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = [coordinator.schedule(plain_step) for _ in range(3)]
        coordinator.join()
        clean = [str(w.message) for w in caught]
        results = [coordinator.schedule(step) for _ in range(5)]
        coordinator.join()
        first = float(model.correct)
        results += [coordinator.schedule(step) for _ in range(3)]
        coordinator.join()
        second = float(model.correct)
        state = model.state_dict()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    report = {"first": first, "second": second, "state_correct": float(state["correct"]),
              "worker_values": [float(r.fetch()) for r in results],
              "plain_ok": all(r.fetch() is not None for r in plain),
              "warnings_before": clean,
              "buffer_warnings": [m for m in messages if "buffer" in m]}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
