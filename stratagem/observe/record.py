"""The recorder: spans of each step, kept per thread, and the step clock behind the straggler table.

Off by default, and then nearly free: every site reads the one flag :data:`ON` (profiler labels
through :func:`stratagem._profiling.label`, the other sites through :func:`span`) and does
nothing more. Two things turn it on:

- the **timeline** (:func:`start`: ``sg.experimental.Timeline``, or ``stratagem launch
  --timeline``, which sets ``STRATAGEM_TIMELINE_DIR`` for every task): every span is kept, as
  ``(name, category, track, start, end, args)`` with ``time.perf_counter_ns`` times, and turned
  into Chrome trace events (:func:`chrome_events`) on wall-clock microseconds;
- the **step clock** (:func:`count_steps`, turned on by a collective over two or more workers):
  per step of the main thread, its length and its time waiting for input and in the gradient
  exchange (:data:`STEPS`, read by ``strategy.experimental_step_report()``).

What a step is: the time from the end of one ``strategy.run`` on the main thread to the end of
the next (the first step starts where its ``run`` starts). So a step holds the wait for its
input, the run (forward, backward, the packs' exchange, the optimizer step) and whatever the
loop does between runs (callbacks, logging); the spans of a step nest inside its ``step`` span.

Clocks: each process anchors ``perf_counter_ns`` to the wall clock (``time.time_ns``) once, at
import; events carry wall-clock microseconds. Processes on one host share that clock, so their
tracks line up to within microseconds (the anchor's two reads); across hosts they line up as well
as the hosts' clocks agree (NTP).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque
from typing import Any

from stratagem.observe import flight
from stratagem.observe.chrome import FOLDER_VARIABLE

__all__ = ["ON", "STEPS", "Span", "add", "chrome_events", "count_steps", "follow_environment", "span", "start", "stop",
           "take"]

#: True while anything records: the sites check this one flag and nothing else when it is off.
ON = False
#: True while the timeline keeps its events (the step clock alone keeps only per-step sums).
TIMELINE = False
_COUNTING = False
_COUNT_ASKED = False

now = time.perf_counter_ns
_PERF0, _WALL0 = time.perf_counter_ns(), time.time_ns()
# the flight recorder's clock (time.monotonic) in ours: the same clock where both read CLOCK_MONOTONIC
_SAME_CLOCK = time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation
_MONO_OFFSET = 0 if _SAME_CLOCK else time.perf_counter_ns() - int(time.monotonic() * 1e9)
_MAIN = threading.main_thread().ident

#: the categories of the profiler labels that the step clock and the picture tell apart
CATEGORIES = {"stratagem.gradients.sync": "wait", "stratagem.optimizer.step": "optimizer",
              "stratagem.run": "run", "stratagem.ps.closure": "closure", "stratagem.ps.schedule": "closure",
              "stratagem.ps.pull": "ps", "stratagem.ps.push": "ps", "stratagem.rpc.call": "rpc",
              "stratagem.rpc.handle": "rpc"}

_EVENTS: list[tuple] = []          # (name, category, track, t0, t1, args): list.append is atomic
_THREADS: dict[Any, str] = {}      # track (a thread's ident, or a name) -> its name in the trace


class _Clock:
    """The current step's sums, on the main thread."""

    __slots__ = ("start", "input", "wait", "exchange", "bytes", "count")

    def __init__(self) -> None:
        self.start: int | None = None
        self.input = self.wait = self.exchange = 0
        self.bytes = self.count = 0


_CLOCK = _Clock()
#: the last steps, each ``(number, seconds, input_s, wait_s, exchange_s, bytes)``
STEPS: deque = deque(maxlen=4096)


class Span:
    """One span: entered, left, recorded (a torch profiler range too while a profiler runs)."""

    __slots__ = ("name", "cat", "args", "t0", "inner")

    def __init__(self, name: str, cat: str, args: dict | None = None, inner: Any = None) -> None:
        self.name, self.cat, self.args, self.inner = name, cat, args, inner

    def __enter__(self) -> "Span":
        if self.inner is not None:
            self.inner.__enter__()
        self.t0 = now()
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = now()
        if self.inner is not None:
            self.inner.__exit__(*exc)
        add(self.name, self.cat, self.t0, t1, self.args)


class _Noop:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NOOP = _Noop()


def span(name: str, cat: str = "compute", args: dict | None = None) -> Any:
    """``with span("forward"):`` records a span while the recorder is on; a shared no-op otherwise."""
    return Span(name, cat, args) if ON else _NOOP


def add(name: str, cat: str, t0: int, t1: int, args: dict | None = None, track: str | None = None) -> None:
    """Record a span that ran from ``t0`` to ``t1`` (``now()`` times) on this thread, or on the
    named ``track`` (``"exchange"``: the packs in flight beside backward)."""
    ident = threading.get_ident()
    if _COUNTING:
        _count(name, cat, ident, t0, t1, args)
    if TIMELINE:
        where = ident if track is None else track
        if where not in _THREADS:
            _THREADS[where] = threading.current_thread().name if track is None else track
        _EVENTS.append((name, cat, where, t0, t1, args))


def watch_stage(stage: Any, index: int) -> Any:
    """``stage`` (torch's ``PipelineStage``), whose micro-batches go on the timeline's lane
    ``stage <index>`` while it records: each chunk's forward, backward (and weight backward under
    zero-bubble schedules), so the pipeline's bubble shows. Wraps the three methods of this
    object only (one flag check a chunk while off)."""
    for method, name in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                         ("backward_weight_one_chunk", "backward (weights)")):
        inner = getattr(stage, method, None)
        if inner is not None:
            setattr(stage, method, _stage_chunk(inner, name, index))
    return stage


def _stage_chunk(inner: Any, name: str, index: int) -> Any:
    track = f"stage {index}"

    def chunk(*args: Any, **kwargs: Any) -> Any:
        if not ON:
            return inner(*args, **kwargs)
        t0 = now()
        try:
            return inner(*args, **kwargs)
        finally:
            number = args[0] if args else next(iter(kwargs.values()), None)   # (the micro-batch's index)
            add(name, "stage", t0, now(), {"stage": index, "microbatch": number}, track=track)
    return chunk


def _count(name: str, cat: str, ident: int, t0: int, t1: int, args: dict | None) -> None:
    clock = _CLOCK
    if cat == "exchange":
        clock.exchange += t1 - t0
        clock.bytes += (args or {}).get("bytes", 0)
    elif cat == "wait":
        if not threading.current_thread().name.startswith("stratagem-replica"):   # (replica 0's counts)
            clock.wait += t1 - t0
    elif ident != _MAIN:
        return
    elif cat == "input":
        clock.input += t1 - t0
    elif name == "stratagem.run":
        start = t0 if clock.start is None else clock.start
        STEPS.append((clock.count, (t1 - start) / 1e9, clock.input / 1e9, clock.wait / 1e9, clock.exchange / 1e9,
                      clock.bytes))
        if TIMELINE:
            _EVENTS.append(("step", "step", ident, start, t1, {"step": clock.count}))
        clock.count += 1
        clock.start, clock.input, clock.wait, clock.exchange, clock.bytes = t1, 0, 0, 0, 0


def _set(timeline: bool | None = None, counting: bool | None = None) -> None:
    global ON, TIMELINE, _COUNTING, _COUNT_ASKED, _LISTENING
    if timeline is not None:
        TIMELINE = timeline
    if counting is not None:
        _COUNT_ASKED = counting
    _COUNTING = _COUNT_ASKED or TIMELINE   # (a timeline's step spans come from the clock)
    ON = _COUNTING
    if ON and _LISTENING is None:   # the collectives, as the flight recorder sees them end
        _LISTENING = flight.add_listener(_collective)
    elif not ON and _LISTENING is not None:
        _LISTENING()
        _LISTENING = None


_LISTENING: Any = None   # the flight recorder's remover of our listener, while attached
_LANES: dict[str, list[int]] = {}   # each lane family's last ends: spans in flight together get a lane each
_LANES_LOCK = threading.Lock()


def _collective(r: "flight.Record") -> None:
    """A collective ended (the flight recorder's listener): a gradient pack on an exchange lane,
    from its launch during backward to its sum; any other on the thread that waited for it."""
    if r.end_monotonic is None or r.kind.startswith("rpc served"):   # (a call served: its handler's span shows it)
        return
    t0 = round(r.start_monotonic * 1e9) + _MONO_OFFSET
    t1 = round(r.end_monotonic * 1e9) + _MONO_OFFSET
    args = {"seq": r.seq, "bytes": r.nbytes, "peers": r.peers}
    pack = r.kind == "gradient all_reduce"
    if not pack and r.thread == threading.get_ident():   # a blocking call: it nests in its thread's spans
        add(r.kind, "collective", t0, t1, args)
        return
    # a pack outlives the backward that launched it, an asynchronous call ends on another thread:
    # each on a lane of its family, the first one free
    family = "exchange" if pack else "in flight"
    with _LANES_LOCK:
        lanes = _LANES.setdefault(family, [])
        lane = next((i for i, end in enumerate(lanes) if end <= t0), len(lanes))
        if lane == len(lanes):
            lanes.append(t1)
        lanes[lane] = t1
    add("exchange" if pack else r.kind, "exchange" if pack else "collective", t0, t1, args,
        track=f"{family} {lane}")


def new_epoch() -> None:
    """The next step starts now (``fit`` at each epoch: what ran between epochs is no step's)."""
    if ON and threading.get_ident() == _MAIN:
        clock = _CLOCK
        clock.start, clock.input, clock.wait, clock.exchange, clock.bytes = now(), 0, 0, 0, 0


def steps_done() -> int:
    """How many steps the clock has counted in this process."""
    return _CLOCK.count


def count_steps(on: bool = True) -> None:
    """Keep the step clock (:data:`STEPS`) from now on (``on=False``: stop, unless a timeline
    is open): cheap sums per step, no events."""
    _set(counting=on)


def start() -> None:
    """Start keeping the timeline's events (and the step clock)."""
    _CLOCK.start = None
    _set(timeline=True)


def stop() -> None:
    """Stop keeping events (the step clock goes on if a collective asked for it)."""
    _set(timeline=False)


def take() -> tuple[list[tuple], dict[Any, str]]:
    """The events kept so far (removed from the recorder) and the names of their tracks."""
    count = len(_EVENTS)
    taken = _EVENTS[:count]
    del _EVENTS[:count]
    return taken, dict(_THREADS)


def chrome_events(events: list[tuple], threads: dict[Any, str], pid: int = 0,
                  numbers: dict[Any, int] | None = None) -> list[dict]:
    """Chrome trace events (``"ph": "X"``, microseconds of wall-clock time) of ``events``, with a
    ``thread_name`` metadata event per new track; tracks are numbered in the order they first
    appear (the main thread first), in ``numbers`` when given (kept from call to call)."""
    numbers = {} if numbers is None else numbers
    out: list[dict] = []

    def number(track: Any) -> int:
        if track not in numbers:
            numbers[track] = len(numbers)
            name = "main" if track == _MAIN else threads.get(track, str(track))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": numbers[track],
                        "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": numbers[track],
                        "args": {"sort_index": numbers[track]}})
        return numbers[track]

    if any(e[2] == _MAIN for e in events):
        number(_MAIN)
    for name, cat, track, t0, t1, args in events:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": number(track),
                 "ts": (t0 - _PERF0 + _WALL0) / 1e3, "dur": (t1 - t0) / 1e3}
        if args:
            event["args"] = args
        out.append(event)
    return out


def task_name(environ: Any = os.environ) -> str:
    """This process's task in the trace: ``"worker 1"`` (TF_CONFIG), ``"rank 1"`` (torchrun), or
    ``"process PID"``."""
    try:
        task = json.loads(environ.get("TF_CONFIG", "") or "{}").get("task") or {}
    except ValueError:
        task = {}
    if "type" in task:
        return f"{task['type']} {task.get('index', 0)}"
    if "RANK" in environ:
        return f"rank {environ['RANK']}"
    return f"process {os.getpid()}"


class _FolderWriter:
    """``stratagem launch --timeline``: this task's events appended to ``FOLDER/<task>.jsonl``
    every second and at exit (a task killed loses its last second), for the launcher to merge."""

    def __init__(self, folder: str) -> None:
        self.name = task_name()
        stem = self.name.replace(" ", "-")
        self.path = os.path.join(folder, f"{stem}-{os.getpid()}.jsonl")
        self.lock = threading.Lock()
        self.numbers: dict[Any, int] = {}
        self.pid = os.getpid()
        with open(self.path, "w") as f:
            f.write(json.dumps({"task": self.name, "pid": os.getpid()}) + "\n")
        start()
        atexit.register(self.flush)
        threading.Thread(target=self._loop, daemon=True, name="stratagem-timeline").start()

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            self.flush()

    def flush(self) -> None:
        if os.getpid() != self.pid:   # a forked child (a DataLoader worker) holds a copy of our events
            return
        with self.lock:
            events, threads = take()
            if not events:
                return
            with open(self.path, "a") as f:
                for event in chrome_events(events, threads, numbers=self.numbers):
                    f.write(json.dumps(event) + "\n")


_WRITER: _FolderWriter | None = None


def follow_environment() -> None:
    """Record for ``stratagem launch --timeline`` when this process's environment names the
    launcher's folder (``STRATAGEM_TIMELINE_DIR``), once: what importing this module does. A
    process that imported it before it had its task's environment (a task forked from the test
    fork server, :mod:`stratagem.testing.forked`) calls it once it has."""
    global _WRITER
    if _WRITER is None and os.environ.get(FOLDER_VARIABLE):
        _WRITER = _FolderWriter(os.environ[FOLDER_VARIABLE])


follow_environment()


def launched() -> bool:
    """Whether this task records for ``stratagem launch --timeline`` (which writes the trace)."""
    return _WRITER is not None
