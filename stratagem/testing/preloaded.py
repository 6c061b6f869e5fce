"""What the test fork server (``forkserver.py`` beside this file) imports of stratagem before it
forks, besides torch: the modules a task of a strategy loads before its first step, whatever the
strategy -- the core, the Keras-style Model, checkpoints, callbacks, the tensor-parallel and
pipeline strategies (about a third of a second of every task's start-up on a quiet machine, more
on a busy one). Not the parameter-server transport (grpc, whose fork handlers would run at every
fork) nor the launcher.

A forked task takes its own environment only after these imports ran, so none of these modules
may read the environment when imported (``tests/testing/test_preloaded.py`` checks every module
they load), and the server hides its ``STRATAGEM_*`` variables while it imports them. The one
thing such an import would do with a task's environment, start the timeline recorder of
``stratagem launch --timeline``, the forked task does with its own: :func:`task_started`.
"""

from __future__ import annotations

from stratagem import callbacks, checkpoint, experimental  # noqa: F401
from stratagem.keras import model  # noqa: F401
from stratagem.observe import record
from stratagem.strategies import mirrored, multi_worker  # noqa: F401

__all__ = ["task_started"]


def task_started() -> None:
    """In a task forked from the server, once it has its environment: what importing these modules
    does with the environment in a fresh interpreter (the timeline recorder's start)."""
    record.follow_environment()
