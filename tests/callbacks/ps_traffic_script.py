"""Coordinator of ``stratagem launch --workers 2 --ps 2 ps_traffic_script.py OUT``: ``sg.Model.fit``
with the TensorBoard callback under ParameterServerStrategy; OUT/tb gets each worker's ps traffic.
Writes OUT/report.json with the bytes of the model's variables."""

import json
import sys
from pathlib import Path

import torch

import stratagem as sg


def main() -> None:
    out = Path(sys.argv[1])
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    y = x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(4))
    with strategy.scope():
        model = sg.Model(torch.nn.Linear(8, 4))   # the weight on ps 0, the bias on ps 1
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=8, callbacks=[sg.callbacks.TensorBoard(out / "tb")],
              verbose=0)
    sizes = sum(p.numel() * p.element_size() for p in model.module.parameters())
    (out / "report.json").write_text(json.dumps({"variable_bytes": sizes}))


if __name__ == "__main__":
    main()
