"""TensorFlow's tutorial "Distributed training with Keras", ported by renaming.

``python tests/tutorials/keras_mirrored.py OUT``: a CNN built and compiled in a
``MirroredStrategy`` scope (two CPU replicas), trained with ``fit`` and the tutorial's
callbacks (TensorBoard, ModelCheckpoint of the weights every epoch, LearningRateScheduler, a
callback printing ``model.optimizer.learning_rate``), the latest checkpoint's weights loaded
back, evaluated, saved with ``model.save`` and loaded with ``sg.models.load_model`` without a
strategy and in the strategy's scope. Fewer images and epochs than the tutorial, and its
learning-rate steps one epoch apart so that 5 epochs see them. Writes OUT/report.pt.
"""

import os
import sys

import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.tutorials import mnist_like  # noqa: E402  (tensorflow_datasets' mnist)

OUT = sys.argv[1]
report = {}
torch.manual_seed(0)

(x_train, y_train), (x_test, y_test) = mnist_like.load_data(num_train=1024, num_test=256)
# tfds gives (28, 28, 1) images, channels last; torch's convolutions take them first
mnist_train = torch.from_numpy(x_train[:, None]), torch.from_numpy(y_train)
mnist_test = torch.from_numpy(x_test[:, None]), torch.from_numpy(y_test)

strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])   # the tutorial: MirroredStrategy() over its GPUs
print("Number of devices: {}".format(strategy.num_replicas_in_sync))

num_train_examples = len(mnist_train[0])
num_test_examples = len(mnist_test[0])
BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
    image = image.float()                                 # tf.cast(image, tf.float32)
    image /= 255
    return image, label


# mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
train_dataset = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*scale(*mnist_train)),
                                            batch_size=BATCH_SIZE, shuffle=True)
eval_dataset = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*scale(*mnist_test)),
                                           batch_size=BATCH_SIZE)


def build():
    # Keras: Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)), MaxPooling2D(), Flatten(),
    # Dense(64, activation='relu'), Dense(10)
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 13 * 13, 64), nn.ReLU(), nn.Linear(64, 10))


with strategy.scope():
    model = sg.Model(build())
    model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=torch.optim.Adam(model.module.parameters()),   # tf.keras.optimizers.Adam()
                  metrics=["accuracy"])

# Define the checkpoint directory to store the checkpoints.
checkpoint_dir = os.path.join(OUT, "training_checkpoints")
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")


# Define a function for decaying the learning rate (the tutorial's steps are at epochs 3 and 7)
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 4:
        return 1e-4
    else:
        return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(sg.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print("\nLearning rate for epoch {} is {}".format(epoch + 1, model.optimizer.learning_rate.numpy()),
              flush=True)


# Put all the callbacks together.
callbacks = [
    sg.callbacks.TensorBoard(log_dir=os.path.join(OUT, "logs")),
    sg.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
    sg.callbacks.LearningRateScheduler(decay),
    PrintLR(),
]

EPOCHS = 5
history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)
report["history"] = history.history
report["checkpoints"] = sorted(name for name in os.listdir(checkpoint_dir) if not name.startswith("."))  # no lock
report["logs"] = sum(len(files) for _, _, files in os.walk(os.path.join(OUT, "logs")))
trained = {k: v.clone() for k, v in model.module.state_dict().items()}

# the weights of the latest checkpoint (the last epoch's), loaded back, then evaluated.
model.load_weights(sg.latest_checkpoint(checkpoint_dir))
eval_loss, eval_acc = model.evaluate(eval_dataset)
print("Eval loss: {}, Eval accuracy: {}".format(eval_loss, eval_acc))
report["eval"] = (eval_loss, eval_acc)
report["loaded_equal"] = all(torch.equal(v, trained[k]) for k, v in model.module.state_dict().items())

# Export: save the whole model, then load it without the strategy and with it
path = os.path.join(OUT, "my_model.keras")
model.save(path)

unreplicated_model = sg.models.load_model(path)
unreplicated_model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                           optimizer=torch.optim.Adam(unreplicated_model.module.parameters()),
                           metrics=["accuracy"])
eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)
print("Eval loss: {}, Eval Accuracy: {}".format(eval_loss, eval_acc))
report["unreplicated"] = (eval_loss, eval_acc, unreplicated_model.strategy.num_replicas_in_sync)

with strategy.scope():
    replicated_model = sg.models.load_model(path)
    replicated_model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                             optimizer=torch.optim.Adam(replicated_model.module.parameters()),
                             metrics=["accuracy"])

    eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
    print("Eval loss: {}, Eval Accuracy: {}".format(eval_loss, eval_acc))
    report["replicated"] = (eval_loss, eval_acc, replicated_model.strategy.num_replicas_in_sync)
torch.save(report, os.path.join(OUT, "report.pt"))
