"""How the tasks of ``stratagem launch`` tell it that they took part in their cluster.

The launcher gives each task ``STRATAGEM_JOINED_DIR``, a folder of its own. A task that
really trains as part of the cluster leaves a file there, named after itself: a
multi-worker task once its process group is formed, a parameter server once it holds a
variable, a parameter-server worker once it ran a step, the coordinator once it made its
strategy. When the job has ended, the launcher compares the files with its tasks and says
when the processes trained on their own (a script that never made a multi-worker
strategy runs N independent trainings that look like one distributed one), or when
parameter servers never received a variable.

Outside the launcher the variable is unset and :func:`mark_joined` does nothing.

Example::

    >>> import os, tempfile
    >>> from stratagem.cluster.joined import JOINED_VARIABLE, joined_tasks, mark_joined
    >>> folder = tempfile.mkdtemp()
    >>> os.environ[JOINED_VARIABLE] = folder
    >>> mark_joined("worker 1")
    >>> sorted(joined_tasks(folder))
    ['worker 1']
    >>> del os.environ[JOINED_VARIABLE]
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["JOINED_VARIABLE", "joined_tasks", "mark_joined"]

JOINED_VARIABLE = "STRATAGEM_JOINED_DIR"
_marked: set[tuple[str, str]] = set()


def mark_joined(task: str) -> None:
    """Tells the launcher (if any) that ``task`` ("worker 0", "ps 1") took part in its cluster."""
    folder = os.environ.get(JOINED_VARIABLE)
    if not folder or (folder, task) in _marked:
        return
    _marked.add((folder, task))
    try:
        Path(folder, task.replace(" ", "-")).touch()
    except OSError:   # the launcher's check is advice; training goes on
        pass


def joined_tasks(folder: str | os.PathLike[str]) -> set[str]:
    """The tasks that marked ``folder`` ("worker 0", ...)."""
    try:
        return {name.replace("-", " ") for name in os.listdir(folder)}
    except OSError:
        return set()
