"""Two workers finish training with ``BackupAndRestore(delete_checkpoint=True)``; worker 1 is late.

The chief writes ``chief-ending`` and calls ``on_train_end``; worker 1 waits for that mark,
then watches the backups for a second before its own ``on_train_end``: they must still be
there (a worker still training when the chief deleted them would, if it failed then,
restart the whole job from the beginning). Prints ``BACKUPS <n>`` as it sees them.

Run: stratagem launch --workers 2 backup_end_script.py OUT
"""

import os
import sys
import time

import torch

import stratagem as sg

out = sys.argv[1]
strategy = sg.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
backup_dir = os.path.join(out, "backups")
backup = sg.callbacks.BackupAndRestore(backup_dir, save_freq=1)
backup.restore(sg.Checkpoint(model=model, optimizer=optimizer))


def step():
    optimizer.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()


for batch in range(2):
    strategy.run(step)
    backup.on_train_batch_end(batch)
chief_mark = os.path.join(out, "chief-ending")
if strategy.is_chief:
    open(chief_mark, "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(chief_mark):
        assert time.monotonic() < deadline, "the chief never reached on_train_end"
        time.sleep(0.02)
    watch_until = time.monotonic() + 1.0
    while time.monotonic() < watch_until:
        count = len([name for name in os.listdir(backup_dir) if name.startswith("backup-")])
        if count == 0:
            break
        time.sleep(0.02)
    print(f"BACKUPS {count}", flush=True)
backup.on_train_end()
print("DONE", flush=True)
