"""A process that writes checkpoints, for tests/checkpoint/test_directory_safety.py.

Usage: python directory_script.py MODE DIRECTORY

Modes (each prints lines the test waits for, the last "RESULT {json}" where there is one):
  writer     saves ckpt-1, ckpt-2, ... (the writer's pid tracked in each) with a CheckpointManager,
             printing "SAVED <path>" after each, until killed; a refused save prints
             "REFUSED {json}" and exits 3
  once       one save with a CheckpointManager: "SAVED <path>", or "REFUSED {json}" and exit 3
  save3      saves ckpt-1..3, each with its own step and weights (step n: every weight n)
  resume     restore_or_initialize; RESULT: the path restored, the step, the warnings
  readonly   (in a mount namespace of its own) a 1 MiB tmpfs at DIRECTORY: ckpt-1 saved, the
  full       file system remounted read-only (readonly) or filled up (full), then every way of
             saving fails with CheckpointError; RESULT: the errors, the listing, what restores
"""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import stratagem as sg


def describe(error):
    return {"type": type(error).__name__, "message": str(error)}


def manager_of(directory, **tracked):
    model = torch.nn.Linear(16, 16)
    ckpt = sg.Checkpoint(model=model, **tracked)
    return model, ckpt, sg.CheckpointManager(ckpt, directory, max_to_keep=None)


def writer(directory, once):
    model, ckpt, manager = manager_of(directory, writer=os.getpid(), step=0)
    while True:
        ckpt.step += 1
        try:
            path = manager.save()
        except sg.errors.CheckpointError as error:
            print("REFUSED " + json.dumps(describe(error)), flush=True)
            sys.exit(3)
        print(f"SAVED {path}", flush=True)
        if once:
            return
        time.sleep(0.2)   # a training step


def save3(directory):
    model, ckpt, manager = manager_of(directory, step=0)
    for n in (1, 2, 3):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(n))
        ckpt.step = n
        print(f"SAVED {manager.save()}", flush=True)


def resume(directory):
    model, ckpt, manager = manager_of(directory, step=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = manager.restore_or_initialize()
    result = {"path": path, "step": ckpt.step, "weight": model.weight.unique().tolist(),
              "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}
    try:
        ckpt.restore(Path(directory) / "ckpt-3")
        result["direct"] = None
    except sg.errors.CheckpointError as error:
        result["direct"] = describe(error)
    print("RESULT " + json.dumps(result), flush=True)


def fill(directory):
    """Writes a file until the file system has no room left; returns its path."""
    filler = Path(directory) / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == 28, error   # ENOSPC
    return filler


def disk(mode, directory):
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "stratagem-test", directory], check=True)
    model, ckpt, manager = manager_of(directory, step=0)
    ckpt.step = 1
    manager.save()
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    if mode == "readonly":
        subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
    else:
        filler = fill(directory)
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.step = 2
    result = {}
    for name, save in [("manager", manager.save), ("direct", lambda: ckpt.save(Path(directory) / "ckpt-9")),
                       ("background", lambda: (ckpt.save(Path(directory) / "other", blocking=False),
                                               ckpt.wait()))]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # (the background save also warns)
            try:
                save()
                result[name] = None
            except Exception as error:  # noqa: BLE001 - the test reads what was raised
                result[name] = describe(error)
    result["listing"] = sorted(os.listdir(directory))
    ckpt.step = 0
    torch.nn.init.zeros_(model.weight)
    result["restored"] = manager.restore_or_initialize()
    result["restored_step"] = ckpt.step
    result["restored_equal"] = all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    if mode == "full":   # room again: the next save works
        filler.unlink()
        ckpt.step = 2
        result["after"] = manager.save()
    print("RESULT " + json.dumps(result), flush=True)


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    if mode in ("writer", "once"):
        writer(directory, once=mode == "once")
    elif mode == "save3":
        save3(directory)
    elif mode == "resume":
        resume(directory)
    else:
        disk(mode, directory)


if __name__ == "__main__":
    main()
