"""TensorFlow's tutorial "Multi-worker training with Keras", ported by renaming: one worker of the
job (``test_multi_worker_keras.py`` runs two with ``stratagem launch``).

``python tests/tutorials/multi_worker_keras.py OUT main`` in every worker: ``fit`` under
``MultiWorkerMirroredStrategy``; the model saved with the tutorial's ``write_filepath`` pattern
(non-chiefs write to a temporary directory they delete) and loaded back; an ``sg.Checkpoint`` of
the Keras model through a ``CheckpointManager`` (the same pattern), restored, trained on.
``... OUT backup``: ``fit`` with ``BackupAndRestore(save_freq=3)``; on the job's first attempt
worker 1 dies in the second epoch (``stratagem launch --max-restarts 1`` restarts the job), the
second attempt resumes from the backup, then trains a second model from the same start,
uninterrupted (the test's oracle). Fewer images, steps and filters than the tutorial.
Writes OUT/<phase><task_id>.pt.
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.tutorials import mnist_like  # noqa: E402  (tf.keras.datasets.mnist)

OUT, PHASE = sys.argv[1], sys.argv[2]


# mnist_setup.py of the tutorial
def mnist_dataset(batch_size):
    (x_train, y_train), _ = mnist_like.load_data(num_train=512, num_test=0)
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    # tf.data.Dataset.from_tensor_slices(...).shuffle(60000).repeat().batch(batch_size): fit reads a
    # DataLoader on across epochs when steps_per_epoch is given
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        batch_size=batch_size, shuffle=True)


def build_and_compile_cnn_model():
    # Keras: InputLayer((28, 28)), Reshape((28, 28, 1)), Conv2D(32, 3, activation='relu'), Flatten(),
    # Dense(128, activation='relu'), Dense(10)
    model = sg.Model(nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(8 * 26 * 26, 32), nn.ReLU(), nn.Linear(32, 10)))
    model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=torch.optim.SGD(model.module.parameters(), lr=0.01),   # 0.001 for its 210 steps
                  metrics=["accuracy"])
    return model


# main.py of the tutorial
per_worker_batch_size = 32
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = sg.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)
task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
report = {}


def _is_chief(task_type, task_id):
    # Note: there are two possible `TF_CONFIG` configurations.
    #   1) In addition to `worker` tasks, a `chief` task type is use;
    #      in this case, this function should be modified to
    #      `return task_type == 'chief'`.
    #   2) Only `worker` task type is used; in this case, worker 0 is
    #      regarded as the chief. The implementation demonstrated here
    #      is for this case.
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)                  # tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


if PHASE == "main":
    torch.manual_seed(0)
    with strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        multi_worker_model = build_and_compile_cnn_model()
    history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=8)
    report["history"] = history.history

    model_path = os.path.join(OUT, "keras-model")
    write_model_path = write_filepath(model_path, task_type, task_id)
    multi_worker_model.save(write_model_path)
    if not _is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(write_model_path))          # tf.io.gfile.rmtree
    loaded_model = sg.models.load_model(model_path)
    report["loaded_equal"] = all(torch.equal(a, b) for a, b in zip(
        loaded_model.module.state_dict().values(), multi_worker_model.module.state_dict().values()))
    # Now that the model is restored, and can continue with the training.
    single_worker_dataset = mnist_dataset(per_worker_batch_size)
    report["loaded_history"] = loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=4).history

    checkpoint_dir = os.path.join(OUT, "ckpt")
    checkpoint = sg.Checkpoint(model=multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = sg.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id):
        shutil.rmtree(write_checkpoint_dir)                       # tf.io.gfile.rmtree
    report["saved"] = {"state": {k: v.clone() for k, v in multi_worker_model.module.state_dict().items()},
                       "optimizer": multi_worker_model.optimizer.state_dict()}
    latest_checkpoint = sg.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    report["checkpoint"] = latest_checkpoint
    report["after_restore"] = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=4).history

if PHASE == "backup":
    class DieOnTheFirstAttempt(sg.callbacks.Callback):
        """The test's interruption: worker 1 dies in the second epoch of the job's first attempt."""

        def reads_train_batch_logs(self):
            return False   # it looks at the step's index only

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if task_id == 1 and os.environ.get("STRATAGEM_RESTART") == "0" and self.epoch == 1 and batch == 4:
                print("worker 1: dying in epoch 2", flush=True)
                os._exit(1)   # the machine is gone: nothing more of this process runs

    callbacks = [sg.callbacks.BackupAndRestore(backup_dir=os.path.join(OUT, "backup"), save_freq=3),
                 DieOnTheFirstAttempt()]
    torch.manual_seed(0)
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=8, callbacks=callbacks)
    report["history"] = history.history
    report["state"] = {k: v.clone() for k, v in multi_worker_model.module.state_dict().items()}
    report["restart"] = os.environ.get("STRATAGEM_RESTART")

    torch.manual_seed(0)   # the oracle: the same training, never stopped
    with strategy.scope():
        uninterrupted = build_and_compile_cnn_model()
    uninterrupted.fit(mnist_dataset(global_batch_size), epochs=3, steps_per_epoch=8, verbose=0)
    report["uninterrupted"] = {k: v.clone() for k, v in uninterrupted.module.state_dict().items()}

torch.save(report, os.path.join(OUT, f"{PHASE}{task_id}.pt"))
