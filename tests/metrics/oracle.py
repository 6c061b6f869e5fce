"""Data and expected values shared by the metric tests: every metric, updated batch by batch
wherever the strategy runs it, must equal the formula (or torchmetrics) applied to all rows."""

from __future__ import annotations

import torch
import torchmetrics
from torchmetrics.classification import BinaryAUROC

import stratagem as sg

NUM_CLASSES = 4


def make_data(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (rows,), generator=g)
    return {
        "labels": labels,
        "logits": torch.randn(rows, NUM_CLASSES, generator=g),
        "onehot": torch.nn.functional.one_hot(torch.randint(0, NUM_CLASSES, (rows,), generator=g), NUM_CLASSES).float(),
        "y01": torch.randint(0, 2, (rows, 1), generator=g).float(),
        "p01": torch.rand(rows, 1, generator=g),
        "y": torch.randn(rows, 2, generator=g),
        "p": torch.randn(rows, 2, generator=g),
        "w": torch.rand(rows, generator=g),
        "ints": torch.randint(0, 3, (rows,), generator=g),
        "ints_pred": torch.randint(0, 3, (rows,), generator=g),
    }


def batches(data: dict[str, torch.Tensor], batch_size: int) -> list[dict[str, torch.Tensor]]:
    rows = len(data["labels"])
    return [{k: v[i:i + batch_size] for k, v in data.items()} for i in range(0, rows, batch_size)]


def make_metrics() -> dict[str, sg.metrics.Metric]:
    """Every metric kind (call in the strategy's scope)."""
    return {
        "sparse": sg.metrics.get("accuracy", loss="sparse_categorical_crossentropy"),
        "sparse_weighted": sg.metrics.SparseCategoricalAccuracy(name="weighted"),
        "categorical": sg.metrics.get("categorical_accuracy"),
        "binary": sg.metrics.get("accuracy", loss=torch.nn.BCELoss()),
        "accuracy": sg.metrics.Accuracy(),
        "mae": sg.metrics.get("mae"),
        "mse": sg.metrics.get("mse"),
        "mean": sg.metrics.Mean(name="loss"),
        "auc": sg.metrics.get("auc"),
        "auc_exact": sg.metrics.AUC(num_thresholds=None, name="auc_exact"),
        "f1": sg.metrics.get(torchmetrics.F1Score(task="multiclass", num_classes=NUM_CLASSES, average="macro")),
        "pearson": sg.metrics.get(torchmetrics.PearsonCorrCoef()),   # states torchmetrics leaves unreduced
    }


def update(metrics: dict[str, sg.metrics.Metric], b: dict[str, torch.Tensor]) -> None:
    """One step's updates (in whatever context the caller runs it)."""
    metrics["sparse"].update_state(b["labels"], b["logits"])
    metrics["sparse_weighted"].update_state(b["labels"], b["logits"], sample_weight=b["w"])
    metrics["categorical"].update_state(b["onehot"], b["logits"])
    metrics["binary"].update_state(b["y01"], b["p01"])
    metrics["accuracy"].update_state(b["ints"], b["ints_pred"])
    metrics["mae"].update_state(b["y"], b["p"])
    metrics["mse"].update_state(b["y"], b["p"])
    metrics["mean"].update_state(b["p"][:, 0], sample_weight=b["w"])
    metrics["auc"].update_state(b["y01"], b["p01"])
    metrics["auc_exact"].update_state(b["y01"], b["p01"])
    metrics["f1"].update_state(b["labels"], b["logits"].argmax(-1))
    metrics["pearson"].update_state(b["y"][:, 0], b["p"][:, 0])


def expected(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hit = (d["logits"].argmax(-1) == d["labels"]).float()
    f1 = torchmetrics.F1Score(task="multiclass", num_classes=NUM_CLASSES, average="macro")
    return {
        "sparse": hit.mean(),
        "sparse_weighted": (hit * d["w"]).sum() / d["w"].sum(),
        "categorical": (d["logits"].argmax(-1) == d["onehot"].argmax(-1)).float().mean(),
        "binary": ((d["p01"] > 0.5).float() == d["y01"]).float().mean(),
        "accuracy": (d["ints"] == d["ints_pred"]).float().mean(),
        "mae": (d["y"] - d["p"]).abs().mean(),
        "mse": (d["y"] - d["p"]).square().mean(),
        "mean": (d["p"][:, 0] * d["w"]).sum() / d["w"].sum(),
        "auc": BinaryAUROC(thresholds=200)(d["p01"].reshape(-1), d["y01"].reshape(-1).long()),
        "auc_exact": BinaryAUROC()(d["p01"].reshape(-1), d["y01"].reshape(-1).long()),
        "f1": f1(d["logits"].argmax(-1), d["labels"]),
        "pearson": torchmetrics.PearsonCorrCoef()(d["p"][:, 0], d["y"][:, 0]),
    }


def check(metrics: dict[str, sg.metrics.Metric], data: dict[str, torch.Tensor], *, together: bool = False) -> None:
    """Each metric's result() (``together``: all read by one sg.metrics.results) equals the oracle."""
    want = expected(data)
    values = sg.metrics.results(metrics.values()) if together else [m.result() for m in metrics.values()]
    for name, got in zip(metrics, values):
        torch.testing.assert_close(got.cpu().float(), want[name].float(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
