"""What the timeline tests check of a trace: it nests, and each step's spans add up to the step."""

from __future__ import annotations

from collections import defaultdict


def spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def process_names(trace: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}


def assert_nested(trace: dict) -> None:
    """On every track, two spans are either one inside the other or apart (to 1 us: a wall-clock
    timestamp in microseconds, a float near 1.8e15, has a resolution of 0.25 us)."""
    tracks = defaultdict(list)
    for e in spans(trace):
        assert e["dur"] >= 0 and isinstance(e["ts"], (int, float)), e
        tracks[(e["pid"], e["tid"])].append(e)
    for track, own in tracks.items():
        stack: list[dict] = []
        for e in sorted(own, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1.0:
                stack.pop()
            if stack:
                outer = stack[-1]
                assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1.0, \
                    f"on track {track}, {e['name']} at {e['ts']} overlaps {outer['name']} without nesting in it"
            stack.append(e)


def children(trace: dict, step: dict) -> list[dict]:
    """The spans directly inside ``step`` on its track."""
    end = step["ts"] + step["dur"]
    inside = [e for e in spans(trace) if e["pid"] == step["pid"] and e["tid"] == step["tid"] and e is not step
              and e["ts"] >= step["ts"] - 1.0 and e["ts"] + e["dur"] <= end + 1.0]
    return [e for e in inside if not any(o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                                         and o["dur"] > e["dur"] for o in inside)]


def assert_steps_add_up(trace: dict, tolerance: float = 0.05) -> int:
    """The steps' direct spans (their input, run, callbacks) cover the steps within ``tolerance``
    (over all steps: a thread descheduled for a while in the few microseconds a step spends
    outside its spans on a busy machine is one step's bad luck, not a gap in the spans); the
    number of steps checked."""
    steps = [e for e in spans(trace) if e["name"] == "step"]
    assert steps, "the trace has no steps"
    covered = total = 0.0
    for step in steps:
        inside = sum(e["dur"] for e in children(trace, step))
        assert inside <= step["dur"] + 1.0
        covered, total = covered + inside, total + step["dur"]
    assert covered >= (1 - tolerance) * total, (
        f"the steps' spans cover {covered:.0f} of {total:.0f} us: "
        f"{[[(e['name'], round(e['dur'])) for e in children(trace, step)] for step in steps]}")
    return len(steps)
