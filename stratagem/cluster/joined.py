"""How the tasks of ``stratagem launch`` tell it that they took part in their cluster.

The launcher gives each task ``STRATAGEM_JOINED_DIR``, a folder of its own. A task that
really trains as part of the cluster leaves a file there, named after itself: a
multi-worker task once its process group is formed, a parameter server once it holds a
variable, a parameter-server worker once it ran a step, the coordinator once it made its
strategy. While the job runs, the launcher watches for these files to stop a job whose
tasks never join (its ``--join-timeout``); when the job has ended, the launcher compares the files with its tasks and says
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

from stratagem.observe import answer

__all__ = ["JOINED_VARIABLE", "joined_tasks", "mark_joined", "mark_stamp"]

JOINED_VARIABLE = "STRATAGEM_JOINED_DIR"
_marked: set[tuple[str, str]] = set()


def mark_joined(task: str) -> None:
    """Tells the launcher (if any) that ``task`` ("worker 0", "ps 1") took part in its cluster;
    from then on the task answers the launcher's questions (:mod:`stratagem.observe.answer`)."""
    answer.start(task)
    folder = os.environ.get(JOINED_VARIABLE)
    if not folder or (folder, task) in _marked:
        return
    _marked.add((folder, task))
    try:
        _mark_path(folder, task).touch()
    except OSError:   # the launcher's check is advice; training goes on
        pass


def _mark_path(folder: str | os.PathLike[str], task: str) -> Path:
    return Path(folder, task.replace(" ", "-"))


def mark_stamp(folder: str | os.PathLike[str], task: str) -> tuple[int, int] | None:
    """When ``task`` last marked ``folder``: its file's (inode, mtime in ns), None if never.

    A new process of the task marks again (the mtime changes): a launcher compares the stamp
    with the one it saw when it started the process to tell whether that process joined.
    """
    try:
        stat = _mark_path(folder, task).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def joined_tasks(folder: str | os.PathLike[str]) -> set[str]:
    """The tasks that marked ``folder`` ("worker 0", ...)."""
    try:
        return {name.replace("-", " ") for name in os.listdir(folder)}
    except OSError:
        return set()
