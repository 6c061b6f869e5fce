"""``stratagem launch --timeline PATH``: the folder every task appends its events to, and the
trace merged from it when the job ends (:mod:`stratagem.observe.chrome`)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from stratagem.errors import InvalidArgumentError
from stratagem.observe.chrome import merge_folder, write

__all__ = ["check_timeline", "write_timeline"]


def check_timeline(path: "str | os.PathLike[str] | None") -> "str | None":
    """``path`` made absolute (the tasks may change directory), checked before any task starts:
    a file name in a folder that exists, not a folder."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(f"--timeline (timeline) must be the path of the trace file to write, got {path!r}.")
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise InvalidArgumentError(f"--timeline {path!r} is a directory; give a file name, like "
                                   f"{os.path.join(path, 'trace.json')!r}.")
    if not os.path.isdir(os.path.dirname(path)):
        raise InvalidArgumentError(f"--timeline {path!r}: the folder {os.path.dirname(path)!r} does not exist; "
                                   f"create it or give a path in a folder that exists.")
    return path


def write_timeline(folder: str, path: str, output: Any) -> None:
    """Merge the tasks' events in ``folder`` into ``path``, say where it is, remove ``folder``."""
    try:
        trace = merge_folder(folder)
        tasks = sum(e["name"] == "process_name" for e in trace["traceEvents"])
        write(trace, path)
        output.say(f"timeline of {tasks} task{'s' if tasks != 1 else ''} written to {path} (open it in "
                   f"https://ui.perfetto.dev or chrome://tracing, or draw it: stratagem timeline {path} --png OUT)")
    except (OSError, ValueError) as err:
        output.say(f"could not write the timeline to {path}: {type(err).__name__}: {err}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
