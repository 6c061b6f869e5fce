"""TensorFlow's tutorial "Custom training loop with Keras and MultiWorkerMirroredStrategy",
ported by renaming: one worker of the job (``test_multi_worker_ctl.py`` runs two).

``python tests/tutorials/multi_worker_ctl.py OUT NUM_EPOCHS [uninterrupted]`` in every worker
(TF_CONFIG set): a CNN trained with ``strategy.run`` over ``distribute_datasets_from_function``,
the epoch and the step in it kept in tensors beside the model in an ``sg.Checkpoint`` made
outside the scope, saved through a ``CheckpointManager`` by every worker (non-chiefs into a
temporary directory they delete), and a restarted job resuming from ``sg.latest_checkpoint``.
With ``uninterrupted``, the job then trains a second model the same way from the same start
without checkpoints: the test's oracle. Prints ``Epoch: <n>, ...`` after each epoch; writes
OUT/report<task_id>.pt. Fewer images, steps and filters than the tutorial.
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

OUT, NUM_EPOCHS = sys.argv[1], int(sys.argv[2])
UNINTERRUPTED = sys.argv[3:] == ["uninterrupted"]


# mnist.py of the tutorial
def mnist_dataset():
    (x_train, y_train), _ = mnist_like.load_data(num_train=512, num_test=0)
    # the values range from 0 to 255; convert them to float32 in [0, 1]
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    # tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000): load_data's order is random
    # already; the same order on every run, so that a resumed job sees what an uninterrupted one sees
    return torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset()
    # dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = torch.utils.data.Subset(dataset, range(input_context.input_pipeline_id, len(dataset),
                                                     input_context.num_input_pipelines))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)   # dataset.batch(batch_size)


def build_cnn_model():
    # Keras: Input((28, 28)), Reshape((28, 28, 1)), Conv2D(32, 3, activation='relu', kernel_regularizer=L2(1e-5)),
    # Flatten(), Dense(128, activation='relu', ...), Dense(10, ...)
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 26 * 26, 32), nn.ReLU(), nn.Linear(32, 10))


def model_losses(model):
    """Keras's ``model.losses`` of ``kernel_regularizer=L2(1e-5)``: torch layers carry no regularizer."""
    return [1e-5 * layer.weight.pow(2).sum() for layer in model if isinstance(layer, (nn.Conv2d, nn.Linear))]


# main.py of the tutorial
tf_config = json.loads(os.environ["TF_CONFIG"])
global_batch_size = 64
num_steps_per_epoch = 8

strategy = sg.MultiWorkerMirroredStrategy()


def make_training():
    """The tutorial's objects made in the scope (a function here: the oracle makes them twice)."""
    torch.manual_seed(0)
    with strategy.scope():
        multi_worker_model = build_cnn_model()
        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))
        optimizer = torch.optim.RMSprop(multi_worker_model.parameters(), lr=0.001, alpha=0.9)   # Keras's rho=0.9
        train_accuracy = sg.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    return multi_worker_model, multi_worker_dataset, optimizer, train_accuracy


multi_worker_model, multi_worker_dataset, optimizer, train_accuracy = make_training()


def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
        """Per-replica step function."""
        x, y = inputs
        predictions = multi_worker_model(x)
        per_example_loss = sg.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=sg.losses.Reduction.NONE)(y, predictions)
        loss = sg.nn.compute_average_loss(per_example_loss)
        model_losses_ = model_losses(multi_worker_model)
        if model_losses_:
            loss += sg.nn.scale_regularization_loss(sum(model_losses_))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_accuracy.update_state(y, predictions)
        return loss.detach()

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)


checkpoint_dir = os.path.join(OUT, "ckpt")


def _is_chief(task_type, task_id, cluster_spec):
    return (task_type is None or task_type == "chief"
            or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict()))


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)               # tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


# tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='epoch')
epoch = torch.tensor(0, dtype=torch.int64)
step_in_epoch = torch.tensor(0, dtype=torch.int64)
task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
cluster_spec = sg.cluster.ClusterSpec(tf_config["cluster"])

# the tutorial tracks the model alone; the optimizer too here, so that a resumed job goes on exactly
checkpoint = sg.Checkpoint(model=multi_worker_model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
checkpoint_manager = sg.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

# Restoring the checkpoint
latest_checkpoint = sg.latest_checkpoint(checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)
resumed_at = int(epoch)

report = {"resumed_at": resumed_at, "epochs": []}
while epoch.numpy() < NUM_EPOCHS:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0
    while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch += 1                              # step_in_epoch.assign_add(1)
    train_loss = total_loss / num_batches
    print("Epoch: %d, accuracy: %f, train_loss: %f." % (epoch.numpy(), train_accuracy.result(), train_loss),
          flush=True)
    report["epochs"].append({"accuracy": float(train_accuracy.result()), "loss": float(train_loss)})
    train_accuracy.reset_states()

    # the tutorial counts the epoch after saving, so a job restarted from that checkpoint finds the epoch
    # done but not counted, runs no step and divides by num_batches == 0 (in TensorFlow too): count first
    epoch += 1                                          # epoch.assign_add(1)
    step_in_epoch.fill_(0)                              # step_in_epoch.assign(0)
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)             # tf.io.gfile.rmtree

report["state"] = {k: v.clone() for k, v in multi_worker_model.state_dict().items()}
report["epoch"] = int(epoch)

if UNINTERRUPTED:   # the oracle: the same training from the same start, never stopped
    multi_worker_model, multi_worker_dataset, optimizer, train_accuracy = make_training()
    for _ in range(NUM_EPOCHS):
        iterator = iter(multi_worker_dataset)
        for _ in range(num_steps_per_epoch):
            train_step(iterator)
    report["uninterrupted"] = {k: v.clone() for k, v in multi_worker_model.state_dict().items()}
torch.save(report, os.path.join(OUT, f"report{task_id}.pt"))
