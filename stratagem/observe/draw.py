"""A picture of a trace without a browser, and the straggler table read back from a trace.

:func:`draw` makes a PNG (matplotlib, the ``stratagem[timeline]`` extra): a lane per track of
each task (its main thread, replica threads, the packs' exchange, a dispatcher per worker),
spans colored by kind, nested spans drawn thinner on top of the spans that hold them, so a
worker's wait in the gradient exchange (red) beside another's wait for input (purple) shows
who waits for whom. :func:`trace_steps` reads each task's steps back from the trace for
:func:`stratagem.observe.report.format_report`.

Example::

    from stratagem.observe.draw import trace_steps
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "worker 0"}},
              {"name": "step", "cat": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 100},
              {"name": "input", "cat": "input", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 30}]
    steps = trace_steps({"traceEvents": events})
    assert [[round(x, 6) for x in row] for row in steps["worker 0"]] == [[0, 0.0001, 0.00003, 0, 0, 0]]
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["COLORS", "draw", "trace_steps"]

#: the color of each kind of span (by name first, then by category)
COLORS = {"step": "#e8e8e8", "run": "#c8c8c8", "forward": "#4c72b0", "backward": "#dd8452",
          "optimizer": "#55a868", "wait": "#c44e52", "input": "#8172b3", "exchange": "#937860",
          "checkpoint": "#222222", "closure": "#64b5cd", "ps": "#ccb974", "rpc": "#a6a6a6",
          "metrics": "#b5cf6b", "collective": "#e377c2", "stage": "#4c72b0", "compute": "#9ecae1"}


def _kind(event: dict) -> str:
    name, cat = event.get("name", ""), event.get("cat", "")
    return name if name in COLORS else cat if cat in COLORS else "compute"


def _names(events: list[dict]) -> tuple[dict, dict]:
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return processes, threads


def trace_steps(trace: dict) -> dict[str, list[tuple]]:
    """Each task's steps, as the step clock keeps them (``(number, seconds, input, wait,
    exchange, bytes)``): the ``step`` spans of its main track, with the input and
    collective-wait spans inside each."""
    events = trace["traceEvents"]
    processes, _ = _names(events)
    spans = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            spans[e["pid"]].append(e)
    found: dict[str, list[tuple]] = {}
    for pid, own in spans.items():
        steps = sorted((e for e in own if e["name"] == "step"), key=lambda e: e["ts"])
        if not steps:
            continue
        main = steps[0]["tid"]
        rows = []
        for number, step in enumerate(steps):
            start, end = step["ts"], step["ts"] + step["dur"]

            def within(cat: str, on_main: bool = True) -> list[dict]:
                return [e for e in own if e.get("cat") == cat and start <= e["ts"] < end
                        and (e["tid"] == main or not on_main)]
            waited = sum(e["dur"] for e in within("input")) / 1e6
            collective = sum(e["dur"] for e in within("wait")) / 1e6
            exchanges = within("exchange", on_main=False)
            rows.append((number, step["dur"] / 1e6, waited, collective, sum(e["dur"] for e in exchanges) / 1e6,
                         sum(e.get("args", {}).get("bytes", 0) for e in exchanges)))
        found[processes.get(pid, f"process {pid}")] = rows
    return found


def _depths(spans: list[dict]) -> list[int]:
    """How deep each span (sorted by start) lies inside the others of its track."""
    depths, open_ends = [], []
    for e in spans:
        end = e["ts"] + e["dur"]
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(end)
    return depths


def draw(trace: dict, out: str, *, title: str = "", width: float = 14.0, everything: bool = False) -> str:
    """Draw ``trace`` to the PNG file ``out``; return ``out``. Only the stretch from the first
    step to the end of the last one (the first closure to the last under a parameter-server
    coordinator), unless ``everything`` (start-up and shutdown too) or the trace has neither. Needs matplotlib (``pip install 'stratagem[timeline]'``): an ImportError
    says so."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("drawing a timeline needs matplotlib: pip install 'stratagem[timeline]' (or "
                          "matplotlib); or open the JSON in https://ui.perfetto.dev") from err
    events = trace["traceEvents"]
    processes, threads = _names(events)
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace holds no spans to draw: did the job run a step while the timeline was on?")
    # the steps (a parameter-server coordinator: the closures it sent) set the stretch drawn
    steps = [e for e in spans if e["name"] == "step"] or [e for e in spans if e["name"] == "closure"]
    if steps and not everything:   # the steps' stretch: what start-up and shutdown would squeeze
        first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
        spans = [e for e in spans if e["ts"] < last and e["ts"] + e["dur"] > first]
    origin = min(e["ts"] for e in steps) if steps and not everything else min(e["ts"] for e in spans)
    lanes = sorted({(e["pid"], e["tid"]) for e in spans})
    row = {lane: i for i, lane in enumerate(lanes)}
    figure, axes = plt.subplots(figsize=(width, 1.0 + 0.45 * len(lanes)))
    seen = set()
    for lane in lanes:
        own = sorted((e for e in spans if (e["pid"], e["tid"]) == lane), key=lambda e: (e["ts"], -e["dur"]))
        for e, depth in zip(own, _depths(own)):
            kind = _kind(e)
            seen.add(kind)
            height = max(0.2, 0.8 - 0.18 * depth)
            axes.broken_barh([((e["ts"] - origin) / 1e3, max(e["dur"] / 1e3, 1e-3))],
                             (row[lane] - height / 2, height), facecolors=COLORS[kind], linewidth=0)
    if steps and not everything:
        axes.set_xlim(-0.01 * (last - first) / 1e3, 1.01 * (last - first) / 1e3)
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"{processes.get(p, p)} / {threads.get((p, t), t)}" for p, t in lanes])
    axes.invert_yaxis()
    axes.set_xlabel(f"milliseconds from the first {steps[0]['name']}" if steps and not everything else
                    "milliseconds from the first span")
    axes.legend(handles=[Patch(color=COLORS[k], label=k) for k in COLORS if k in seen],
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes.set_title(title or "stratagem timeline")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
