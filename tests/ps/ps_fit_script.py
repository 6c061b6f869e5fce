"""Coordinator of `stratagem launch --workers 2 --ps 1 ps_fit_script.py OUT`: sg.Model.fit under
ParameterServerStrategy. Writes OUT/report.pt."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repository

import stratagem as sg  # noqa: E402
from tests.keras.common import data, make_module  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    x, y, w = data(rows=400)
    with strategy.scope():
        model = sg.Model(make_module())
        model.compile(torch.optim.Adam(model.module.parameters(), lr=0.02), sg.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    report = {}
    try:
        model.fit(x, y, epochs=1)
    except ValueError as error:
        report["error"] = str(error)
    before = model.evaluate(x, y, verbose=0, return_dict=True)
    history = model.fit(x, y, sample_weight=w, batch_size=32, epochs=3, steps_per_epoch=25,
                        validation_data=(x[:100], y[:100]), verbose=2)
    report.update(history=history.history, before=before,
                  after=model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True))
    # TensorFlow hands back the strategy's coordinator after a parameter-server fit
    report["same_coordinator"] = sg.ClusterCoordinator(strategy) is strategy.coordinator
    # several steps per scheduled function; the batch callbacks see each function once
    seen = []
    counter = sg.callbacks.LambdaCallback(on_train_batch_end=lambda step, logs: seen.append(step))
    with strategy.scope():
        model.compile(torch.optim.Adam(model.module.parameters(), lr=0.02),
                      sg.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=4)
    scheduled = []
    original = strategy.coordinator.schedule
    strategy.coordinator.schedule = lambda *a, **k: scheduled.append(1) or original(*a, **k)
    more = model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=10, callbacks=[counter], verbose=0)
    strategy.coordinator.schedule = original
    report.update(execution_steps=seen, scheduled=len(scheduled), more_loss=more.history["loss"])
    predicted = model.predict(x, batch_size=64)
    with torch.no_grad():
        expected = model.module(torch.from_numpy(x))
    report["predict_matches"] = bool(torch.allclose(predicted, expected, atol=1e-6)) and len(predicted) == 400
    torch.save(report, os.path.join(out, "report.pt"))


if __name__ == "__main__":
    main()
