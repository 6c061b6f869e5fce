"""TensorFlow's tutorial "Save and load a model using a distribution strategy", ported by renaming.

``python tests/tutorials/save_and_load.py OUT``: a model trained under ``MirroredStrategy`` (two
CPU replicas), saved with ``model.save``; loaded with ``sg.models.load_model`` without a strategy
and under ``OneDeviceStrategy``, trained on; the same file read by plain PyTorch
(``tf.saved_model.load``'s counterpart: the file's state_dict into the module class), called
directly and under another ``MirroredStrategy`` with ``strategy.run``, and wrapped again for
training (``hub.KerasLayer``'s counterpart: ``sg.Model`` around it); the subclassed-model caveat.
Fewer images and epochs than the tutorial. Writes OUT/report.pt.
"""

import os
import sys

import numpy as np
import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.tutorials import mnist_like  # noqa: E402  (tensorflow_datasets' mnist)

OUT = sys.argv[1]
report = {}
torch.manual_seed(0)

mirrored_strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])   # the tutorial: MirroredStrategy() over its GPUs


def get_data():
    (x_train, y_train), (x_test, y_test) = mnist_like.load_data(num_train=768, num_test=256)
    # tfds gives (28, 28, 1) images, channels last; torch's convolutions take them first
    mnist_train = torch.from_numpy(x_train[:, None]), torch.from_numpy(y_train)
    mnist_test = torch.from_numpy(x_test[:, None]), torch.from_numpy(y_test)

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

    def scale(image, label):
        image = image.float()                             # tf.cast(image, tf.float32)
        image /= 255
        return image, label

    train_dataset = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*scale(*mnist_train)),
                                                batch_size=BATCH_SIZE, shuffle=True)
    eval_dataset = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*scale(*mnist_test)),
                                               batch_size=BATCH_SIZE)
    return train_dataset, eval_dataset


def build():
    # Keras: Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)), MaxPooling2D(), Flatten(),
    # Dense(64, activation='relu'), Dense(10)
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 13 * 13, 64), nn.ReLU(), nn.Linear(64, 10))


def get_model():
    with mirrored_strategy.scope():
        model = sg.Model(build())
        model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=torch.optim.Adam(model.module.parameters()),   # tf.keras.optimizers.Adam()
                      metrics=[sg.metrics.SparseCategoricalAccuracy()])
        return model


model = get_model()
train_dataset, eval_dataset = get_data()
report["fit"] = model.fit(train_dataset, epochs=2).history
predict_dataset = [image for image, label in eval_dataset]   # eval_dataset.map(lambda image, label: image)
expected = model.predict(eval_dataset)

# The Keras API: model.save and load_model
keras_model_path = os.path.join(OUT, "keras_save.keras")
model.save(keras_model_path)

restored_keras_model = sg.models.load_model(keras_model_path)
report["restored_predict"] = restored_keras_model.predict(eval_dataset)
report["restored_fit"] = restored_keras_model.fit(train_dataset, epochs=2).history

another_strategy = sg.OneDeviceStrategy("cpu:0")
with another_strategy.scope():
    restored_keras_model_ds = sg.models.load_model(keras_model_path)
    report["one_device_predict"] = restored_keras_model_ds.predict(eval_dataset)
    report["one_device_fit"] = restored_keras_model_ds.fit(train_dataset, epochs=2).history

# The lower-level API (tf.saved_model.save / load): the file in plain PyTorch
saved_model_path = keras_model_path
loaded = build()
loaded.load_state_dict(torch.load(saved_model_path, weights_only=True)["state_dict"])
inference_func = loaded                                   # loaded.signatures["serving_default"]

for batch in predict_dataset[:1]:                         # predict_dataset.take(1)
    with torch.no_grad():
        report["plain_predict"] = inference_func(batch)

another_strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
with another_strategy.scope():
    loaded = build()
    loaded.load_state_dict(torch.load(saved_model_path, weights_only=True)["state_dict"])
    inference_func = loaded
    dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)
    # Calling the function in a distributed manner
    for batch in dist_predict_dataset:
        with torch.no_grad():
            result = another_strategy.run(inference_func, args=(batch,))
        report["distributed_predict"] = [value.clone() for value in another_strategy.experimental_local_results(result)]
        break

# hub.KerasLayer(loaded, trainable=True) in a Keras model: sg.Model around the loaded module
with another_strategy.scope():
    loaded = build()
    loaded.load_state_dict(torch.load(saved_model_path, weights_only=True)["state_dict"])
    hub_model = sg.Model(loaded)
    hub_model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=torch.optim.Adam(hub_model.module.parameters()),
                      metrics=[sg.metrics.SparseCategoricalAccuracy()])
    report["hub_fit"] = hub_model.fit(train_dataset, epochs=2).history

# Saving with Model.save, loading with the lower-level API under another strategy; the tutorial's
# SaveOptions / LoadOptions(experimental_io_device='/job:localhost') have no counterpart: the chief
# writes the file, and every process reads it itself
with another_strategy.scope():
    loaded = sg.models.load_model(keras_model_path)
report["io_device_predict"] = loaded.predict(eval_dataset)

expected_first = expected[:len(predict_dataset[0])]
report["expected"] = expected
report["expected_first"] = expected_first


# Caveats: a subclassed model. Keras cannot save it before it is called (its inputs are not known);
# a torch module is built when it is made, so it saves at once; the file names its class, which
# load_model is given where it is not importable (a class of the training script, in another process)
class SubclassedModel(nn.Module):
    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = nn.Linear(5, 5)               # tf.keras.layers.Dense(5, name=output_name)

    def forward(self, inputs):                            # call
        return self._dense_layer(inputs)


my_model = sg.Model(SubclassedModel())
subclassed_path = os.path.join(OUT, "subclassed.keras")
my_model.save(subclassed_path)
restored = sg.models.load_model(subclassed_path, custom_objects={"SubclassedModel": SubclassedModel})
x_in = torch.from_numpy(np.random.default_rng(0).uniform(size=(4, 5)).astype(np.float32))
report["subclassed_equal"] = torch.equal(restored.predict(x_in), my_model.predict(x_in))
torch.save(report, os.path.join(OUT, "report.pt"))
