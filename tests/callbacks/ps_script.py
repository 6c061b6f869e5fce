"""Coordinator of ``stratagem launch --workers 1 --ps 1 ps_script.py OUT``: ``sg.Model.fit`` under
ParameterServerStrategy with the callbacks. The learning rate drops to 0 after epoch 0, so the
variables on the parameter server must stop changing; EarlyStopping stops at epoch 1. Writes
OUT/report.json."""

import json
import sys
from pathlib import Path

import torch

import stratagem as sg


def main() -> None:
    out = Path(sys.argv[1])
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    y = x @ torch.tensor([[1.0], [-1.0], [2.0], [0.5]])
    with strategy.scope():
        torch.manual_seed(0)
        model = sg.Model(torch.nn.Linear(4, 1))
        model.compile("sgd", "mse")
    initial = [p.tolist() for p in model.module.state_dict().values()]
    weights = []

    class Weights(sg.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append([p.tolist() for p in self.model.module.state_dict().values()])

    callbacks = [sg.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 if epoch == 0 else 0.0),
                 sg.callbacks.EarlyStopping(monitor="loss", min_delta=100.0, patience=1),
                 sg.callbacks.ModelCheckpoint(out / "ckpt-{epoch}"),
                 sg.callbacks.CSVLogger(out / "log.csv"),
                 sg.callbacks.TensorBoard(out / "tb"),
                 Weights()]
    history = model.fit(x, y, batch_size=16, epochs=5, steps_per_epoch=4, callbacks=callbacks, verbose=0)
    (out / "report.json").write_text(json.dumps({"epochs": history.epoch, "lr": history.history["lr"],
                                                 "initial": initial, "weights": weights}))


if __name__ == "__main__":
    main()
