"""A worker of a 2-worker MultiWorkerMirroredStrategy job training a tiny BERT from a dict x.

Run by tests/keras/test_hf_models.py as `python hf_mw_script.py OUT` in each task of a local
cluster. Writes OUT/worker<i>.pt with the parameters and the predicted logits.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stratagem as sg  # noqa: E402
from hf_models import BATCH, EPOCHS, bert, bert_data  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.Model(bert())
        model.compile("adam", sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = bert_data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    logits = model.predict(x, batch_size=6).logits   # 23 = 6 + 6 + 6 + 5: 2/1/1/1 at the end
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    result = {"state": state, "logits": logits, "rows": len(logits)}
    torch.save(result, os.path.join(sys.argv[1], f"worker{strategy.topology.worker_index}.pt"))


if __name__ == "__main__":
    main()
