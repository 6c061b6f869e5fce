"""A worker of a 2-worker MultiWorkerMirroredStrategy job: fit, evaluate, predict, stop early.

Run by tests/keras/test_multi_worker_fit.py as `python mw_fit_script.py OUT --replicas N` in
each task of a local cluster. Writes OUT/worker<i>.pt with what it saw.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stratagem as sg  # noqa: E402
from common import data, fit, state  # noqa: E402


class StopAfterEpoch(sg.callbacks.Callback):
    """Sets stop_training at the end of epoch 1 on every worker (as a global decision would)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.model.stop_training = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    model, history = fit(strategy)      # shuffled, weighted, uneven last batch, validation
    x, y, w = data()
    result = {"state": state(model), "history": history.history,
              "evaluate": model.evaluate(x, y, batch_size=7, sample_weight=w, verbose=0, return_dict=True),
              "predict": model.predict(x, batch_size=10)}
    stopped = model.fit(x, y, batch_size=10, epochs=5, callbacks=[StopAfterEpoch()], verbose=1)
    result["stopped_epochs"] = stopped.epoch
    torch.save(result, os.path.join(args.out, f"worker{strategy.topology.worker_index}.pt"))


if __name__ == "__main__":
    main()
