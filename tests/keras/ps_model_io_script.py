"""Coordinator of `stratagem launch --workers 2 --ps 2 ps_model_io_script.py OUT`: sg.Model's save /
load_model and learning_rate under ParameterServerStrategy. Writes OUT/report.pt and OUT/model.pt."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stratagem as sg  # noqa: E402
from common import data, make_module  # noqa: E402


def values(model: sg.Model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}


def main() -> None:
    out = sys.argv[1]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(2))
    x, y, _ = data(rows=200)
    with strategy.scope():
        model = sg.Model(make_module())
        model.compile("adam", sg.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    report = {"optimizer_class": type(model.optimizer).__name__, "lr": float(model.optimizer.learning_rate)}
    model.optimizer.learning_rate = 0.01   # sent to the parameter servers before the next steps
    model.fit(x, y, batch_size=20, epochs=2, steps_per_epoch=10, verbose=0)
    model.save(os.path.join(out, "model.pt"))
    report["saved"] = values(model)
    report["saved_optimizer"] = model.optimizer.state_dict()
    with strategy.scope():   # rebuilt on the parameter servers
        loaded = sg.models.load_model(os.path.join(out, "model.pt"))
    report["loaded_class"] = type(loaded.optimizer).__name__
    report["loaded_lr"] = float(loaded.optimizer.learning_rate)
    report["loaded"] = values(loaded)
    report["loaded_optimizer"] = loaded.optimizer.state_dict()
    history = loaded.fit(x, y, batch_size=20, epochs=1, steps_per_epoch=10, verbose=0)
    report["loaded_trained"] = history.history["loss"]
    report["loaded_changed"] = any(not torch.equal(v, report["saved"][k]) for k, v in values(loaded).items())
    torch.save(report, os.path.join(out, "report.pt"))


if __name__ == "__main__":
    main()
