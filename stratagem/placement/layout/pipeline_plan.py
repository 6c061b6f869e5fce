"""How a pipelined model is cut: the schedules, and each stage's layers and process.

:func:`plan_stages` checks a split against the schedule (stages per process, micro-batches)
and returns a :class:`StageLayout`, the same on every process: an ``nn.Sequential`` is cut
between its children (at the split points, or evenly); any other model at the modules its
split points name, which torch's tracer cuts at the first step
(:mod:`stratagem.placement.layout.pipeline_trace`). With ``split_points="auto"`` the layout is even
until the first step measures the blocks (:mod:`stratagem.placement.layout.pipeline_balance`); the
checks that depend on the stage count alone are made at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.pipeline_trace import even_edges, traced_split_points
from stratagem.placement.layout.recompute import Recompute, expand_names

#: schedule name -> (torch class name, stage placement: "loop" or "v", stages per process or None: any)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved": ("ScheduleInterleaved1F1B", "loop", None),
    "looped_bfs": ("ScheduleLoopedBFS", "loop", None),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop", None),
    "zero_bubble": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
}


def check_schedule(schedule: Any) -> str:
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise InvalidArgumentError(
            f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    return schedule.lower()


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """How one model is cut: ``bounds[s]`` is stage ``s``'s range of the model's children (nn.Sequential)."""

    bounds: tuple[tuple[int, int], ...]
    pipe_size: int
    style: str                       # "loop" or "v"
    points: tuple[str, ...] = ()     # a traced model's split points (bounds then index the stages)
    recompute: Recompute | None = None   # what each stage recomputes in its backward (names expanded)
    balance: str | None = None       # split_points="auto": the cost to balance at the first step (bounds even till then)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def rank_of(self, stage: int) -> int:
        """The pipe-axis process that holds ``stage``."""
        p = self.pipe_size
        if self.style == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]


def plan_stages(model: nn.Module, *, split_points: list[str] | str | None, num_stages: int | None,
                pipe_size: int, schedule: str, num_microbatches: int, recompute: Recompute | None = None,
                balance_by: str | None = None) -> StageLayout:
    """Validate the split of ``model`` for ``schedule`` and return its layout (same on every process)."""
    names = [name for name, _ in model.named_children()]
    _, style, per_rank = SCHEDULES[schedule]
    points: tuple[str, ...] = ()
    balance = None
    if split_points == "auto":   # even until measured; the count checked against the blocks now
        split_points, balance = None, balance_by or "time"
    if not isinstance(model, nn.Sequential):   # cut by the tracer: stage s begins at points[s - 1]
        count = num_stages if num_stages is not None else pipe_size * (per_rank or 2)
        points = tuple(traced_split_points(model, split_points, count))
        edges = list(range(len(points) + 2))
    elif split_points is not None:
        starts = []
        for point in split_points:
            if point not in names:
                raise InvalidArgumentError(
                    f"the split point {point!r} names no child of the model; split points name the "
                    f"children where a stage begins, among {names}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or 0 in starts:
            raise InvalidArgumentError(
                f"split points must name distinct children in model order, none of them the first "
                f"({names[0]!r}, where stage 0 always begins); got {split_points}")
        edges = [0, *starts, len(names)]
    else:
        count = num_stages if num_stages is not None else pipe_size * (per_rank or 2)
        if count > len(names):
            raise InvalidArgumentError(
                f"the pipeline needs {count} stages ({_why(num_stages, pipe_size, schedule)}), but the "
                f"model has only {len(names)} children to split; give a model with more layers, "
                f"fewer stages, or a schedule with one stage per process")
        edges = even_edges(len(names), count)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    layout = StageLayout(bounds, pipe_size, style, points, expand_names(model, recompute), balance)
    stages = layout.num_stages
    if stages % pipe_size or (per_rank is not None and stages != per_rank * pipe_size):
        want = f"{per_rank * pipe_size}" if per_rank else f"a multiple of {pipe_size}"
        raise InvalidArgumentError(
            f"the {schedule!r} schedule on {pipe_size} pipeline processes needs {want} stages "
            f"({per_rank or 'the same number of'} per process), but the split gives {stages}; "
            f"change split_points / num_stages")
    if schedule in ("1f1b", "dualpipev") and num_microbatches < stages:
        raise InvalidArgumentError(
            f"the {schedule!r} schedule needs at least as many micro-batches as stages: "
            f"num_microbatches={num_microbatches} but {stages} stages; raise num_microbatches")
    rounds = max(1, num_microbatches // pipe_size)
    if schedule in ("interleaved", "interleaved_zero_bubble") and num_microbatches % rounds:
        raise InvalidArgumentError(
            f"the {schedule!r} schedule runs num_microbatches in rounds of {pipe_size} (the pipeline "
            f"processes): num_microbatches={num_microbatches} must be below {pipe_size} or a multiple "
            f"of {rounds}; e.g. {rounds * pipe_size}")
    return layout


def _why(num_stages: int | None, pipe_size: int, schedule: str) -> str:
    if num_stages is not None:
        return f"num_stages={num_stages}"
    return f"{SCHEDULES[schedule][2] or 2} per process for {schedule!r} on {pipe_size} processes"
