"""Saves ckpt-1, then starts saving ckpt-2 and stops half-way through writing it, to be SIGKILLed.

Usage: python crash_script.py DIRECTORY
Prints "saved <path>" after the first save and "writing" once the second save has written its
first file (then waits to be killed).
"""

import sys
import time

import torch

import stratagem as sg
from stratagem.checkpoint import storage

model = torch.nn.Linear(64, 64)
ckpt = sg.Checkpoint(model=model, step=1)
manager = sg.CheckpointManager(ckpt, sys.argv[1])
print("saved", manager.save(), flush=True)

original = storage._write_file


def write_then_hang(path, data):
    original(path, data)
    print("writing", path, flush=True)
    time.sleep(600)


storage._write_file = write_then_hang
with torch.no_grad():
    model.weight.fill_(7.0)
ckpt.step = 2
manager.save()
