"""When a job hangs: ask every task where it stands, and say it in one message.

:func:`ask` puts a question in the job's folder (``answer.py`` describes it) and waits a few
seconds for every task's answer, but not for a task whose process is gone. :func:`describe`
turns the answers into lines a user acts on -- the tasks that are not in a collective first,
with their line of the script, then the tasks waiting, grouped by the collective they wait
in::

    worker 1 is in `time.sleep(3600)` at train.py:42 (step 12), not in a collective; its last
      collective, #57 gradient all_reduce (4.2 MB), ended 31 s ago; the others wait in #58
    workers 0, 2 and 3 wait in #58 gradient all_reduce (4.2 MB, step 12) since 31 s, at
      train.py:40 `loss.backward()`

and :func:`write_stacks` writes every thread's full stack of every task to one file, which
the message names. :func:`report` does all three for a task whose collective just timed out.

Example::

    >>> from stratagem.observe.hang_report import describe
    >>> waiting = {"main": {"file": "train.py", "line": 40, "function": "<module>",
    ...                     "code": "loss.backward()"}, "step": 12, "last_completed": None,
    ...            "in_flight": [{"seq": 58, "kind": "gradient all_reduce", "nbytes": 4_200_000,
    ...                           "peers": "", "step": 12, "main_thread": True, "seconds": 31.0}]}
    >>> print(describe({"worker 0": waiting, "worker 1": None, "worker 2": waiting},
    ...                {"worker 1": "its process has exited"}))
    worker 1 did not answer: its process has exited
    workers 0 and 2 wait in #58 gradient all_reduce (4.2 MB, step 12) since 31 s, at train.py:40 `loss.backward()`
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem.observe.answer import OBSERVE_VARIABLE, slug
from stratagem.observe.stacks import snapshot

__all__ = ["ANSWER_SECONDS", "ask", "describe", "last_note", "proc_state", "registered", "report", "silence",
           "silent_reasons", "write_stacks"]

#: How long an asker waits for the tasks' answers (they look for questions 5 times a second).
ANSWER_SECONDS = 3.0

Answer = Mapping[str, Any]


def proc_state(pid: int) -> str | None:
    """``"T (stopped)"``, ``"S (sleeping)"``: the State of ``/proc/PID/status``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def registered(folder: str | os.PathLike[str]) -> dict[str, int]:
    """The tasks that answer questions in ``folder``, with their process ids."""
    found = {}
    tasks = Path(folder, "tasks")
    try:
        names = os.listdir(tasks)
    except OSError:
        return {}
    for name in names:
        if name.startswith("."):
            continue
        try:
            found[name.replace("-", " ")] = int((tasks / name).read_text())
        except (OSError, ValueError):
            continue
    return dict(sorted(found.items(), key=lambda item: _order(item[0])))


def _order(task: str) -> tuple[int, int]:
    kind, _, index = task.partition(" ")
    return (["chief", "worker", "ps", "evaluator"].index(kind) if kind in ("chief", "worker", "ps", "evaluator")
            else 9, int(index) if index.isdigit() else 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = proc_state(pid)
    return state is None or not state.startswith("Z")


def ask(folder: str | os.PathLike[str], tasks: Mapping[str, int] | None = None, *,
        wait_s: float = ANSWER_SECONDS) -> dict[str, Answer | None]:
    """Every task's answer (None where none came within ``wait_s`` seconds), in task order.

    ``tasks`` (name: process id) defaults to the tasks registered in ``folder``; a task whose
    process is gone is not waited for.
    """
    root = Path(folder)
    tasks = dict(registered(root) if tasks is None else tasks)
    request = f"{time.time_ns()}-{os.getpid()}"
    try:
        (root / "answers" / request).mkdir(parents=True, exist_ok=True)
        (root / "requests").mkdir(parents=True, exist_ok=True)
        (root / "requests" / request).touch()
    except OSError:
        return {name: None for name in tasks}
    answers: dict[str, Answer] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for name in tasks:
            path = root / "answers" / request / f"{slug(name)}.json"
            if name not in answers and path.exists():
                try:
                    answers[name] = json.loads(path.read_text())
                except (OSError, ValueError):
                    pass
        waiting = [name for name, pid in tasks.items() if name not in answers and _alive(pid)]
        if not waiting or time.monotonic() > deadline:
            return {name: answers.get(name) for name in tasks}
        time.sleep(0.05)


def silence(pid: int | None) -> str:
    """Why a task with process ``pid`` did not answer, from ``/proc``: what :func:`describe` says."""
    state = proc_state(pid) if pid is not None else None
    if pid is not None and (state is None or state.startswith("Z")) and not _alive(pid):
        return "its process has exited"
    if state is None:
        return "stopped (SIGSTOP), stuck in C code that holds the GIL, or not joined to its cluster yet"
    if state.startswith(("T", "t")):
        return f"it is stopped (SIGSTOP or a debugger): state {state} in /proc/{pid}/status"
    return (f"stuck in C code that holds the GIL, or not joined to its cluster yet: state {state} "
            f"in /proc/{pid}/status")


def last_note(folder: str | os.PathLike[str], task: str, pid: int | None = None) -> str:
    """What ``task`` (process ``pid``, when given) last wrote of itself in ``folder`` while it ran
    (``answer.py``): ``"; its last call, #812 rpc served pull (144 B, step 0), ended 12 s ago"``,
    to add to why it did not answer; ``""`` when it wrote nothing (or another process of it did)."""
    try:
        note = json.loads(Path(folder, "last", f"{slug(task)}.json").read_text())
        last = note["last_completed"]
        if pid is not None and note.get("pid") != pid:
            return ""
        ago = max(0.0, time.time() - float(last["ended"]))
        return (f"; its last {_noun(last['kind'])}, #{last['seq']} {_kind(last)} "
                f"({_bytes(last['nbytes'], ', ')}step {last['step']}), ended {ago:.0f} s ago")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def silent_reasons(folder: str | os.PathLike[str] | None, tasks: Mapping[str, int],
                   answers: Mapping[str, Answer | None]) -> dict[str, str]:
    """Why each task whose answer is None gave none (:func:`silence`) and what it last did
    (:func:`last_note`): the ``silent`` argument of :func:`describe` and :func:`write_stacks`."""
    return {name: silence(tasks.get(name)) + (last_note(folder, name, tasks.get(name)) if folder else "")
            for name, answer in answers.items() if answer is None}


def describe(answers: Mapping[str, Answer | None], silent: Mapping[str, str] | None = None) -> str:
    """The answers in a few lines (see the module's docstring); ``silent`` says why a task
    whose answer is None gave none (:func:`silence`)."""
    silent = silent or {}
    lines = [f"{name} did not answer: {silent.get(name, 'no answer came')}"
             for name, answer in answers.items() if answer is None]
    waiting: dict[tuple, list[str]] = {}
    idle = []
    for name, answer in answers.items():
        if answer is None:
            continue
        record = _waited(answer)
        if record is None:
            idle.append((name, answer))
        else:
            key = (record["seq"], _kind(record), record["nbytes"], record["step"], _at(answer.get("main")))
            waiting.setdefault(key, []).append(name)
    # (sequence numbers compare across tasks for the process groups' collectives, not RPC calls)
    waited = sorted({key[0] for key in waiting if not key[1].startswith("rpc ")})
    for name, answer in idle:
        lines.append(_idle(name, answer, waited))
    for (seq, kind, nbytes, step, at), names in waiting.items():
        since = max(_waited(answers[name])["seconds"] for name in names)
        verb = "waits" if len(names) == 1 else "wait"
        lines.append(f"{_names(names)} {verb} in #{seq} {kind} ({_bytes(nbytes, ', ')}step {step}) since "
                     f"{since:.0f} s" + (f", at {at}" if at else ""))
    kinds: dict[int, set[str]] = {}
    for seq, kind, *_ in waiting:
        if not kind.startswith("rpc "):
            kinds.setdefault(seq, set()).add(kind)
    for seq, different in kinds.items():
        if len(different) > 1:
            lines.append(f"the tasks wait in different collectives as #{seq} ({', '.join(sorted(different))}): "
                         "the script issues different collectives on different tasks (one skipped or added one)")
    return "\n".join(lines)


def _waited(answer: Answer) -> dict[str, Any] | None:
    """The collective a task waits in: its main thread's oldest in flight, else any thread's."""
    records = answer.get("in_flight") or []
    main = [r for r in records if r.get("main_thread")]
    return (main or records or [None])[0]


def _idle(name: str, answer: Answer, waited: Sequence[int]) -> str:
    main = answer.get("main")
    where = f"is in `{main['code'] or main['function']}` at {_short(main['file'])}:{main['line']}" if main \
        else "is outside the user's code"
    text = f"{name} {where} (step {answer.get('step', 0)}), not in a collective"
    last = answer.get("last_completed")
    if last is None:
        text += "; it has completed no collective"
    else:
        text += (f"; its last {_noun(last['kind'])}, #{last['seq']} {_kind(last)}"
                 f"{_bytes(last['nbytes'], ')', ' (')}, ended {last['seconds']:.0f} s ago")
    behind = [seq for seq in waited if last is None or seq > last["seq"]]
    if behind:
        text += f"; the others wait in #{behind[0]}: it has not reached that collective, or skipped it"
    return text


def _noun(kind: str) -> str:
    """What a record is: a ``"call"`` (an RPC call made or served) or a ``"collective"``."""
    return "call" if kind.startswith("rpc ") else "collective"


def _kind(record: Mapping[str, Any]) -> str:
    """A record's kind, with its peer for an RPC call (``"rpc push to ps 0"``)."""
    kind, peers = record["kind"], record.get("peers")
    return f"{kind} to {peers}" if peers and kind.startswith("rpc ") and not kind.startswith("rpc served") else kind


def _at(main: Mapping[str, Any] | None) -> str:
    return f"{_short(main['file'])}:{main['line']} `{main['code'] or main['function']}`" if main else ""


def _short(path: str) -> str:
    """``path`` relative to the current folder when it is below it."""
    if path.startswith("<"):
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _bytes(count: int, after: str = "", before: str = "") -> str:
    """``"4.2 MB"`` (between ``before`` and ``after``); nothing for 0 (unknown: an RPC call's)."""
    if not count:
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{before}{count / size:.1f} {unit}{after}"
    return f"{before}{count} B{after}"


def _names(names: Sequence[str]) -> str:
    """``"worker 0"``; ``"workers 0, 2 and 3"``; ``"chief and workers 0 and 1"``."""
    groups: dict[str, list[str]] = {}
    for name in names:
        kind, _, index = name.partition(" ")
        groups.setdefault(kind, []).append(index)
    parts = []
    for kind, indices in groups.items():
        indices = [i for i in indices if i]
        if not indices:
            parts.append(kind)
        else:
            parts.append(f"{kind}{'s' if len(indices) > 1 else ''} {_and(indices)}")
    return _and(parts)


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def write_stacks(answers: Mapping[str, Answer | None], silent: Mapping[str, str] | None = None,
                 path: str | os.PathLike[str] | None = None) -> str:
    """Every task's full stacks (every thread) and flight-recorder state, in one text file;
    returns its path (a new file in the temporary folder unless ``path``)."""
    if path is None:
        handle, path = tempfile.mkstemp(prefix=f"stratagem-stacks-{time.strftime('%Y%m%d-%H%M%S')}-",
                                        suffix=".txt")
        os.close(handle)
    parts = []
    for name, answer in answers.items():
        if answer is None:
            parts.append(f"=== {name}: did not answer: {(silent or {}).get(name, 'no answer came')}\n")
            continue
        flying = "".join(f"  in flight: #{r['seq']} {r['kind']} ({_bytes(r['nbytes'], ', ')}peers {r['peers']}, "
                         f"step {r['step']}) for {r['seconds']:.1f} s\n" for r in answer.get("in_flight", []))
        last = answer.get("last_completed")
        done = (f"  last completed: #{last['seq']} {last['kind']}{_bytes(last['nbytes'], ')', ' (')}, "
                f"{last['seconds']:.1f} s ago\n") if last else "  last completed: none\n"
        parts.append(f"=== {name} (pid {answer.get('pid')}, step {answer.get('step')})\n{flying}{done}\n"
                     f"{answer.get('stacks', '')}")
    Path(path).write_text("\n".join(parts))
    return os.fspath(path)


_last_report: list = [0.0, ""]   # (time.monotonic(), text) of this process's last report


def report(task: str) -> str:
    """For ``task``, whose collective just timed out: where every task of the job stands (only
    this one outside ``stratagem launch``) and the file with their stacks, as lines to add to
    its error. Takes up to :data:`ANSWER_SECONDS` (the same text again for ten seconds after:
    a script that catches the error and retries does not wait each time); never raises."""
    if _last_report[1] and time.monotonic() - _last_report[0] < 10.0:
        return _last_report[1]
    try:
        folder = os.environ.get(OBSERVE_VARIABLE)
        tasks = registered(folder) if folder else {}
        answers = ask(folder, tasks) if tasks else {task: snapshot(task)}
        silent = silent_reasons(folder, tasks, answers)
        text = f"{describe(answers, silent)}\nthe full stacks of every thread: {write_stacks(answers, silent)}"
        _last_report[:] = [time.monotonic(), text]
        return text
    except Exception as error:  # noqa: BLE001 - the error it adds to matters more
        return f"(where the tasks stand could not be found: {type(error).__name__}: {error})"
