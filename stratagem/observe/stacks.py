"""Where this process stands: each thread's stack, the user's line in it, the flight recorder.

:func:`snapshot` is what a task answers when asked where it stands (``answer.py``): a
JSON-ready dict with the user's frame of the main thread (of another thread when the main thread
has none) -- the innermost frame that is
neither stratagem's, torch's (an installed package) nor the standard library's, the line a
user recognises (``loss.backward()`` at ``train.py:40``) --, the collectives in flight and
the last one completed (``flight.py``), and the full stacks of every thread as text. It runs
on any thread and needs only the GIL: the main thread may be waiting in a collective or in
``time.sleep``.

Example::

    >>> from stratagem.observe.stacks import snapshot
    >>> state = snapshot("worker 0")
    >>> state["task"], state["main"] is None or "line" in state["main"], "Thread" in state["stacks"]
    ('worker 0', True, True)
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from stratagem._frames import is_users
from stratagem.observe import flight

__all__ = ["frame_summary", "snapshot", "user_frame"]


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the user's code on the stack that ends in ``frame`` (None: none)."""
    while frame is not None and not is_users(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_summary(frame: FrameType) -> dict[str, Any]:
    """``{"file", "line", "function", "code"}`` of ``frame`` (``code``: its line's source text)."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return {"file": filename, "line": line, "function": frame.f_code.co_name,
            "code": linecache.getline(filename, line).strip()}


def _record(rec: flight.Record, now: float, main: int) -> dict[str, Any]:
    since = (rec.end_monotonic if rec.end_monotonic is not None else rec.start_monotonic)
    return {"seq": rec.seq, "kind": rec.kind, "nbytes": rec.nbytes, "peers": rec.peers, "step": rec.step,
            "main_thread": rec.thread == main, "seconds": round(now - since, 3)}


def snapshot(task: str) -> dict[str, Any]:
    """Where this process stands now, as a JSON-ready dict (see the module's docstring).

    ``in_flight`` and ``last_completed`` carry ``seconds``: since the collective started, and
    since it ended.
    """
    now = time.monotonic()
    main = threading.main_thread()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    texts = []
    for ident, frame in frames.items():
        users = user_frame(frame)
        where = f" -- the user's line: {users.f_code.co_filename}:{users.f_lineno}" if users else ""
        texts.append(f'Thread "{names.get(ident, ident)}"{" (main)" if ident == main.ident else ""}{where}\n'
                     + "".join(traceback.format_stack(frame)))
    # the main thread's line of the user's code; else another thread's (a parameter-server worker
    # runs its closures on the RPC server's threads)
    candidates = [main.ident] + [ident for ident in frames if ident != main.ident]
    mine = next((found for ident in candidates if (found := user_frame(frames.get(ident))) is not None), None)
    last = flight.last_completed()
    return {
        "task": task, "pid": os.getpid(), "time": time.time(), "step": flight.step(),
        "main": frame_summary(mine) if mine is not None else None,
        "in_flight": [_record(rec, now, main.ident) for rec in flight.in_flight()],
        "last_completed": _record(last, now, main.ident) if last is not None else None,
        "stacks": "\n".join(texts),
    }
