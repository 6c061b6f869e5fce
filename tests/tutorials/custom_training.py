"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", ported by renaming.

``python tests/tutorials/custom_training.py OUT``: a CNN trained with a custom loop under
``MirroredStrategy`` on two CPU replicas -- a loss with ``reduction=NONE`` averaged by
``sg.nn.compute_average_loss``, regularization through ``sg.nn.scale_regularization_loss``,
metrics in the step, ``strategy.run`` and ``strategy.reduce``, a checkpoint every other epoch,
the latest one restored into a model made without a strategy, and the tutorial's other ways
of iterating the distributed dataset (an iterator; a whole epoch in one function). Fewer
images, epochs and filters than the tutorial, so that it runs in seconds. Writes OUT/report.pt.
"""

import os
import sys

import numpy as np
import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.tutorials import mnist_like  # noqa: E402  (tf.keras.datasets.fashion_mnist)

OUT = sys.argv[1]
torch.manual_seed(0)

(train_images, train_labels), (test_images, test_labels) = mnist_like.load_data(num_train=768, num_test=256)
train_images = train_images[:, None]        # the tutorial adds the channel last: [..., None]; torch's is first
test_images = test_images[:, None]
train_images = train_images / np.float32(255)
test_images = test_images / np.float32(255)

strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])   # the tutorial: MirroredStrategy() over its GPUs
print(f"Number of devices: {strategy.num_replicas_in_sync}")

BUFFER_SIZE = len(train_images)
BATCH_SIZE_PER_REPLICA = 32
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = 3

# tf.data.Dataset.from_tensor_slices(...).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
train_dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.from_numpy(train_images), torch.from_numpy(train_labels)),
    batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
test_dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.from_numpy(test_images), torch.from_numpy(test_labels)),
    batch_size=GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model():
    # Keras: Conv2D(32, 3, activation='relu', kernel_regularizer=L2(1e-5)), MaxPooling2D(), Conv2D(64, ...),
    # MaxPooling2D(), Flatten(), Dense(64, activation='relu'), Dense(10); torch names the input sizes
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10))


def model_losses(model):
    """Keras's ``model.losses`` of ``kernel_regularizer=L2(1e-5)``: torch layers carry no regularizer."""
    return [1e-5 * layer.weight.pow(2).sum() for layer in model if isinstance(layer, (nn.Conv2d, nn.Linear))]


checkpoint_dir = os.path.join(OUT, "training_checkpoints")
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    # Set reduction to NONE, to reduce over the global batch with compute_average_loss
    loss_object = sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=sg.losses.Reduction.NONE)

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = sg.nn.compute_average_loss(per_example_loss)
        if model_losses:
            loss += sg.nn.scale_regularization_loss(sum(model_losses))   # tf.add_n
        return loss

with strategy.scope():
    test_loss = sg.metrics.Mean(name="test_loss")
    train_accuracy = sg.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = sg.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# A model, an optimizer, and a checkpoint must be created under strategy.scope
with strategy.scope():
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    checkpoint = sg.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs
    predictions = model(images)                       # GradientTape: autograd records
    loss = compute_loss(labels, predictions, model_losses(model))
    optimizer.zero_grad()
    loss.backward()                                   # tape.gradient
    optimizer.step()                                  # optimizer.apply_gradients
    train_accuracy.update_state(labels, predictions)
    return loss.detach()


def test_step(inputs):
    images, labels = inputs
    with torch.no_grad():                             # model(images, training=False)
        predictions = model(images)
    t_loss = loss_object(labels, predictions)
    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


def distributed_train_step(dataset_inputs):           # the tutorial's @tf.function: plain Python here
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


report = {"epochs": []}
for epoch in range(EPOCHS):
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100, test_loss.result(),
                          test_accuracy.result() * 100), flush=True)
    report["epochs"].append({"loss": float(train_loss), "accuracy": float(train_accuracy.result()),
                             "test_loss": float(test_loss.result()), "test_accuracy": float(test_accuracy.result())})

    test_loss.reset_states()
    train_accuracy.reset_states()
    test_accuracy.reset_states()

# Restore the latest checkpoint into a model made without a strategy, and test it
eval_accuracy = sg.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
new_model = create_model()
new_optimizer = torch.optim.Adam(new_model.parameters())


def eval_step(images, labels):
    with torch.no_grad():
        predictions = new_model(images)
    eval_accuracy(labels, predictions)


checkpoint = sg.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(sg.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100}")
report["restored_accuracy"] = float(eval_accuracy.result())
report["restored_equal"] = all(torch.equal(a, b) for a, b in zip(new_model.state_dict().values(),
                                                                  model.state_dict().values()))
report["restored_optimizer_steps"] = int(new_optimizer.state_dict()["state"][0]["step"])
report["optimizer_steps"] = int(optimizer.state_dict()["state"][0]["step"])

# Alternate ways of iterating over a dataset: an iterator, a fixed number of steps per epoch
for epoch in range(2):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)
    for _ in range(5):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches
    print("Epoch {}, Loss: {}, Accuracy: {}".format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
    train_accuracy.reset_states()
report["iterator_loss"] = float(average_train_loss)


# Iterating inside a function: one call runs a whole epoch
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / num_batches


for epoch in range(1):
    train_loss = distributed_train_epoch(train_dist_dataset)
    print("Epoch {}, Loss: {}, Accuracy: {}".format(epoch + 1, train_loss, train_accuracy.result() * 100))
    report["epoch_function"] = {"loss": float(train_loss), "accuracy": float(train_accuracy.result())}
    train_accuracy.reset_states()

torch.save(report, os.path.join(OUT, "report.pt"))
