"""The straggler, named: per worker, where a step's time goes, and which worker the others wait for.

Every worker keeps a step clock (:mod:`.record`: turned on by a collective over two or more
workers): per step, its length, its time waiting for input (``next`` on a distributed
iterator) and its time in the gradient exchange at the end of backward, where a worker that is
ahead waits for the slowest. :func:`step_report` gathers each worker's medians and 90th
percentiles and makes one short table; :func:`straggler` names the worker the others wait for:
the one that waits least in collectives while the others wait clearly longer (more than a
tenth of a step, and 1 ms). Its own time then goes to compute or to its input, and the table
says which.

Example::

    from stratagem.observe.report import format_report, summarize
    fast = summarize([(i, 0.100, 0.001, 0.060, 0.06, 4096) for i in range(10)], worker=0)
    slow = summarize([(i, 0.100, 0.061, 0.001, 0.00, 4096) for i in range(10)], worker=1)
    text = format_report([fast, slow])
    assert "straggler: worker 1" in text and "waiting for input" in text
"""

from __future__ import annotations

from typing import Any, Sequence

from stratagem.observe import record

__all__ = ["format_report", "median", "step_report", "straggler", "summarize"]

_PARTS = ("step", "compute", "wait", "input")


def _quantiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return (0.0, 0.0)
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return (median, p90)


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (0 for none)."""
    return _quantiles(list(values))[0]


def summarize(steps: Sequence[tuple], worker: int) -> dict[str, Any]:
    """One worker's medians and 90th percentiles (seconds) of ``steps`` (the step clock's entries:
    ``(number, seconds, input, wait, exchange, bytes)``); its first step (start-up) is left out
    when there are more than two."""
    steps = list(steps)[1:] if len(steps) > 2 else list(steps)
    columns: dict[str, list[float]] = {part: [] for part in _PARTS}
    for _, total, waiting_input, waiting, _exchange, _bytes in steps:
        columns["step"].append(total)
        columns["input"].append(waiting_input)
        columns["wait"].append(waiting)
        columns["compute"].append(max(0.0, total - waiting_input - waiting))
    summary: dict[str, Any] = {"worker": worker, "steps": len(steps)}
    summary.update({part: _quantiles(values) for part, values in columns.items()})
    summary["bytes"] = _quantiles([float(s[5]) for s in steps])[0]
    return summary


def straggler(summaries: Sequence[dict]) -> int | None:
    """The worker the others wait for, or None (one worker, no steps, or no clear one)."""
    ready = [s for s in summaries if s["steps"]]
    if len(ready) < 2:
        return None
    least = min(ready, key=lambda s: s["wait"][0])
    others = [s["wait"][0] for s in ready if s is not least]
    step = max(s["step"][0] for s in ready)
    gap = min(others) - least["wait"][0]
    return least["worker"] if gap > max(0.1 * step, 0.001) else None


def format_report(summaries: Sequence[dict]) -> str:
    """The table: a row per worker, median (p90) milliseconds of a step and its parts, and a
    last line naming the straggler and where its time goes."""
    steps = min((s["steps"] for s in summaries), default=0)
    lines = [f"step report: {steps} steps on {len(summaries)} worker{'s' if len(summaries) != 1 else ''} "
             f"(median (p90) ms per step)",
             f"{'':<10}{'step':>16}{'compute':>16}{'collectives':>16}{'input':>16}"]
    for s in summaries:
        cells = "".join(f"{s[part][0] * 1e3:>9.1f} ({s[part][1] * 1e3:>4.0f})" for part in _PARTS)
        lines.append(f"{_who(s['worker']):<10}{cells}")
    slow = straggler(summaries)
    if slow is None:
        lines.append("straggler: none (the workers wait about as long for each other)" if len(summaries) > 1
                     else "straggler: none (one worker)")
        return "\n".join(lines)
    mine = next(s for s in summaries if s["worker"] == slow)
    others = [s for s in summaries if s["worker"] != slow]
    waited = sum(s["wait"][0] for s in others) / len(others) - mine["wait"][0]
    extra_input = mine["input"][0] - sum(s["input"][0] for s in others) / len(others)
    extra_compute = mine["compute"][0] - sum(s["compute"][0] for s in others) / len(others)
    cause = (f"waiting for input ({mine['input'][0] * 1e3:.1f} ms a step)" if extra_input >= extra_compute
             else f"compute ({mine['compute'][0] * 1e3:.1f} ms a step)")
    lines.append(f"straggler: {_who(slow)} -- the others wait {waited * 1e3:.1f} ms a step for it in "
                 f"collectives; its extra time goes to {cause}")
    return "\n".join(lines)


def _who(worker: Any) -> str:
    """``worker 1`` for a worker index; a task's name (read from a trace) as it is."""
    return f"worker {worker}" if isinstance(worker, int) else str(worker)


def step_report(strategy: Any, since: int = 0) -> str:
    """The table of this job's steps (after step number ``since``), gathered over the workers.

    Every worker must call it (it is one collective); each gets the same text. With the step
    clock off (one worker, and no timeline) the table has no steps."""
    mine = summarize([s for s in record.STEPS if s[0] >= since], worker=strategy.topology.worker_index)
    everyone = [mine]
    if strategy.topology.num_workers > 1:
        everyone = strategy.collective.all_gather_object(mine, "experimental_step_report")
    return format_report(everyone)
