"""The loss-scaling trap across workers (one replica each, so nothing is summed locally).

Usage (one process per task, with TF_CONFIG): python loss_scaling_script.py OUT_DIR
Writes OUT_DIR/rank{R}.json: what a per-replica mean loss got (refused, on every worker, before
any collective), then the gradients of compute_average_loss after the refusal (plain PyTorch's on
the whole batch), and the warnings a loss over an accumulation count gave (one).
"""

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.nn import LossScalingWarning


def main(out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    strategy = sg.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    report = {"rank": strategy.cluster_resolver.worker_rank, "num_replicas": strategy.num_replicas_in_sync}

    def step(loss_fn):
        def fn(b):
            model.zero_grad()
            loss_fn(*b).backward()
            return [p.grad.clone() for p in model.parameters()]
        return fn

    try:
        strategy.run(step(lambda bx, by: F.cross_entropy(model(bx), by)), args=(batch,))
        report["trap"] = "trained"
    except InvalidArgumentError as error:
        report["trap"] = str(error)
    grads = strategy.run(step(lambda bx, by: sg.nn.compute_average_loss(
        F.cross_entropy(model(bx), by, reduction="none"))), args=(batch,))
    F.cross_entropy(reference(x), y).backward()
    report["grad_error"] = max((g - p.grad).abs().max().item() for g, p in zip(grads, reference.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            strategy.run(step(lambda bx, by: F.cross_entropy(model(bx), by) / 4), args=(batch,))
    report["warnings"] = [str(w.message) for w in caught if issubclass(w.category, LossScalingWarning)]
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
