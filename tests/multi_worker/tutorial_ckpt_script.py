"""A worker of TensorFlow's multi-worker custom-loop tutorial, ported by renaming (run by
test_tutorial_checkpoint.py as 2 real processes): the module and optimizer are made in the
scope, the Checkpoint outside it over the module and two counters, every worker saves through a
CheckpointManager (non-chiefs into a temporary directory they then delete), and a restarted job
resumes from ``sg.latest_checkpoint``. Also ``sg.Checkpoint(model=<sg.Model>)``.
Prints ``epoch <n> done`` after each epoch; writes OUT/worker<i>.pt."""

import json
import os
import shutil
import sys

import torch

import stratagem as sg

OUT, EPOCHS = sys.argv[1], int(sys.argv[2])
strategy = sg.MultiWorkerMirroredStrategy()
task = json.loads(os.environ["TF_CONFIG"])["task"]
task_type, task_id = task["type"], task["index"]


def is_chief():
    return task_type == "chief" or (task_type == "worker" and task_id == 0)


def write_filepath(filepath):
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not is_chief():
        dirpath = os.path.join(dirpath, f"workertemp_{task_id}")
        os.makedirs(dirpath, exist_ok=True)
    return os.path.join(dirpath, base)


torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
epoch = torch.tensor(0)
step_in_epoch = torch.tensor(0)
checkpoint = sg.Checkpoint(model=model, epoch=epoch, step_in_epoch=step_in_epoch)   # outside the scope
checkpoint_dir = os.path.join(OUT, "ckpt")
write_checkpoint_dir = write_filepath(checkpoint_dir)
manager = sg.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
latest = sg.latest_checkpoint(checkpoint_dir)
if latest:
    checkpoint.restore(latest)

generator = torch.Generator().manual_seed(5)
x = torch.randn(64, 4, generator=generator, dtype=torch.float64)
y = x.sum(dim=1, keepdim=True).sin()
data = strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(list(zip(x, y)), batch_size=16))


def step(batch):
    inputs, targets = batch
    loss = sg.nn.compute_average_loss(((model(inputs) - targets) ** 2).squeeze(1), global_batch_size=16)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


while int(epoch) < EPOCHS:
    for batch in data:
        strategy.run(step, args=(batch,))
        step_in_epoch += 1
    epoch += 1
    step_in_epoch.zero_()
    manager.save()
    if not is_chief():
        shutil.rmtree(write_checkpoint_dir)   # the tutorial's cleanup: it must exist
    print(f"epoch {int(epoch)} done", flush=True)

# a Keras model tracked whole: module, optimizer (and its state), restored into another process count
with strategy.scope():
    keras_model = sg.Model(torch.nn.Linear(4, 1).double())
    keras_model.compile(torch.optim.Adam(keras_model.module.parameters(), lr=0.01), "mse")
keras_model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
keras_path = sg.Checkpoint(model=keras_model).save(os.path.join(OUT, "keras"))
torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}, "epoch": int(epoch),
            "keras_state": {k: v.clone() for k, v in keras_model.module.state_dict().items()},
            "keras_optimizer": keras_model.optimizer.state_dict(), "keras_path": keras_path},
           os.path.join(OUT, f"worker{task_id}.pt"))
