"""A task's answers to whoever asks where it stands: the launcher, or a peer whose collective timed out.

``stratagem launch`` gives every task ``STRATAGEM_OBSERVE_DIR``, a folder the job's tasks
share. Once a task has joined its cluster (:func:`stratagem.cluster.joined.mark_joined`
calls :func:`start`), a daemon thread of it, ``stratagem-observe``, looks at that folder
five times a second:

- ``tasks/<task>`` holds its process id (written once): who can be asked;
- ``progress/<task>`` is touched whenever the flight recorder's progress moved (a step began,
  a collective ended) since the last look: the launcher's ``--hang-timeout`` watches these;
- each new file ``requests/<id>`` is a question: the thread writes
  :func:`~stratagem.observe.stacks.snapshot` as JSON to ``answers/<id>/<task>.json``;
- ``last/<task>.json`` holds its last completed collective or call (rewritten when it changes):
  what a task that can no longer answer -- stopped, stuck -- last did
  (:func:`stratagem.observe.hang_report.last_note`).

A thread, not a signal handler: Python runs signal handlers on the main thread between
bytecodes, and a main thread waiting in a collective (gloo, NCCL) or in ``time.sleep`` is in
C code -- which releases the GIL, so the thread can read every stack meanwhile. A process
that is stopped (SIGSTOP, a debugger) or stuck in C code that holds the GIL does not answer:
the asker says so, with its state from ``/proc``.

Outside the launcher the variable is unset and :func:`start` does nothing.

Example::

    import os, tempfile
    from stratagem.observe import answer
    folder = tempfile.mkdtemp()
    os.environ[answer.OBSERVE_VARIABLE] = folder
    answer.start("worker 0")          # what mark_joined does
    del os.environ[answer.OBSERVE_VARIABLE]
    assert os.path.exists(os.path.join(folder, "tasks", "worker-0"))
    answer.stop()
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from stratagem.observe import flight
from stratagem.observe.stacks import snapshot

__all__ = ["OBSERVE_VARIABLE", "POLL_SECONDS", "slug", "start", "stop"]

OBSERVE_VARIABLE = "STRATAGEM_OBSERVE_DIR"
#: How often the thread looks for questions and reports progress.
POLL_SECONDS = 0.2
_started: dict[str, threading.Event] = {}   # folder: its thread's stop event


def slug(task: str) -> str:
    """A task's name as a file name: ``"worker 1"`` -> ``"worker-1"``."""
    return task.replace(" ", "-")


def start(task: str) -> None:
    """Answer questions about ``task`` (this process) from now on, if the launcher asks (idempotent)."""
    folder = os.environ.get(OBSERVE_VARIABLE)
    if not folder or folder in _started:
        return
    try:
        root = Path(folder)
        for sub in ("tasks", "progress", "requests", "answers", "last"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        _write(root / "tasks" / slug(task), str(os.getpid()))
    except OSError:   # advice only: training goes on without it
        return
    seen = set(os.listdir(root / "requests"))   # questions asked before this process: not to it
    _started[folder] = stopped = threading.Event()
    threading.Thread(target=_serve, args=(root, task, seen, stopped), name="stratagem-observe", daemon=True).start()


def stop() -> None:
    """Stop answering (the thread ends within :data:`POLL_SECONDS`); :func:`start` may start it again."""
    for stopped in _started.values():
        stopped.set()
    _started.clear()


def _serve(root: Path, task: str, seen: set[str], stopped: threading.Event) -> None:
    name, requests = slug(task), root / "requests"
    progress, marker, noted = None, root / "progress" / name, 0
    while not stopped.wait(POLL_SECONDS):
        try:
            now = flight.progress()
            if now != progress:
                progress = now
                marker.touch()
            done = flight.last_completed()
            if done is not None and done.seq != noted:
                noted = done.seq
                _write(root / "last" / f"{name}.json", json.dumps(_note(done)))
            for request in sorted(set(os.listdir(requests)) - seen):
                seen.add(request)
                where = root / "answers" / request
                where.mkdir(parents=True, exist_ok=True)
                _write(where / f"{name}.json", json.dumps(snapshot(task)))
        except OSError:   # the folder went away (the job ended): nothing to answer any more
            return


def _note(done: flight.Record) -> dict:
    """What ``last/<task>.json`` says: this process and its last completed record (its end on the wall clock)."""
    return {"pid": os.getpid(), "step": flight.step(),
            "last_completed": {"seq": done.seq, "kind": done.kind, "nbytes": done.nbytes, "peers": done.peers,
                               "step": done.step, "ended": done.end_wall}}


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` all at once: a reader never sees half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
