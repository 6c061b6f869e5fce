"""One Chrome/Perfetto trace for the whole job, merged from every task's events.

The format is the JSON object that ``chrome://tracing`` and https://ui.perfetto.dev open (and
that torch's profiler writes): ``{"traceEvents": [...]}``, each event a complete span
(``"ph": "X"``, ``ts`` and ``dur`` in microseconds) on a process (``pid``: a task) and a thread
(``tid``: a track of that task), with metadata events naming both. Each task records its own
events (:mod:`.record`); :func:`merge` numbers the tasks (chief, workers, ps, evaluator, then the
others, each by index) and names their processes.

Example::

    from stratagem.observe.chrome import merge
    step = {"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 10.0, "dur": 5.0}
    trace = merge([("worker 1", [step]), ("worker 0", [dict(step, ts=11.0)])])
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["worker 0", "worker 1"]
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterable

__all__ = ["FOLDER_VARIABLE", "load", "merge", "merge_folder", "write"]

#: ``stratagem launch --timeline`` gives each task the folder where it appends its events
FOLDER_VARIABLE = "STRATAGEM_TIMELINE_DIR"

_ORDER = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}


def _task_key(name: str) -> tuple:
    kind, _, index = name.partition(" ")
    return (_ORDER.get(kind, 4), kind, int(index) if index.isdigit() else 0, name)


def merge(parts: Iterable[tuple[str, list[dict]]]) -> dict[str, Any]:
    """The trace of ``parts`` (``(task name, its Chrome events)``, any ``pid``): a process per
    task, in task order, its events kept on their tracks."""
    events: list[dict] = []
    for pid, (task, own) in enumerate(sorted(parts, key=lambda part: _task_key(part[0]))):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": task}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        events.extend(dict(event, pid=pid) for event in own)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "wall clock (time.time_ns) of each task's host; tasks on one host align to microseconds"}}


def merge_folder(folder: str) -> dict[str, Any]:
    """The trace of every task's ``.jsonl`` file in ``folder`` (``stratagem launch --timeline``):
    a header line ``{"task": ..., "pid": ...}``, then one event a line. A task restarted by the
    launcher leaves a file per process: each is a process of the trace."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        if not lines:
            continue
        header = json.loads(lines[0])
        events = []
        for line in lines[1:]:
            try:
                events.append(json.loads(line))
            except ValueError:   # the last line of a task killed while it wrote
                continue
        found.append((header.get("task", os.path.basename(path)), header.get("pid"), events))
    names = [task for task, _, _ in found]
    return merge((f"{task} (pid {pid})" if names.count(task) > 1 else task, events) for task, pid, events in found)


def write(trace: dict[str, Any], path: str) -> str:
    """Write ``trace`` to ``path`` (its folder made if needed), through a temporary file; return ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(json.dumps(trace))   # (json.dumps encodes in C; json.dump's streaming in Python is 10x slower)
    os.replace(partial, path)
    return path


def load(path: str) -> dict[str, Any]:
    """A trace written by :func:`write` (or any Chrome trace: a JSON object with ``traceEvents``,
    or a bare list of events). Raises ValueError naming the file when it is not one."""
    with open(path) as f:
        try:
            trace = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path} is not a Chrome trace (JSON): {err}; give the file that "
                             f"`stratagem launch --timeline` or sg.experimental.Timeline wrote") from None
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} holds JSON but no Chrome trace (an object with a 'traceEvents' list); give the "
                         f"file that `stratagem launch --timeline` or sg.experimental.Timeline wrote")
    return trace
