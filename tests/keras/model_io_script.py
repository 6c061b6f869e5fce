"""A worker of a 2-worker MultiWorkerMirroredStrategy job: sg.Model's save / load_model, save_weights /
load_weights and learning_rate, TensorFlow's multi-worker tutorial flow included.

Run by tests/keras/test_multi_worker_model_io.py as `python model_io_script.py OUT [--sharding optimizer]` in
each task of a local cluster. Writes OUT/worker<i>.pt with what it saw; the test loads OUT/model.pt.
With `--absent --timeout S`: worker 1 never calls save, and worker 0's save must raise
UnavailableError within about S seconds, writing nothing (OUT/absent.json says what it saw).
"""

import argparse
import json
import os
import shutil
import sys
import time
import warnings

import numpy as np
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError

FEATURES, CLASSES, ROWS = 5, 3, 100


def arrays():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, FEATURES))
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def make_module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)).double()


def build(strategy, seed: int = 0) -> sg.Model:
    with strategy.scope():
        model = sg.Model(make_module(seed))
        model.compile("adam", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def train(model: sg.Model, seed: int, epochs: int = 1) -> None:
    torch.manual_seed(seed)   # the shuffling order (the chief's is used by every worker)
    model.fit(*arrays(), batch_size=10, epochs=epochs, verbose=0)


def values(model: sg.Model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}


# TensorFlow's multi-worker Keras tutorial, with tf.io.gfile renamed to os / shutil
def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def absent(out: str, timeout: float) -> None:
    """Worker 1 does not call save: worker 0's save raises within the timeout; both then leave."""
    options = sg.CommunicationOptions(timeout_seconds=timeout)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    model = build(strategy)
    done = os.path.join(out, "absent-done")
    if strategy.topology.worker_index == 0:
        started, error = time.monotonic(), None
        try:
            model.save(os.path.join(out, "absent.pt"))
        except sg.errors.UnavailableError as failure:
            error = str(failure)
        with open(os.path.join(out, "absent.json"), "w") as f:
            json.dump({"error": error, "seconds": time.monotonic() - started}, f)
        open(done, "w").close()
    else:
        print("not saving", flush=True)
        deadline = time.monotonic() + 200
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)
    os._exit(0)   # the process group is broken: leave without its teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sharding", default=None)
    parser.add_argument("--absent", action="store_true")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = args.out
    if args.absent:
        return absent(out, args.timeout)
    strategy = sg.MultiWorkerMirroredStrategy(sharding=args.sharding)
    index = strategy.topology.worker_index
    report = {"module_file": sg.__file__}

    model = build(strategy)
    train(model, seed=1, epochs=2)
    report["lr_before"] = float(model.optimizer.learning_rate)
    model.optimizer.learning_rate = 0.0005   # on every worker, as Keras code would
    report["optimizer_class"] = type(model.optimizer).__name__
    train(model, seed=2)

    # every worker, one path: the chief alone writes it
    model.save(os.path.join(out, "model.pt"))
    report["saved"] = values(model)

    # the tutorial: a non-chief worker saves to a temporary directory, then deletes it
    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    model_path = os.path.join(out, "keras-model.pt")
    write_model_path = write_filepath(model_path, task_type, task_id)
    model.save(write_model_path)
    if not _is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(write_model_path))
    loaded_model = sg.models.load_model(model_path)   # outside the scope: the default strategy
    report["tutorial_loaded"] = values(loaded_model)
    report["tutorial_default"] = loaded_model.strategy.is_default

    # overwrite=False: every worker refuses, nothing written
    try:
        model.save(os.path.join(out, "model.pt"), overwrite=False)
    except InvalidArgumentError as err:
        report["overwrite_error"] = str(err)

    # resume under the same strategy: equal to training on without saving
    with strategy.scope():
        restored = sg.models.load_model(os.path.join(out, "model.pt"))
    report["restored_lr"] = float(restored.optimizer.learning_rate)
    report["restored_class"] = type(restored.optimizer).__name__
    train(restored, seed=3)
    train(model, seed=3)
    report["resumed"], report["uninterrupted"] = values(restored), values(model)

    # weights: the chief writes; every worker loads into a model built in code
    model.save_weights(os.path.join(out, "weights.pt"))
    fresh = build(strategy, seed=5)
    fresh.load_weights(os.path.join(out, "weights.pt"))
    report["weights_loaded"] = values(fresh)
    x = torch.from_numpy(arrays()[0])
    report["predict_after_load_weights"] = fresh.predict(x, batch_size=20)

    # each host its own disk: worker 1 finds an older file under the path; it loads the chief's copy
    model.save(os.path.join(out, "private0", "model.pt"))   # every worker; the chief writes
    private = os.path.join(out, f"private{index}", "model.pt")
    if index == 1:
        os.makedirs(os.path.dirname(private), exist_ok=True)
        torch.save({"stale": True}, private)
    strategy.checkpoint_collective.all_gather_object(None, "stale file written")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            copied = sg.models.load_model(private)
    report["copied"] = values(copied)
    report["copy_warnings"] = [str(w.message) for w in caught if "chief's copy" in str(w.message)]
    torch.save(report, os.path.join(out, f"worker{index}.pt"))


if __name__ == "__main__":
    sys.exit(main())
