"""The layouts a number of processes allows, each one configuration of ``PipelineStrategy``.

Every layout is a ``{"data": d, "pipe": p, "model": t}`` mesh with ``d * p * t`` processes, a ZeRO
stage over the data axis (``sharding=``, only where ``d > 1``), recomputation or not, a
micro-batch count and a schedule (only where ``p > 1``: ``p`` or ``2 p`` micro-batches, GPipe or
1F1B), and where the stages begin. All of them run the same training script -- a step calls
``strategy.forward_backward(model, x, y)`` -- so a layout is pinned by one line of code
(:meth:`Layout.code`).

Which layouts are enumerated: ``p > 1`` needs an ``nn.Sequential`` with at least ``p`` places to
cut (a cut never falls between a plan's ``"colwise"`` child and the ``"rowwise"`` one that closes
it); ``t > 1`` needs a tensor-parallel plan, and ``sharding=`` an ``nn.Sequential`` too (as
``PipelineStrategy`` does); ``d`` must divide the global batch, and each data replica's rows fill
the micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from stratagem.experimental.planning.memory import style_of
from stratagem.placement.layout.pipeline_balance import partition
from stratagem.strategies.pipeline import PipelineStrategy

SHARDINGS = (None, "optimizer", "gradients", "parameters")
_ZERO = {None: "", "optimizer": " zero-1", "gradients": " zero-2", "parameters": " zero-3"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One configuration of ``sg.experimental.PipelineStrategy`` (see :meth:`code`)."""

    data: int
    pipe: int
    model: int
    sharding: str | None = None
    recompute: bool = False
    num_microbatches: int = 1
    schedule: str = "gpipe"
    split_points: tuple[str, ...] = ()

    @property
    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "pipe": self.pipe, "model": self.model}

    def describe(self) -> str:
        """A short name: ``2x1x1 zero-1``, ``1x2x1 1f1b m=4 recompute``."""
        text = f"{self.data}x{self.pipe}x{self.model}{_ZERO[self.sharding]}"
        if self.pipe > 1 and self.num_microbatches > 1:   # (a refused mesh has no schedule: just "1x4x1")
            text += f" {self.schedule} m={self.num_microbatches}"
        return text + (" recompute" if self.recompute else "")

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``PipelineStrategy`` besides ``loss_fn`` and ``plan``."""
        options: dict[str, Any] = {"num_microbatches": self.num_microbatches, "schedule": self.schedule}
        if self.split_points:
            options["split_points"] = list(self.split_points)
        if self.sharding is not None:
            options["sharding"] = self.sharding
        if self.recompute:
            options["recompute"] = True
        return options

    def code(self, *, plan_name: str = "tensor_plan") -> str:
        """The line that builds this layout: ``sg.experimental.PipelineStrategy({...}, ..., loss_fn=loss_fn)``.

        Example::

            from stratagem.experimental.planning.layouts import Layout
            print(Layout(2, 1, 1, sharding="optimizer").code())
            # sg.experimental.PipelineStrategy({'data': 2, 'pipe': 1, 'model': 1}, num_microbatches=1,
            #     schedule='gpipe', sharding='optimizer', loss_fn=loss_fn)
        """
        options = "".join(f", {k}={v!r}" for k, v in self.options().items())
        plan = f", plan={plan_name}" if self.model > 1 else ""
        return f"sg.experimental.PipelineStrategy({self.mesh!r}{options}{plan}, loss_fn=loss_fn)"

    def strategy(self, *, loss_fn: Callable, plan: dict[str, Any] | None = None) -> Any:
        """Build this layout's ``PipelineStrategy`` (every process of the cluster calls it)."""
        return PipelineStrategy(self.mesh, **self.options(), plan=plan if self.model > 1 else None, loss_fn=loss_fn)


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every ``(d, p, t)`` with ``d * p * t == world``, data parallelism first."""
    found = [(d, p, world // (d * p)) for d in range(world, 0, -1) if world % d == 0
             for p in range(1, world // d + 1) if (world // d) % p == 0]
    return found


def cut_units(names: Sequence[str], plan: dict[str, Any] | None) -> list[list[int]]:
    """The blocks grouped where no cut may fall: from a ``"colwise"`` child to the ``"rowwise"`` one after it."""
    units: list[list[int]] = []
    open_pair = False
    for i, name in enumerate(names):
        if open_pair:
            units[-1].append(i)
        else:
            units.append([i])
        style = style_of(name, plan)
        if style == "colwise":
            open_pair = True
        elif style == "rowwise":
            open_pair = False
    return units


def balanced_points(names: Sequence[str], costs: Sequence[float], plan: dict[str, Any] | None,
                    stages: int) -> tuple[str, ...] | None:
    """Where ``stages`` stages begin so that the slowest is as fast as it can be, or None (too few units)."""
    units = cut_units(names, plan)
    if len(units) < stages:
        return None
    edges = partition([sum(costs[i] for i in unit) for unit in units], stages)
    return tuple(names[units[e][0]] for e in edges[1:-1])


def enumerate_layouts(world: int, *, names: Sequence[str], sequential: bool, costs: Sequence[float],
                      plan: dict[str, Any] | None, global_batch: int) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """The layouts of ``world`` processes, and those refused before any prediction with the reason.

    Example::

        from stratagem.experimental.planning.layouts import enumerate_layouts
        names = ["0", "1", "2"]   # an nn.Sequential's children
        layouts, refused = enumerate_layouts(2, names=names, sequential=True, costs=[1.0, 0.0, 1.0],
                                             plan=None, global_batch=8)
        assert {l.describe() for l in layouts} >= {"2x1x1", "2x1x1 zero-3", "1x2x1 1f1b m=4"}
        assert any("plan" in why for _, why in refused)   # 1x1x2 needs a tensor-parallel plan
    """
    layouts: list[Layout] = []
    refused: list[tuple[Layout, str]] = []
    for d, p, t in factorizations(world):
        base = Layout(d, p, t)
        if t > 1 and not plan:
            refused.append((base, "a model axis needs a tensor-parallel plan (tensor_plan=...)"))
            continue
        if (p > 1 or t > 1) and not sequential:
            refused.append((base, "pipeline and tensor parallelism need an nn.Sequential model"))
            continue
        if global_batch % d:
            refused.append((base, f"global_batch={global_batch} does not split over {d} data replicas"))
            continue
        points: tuple[str, ...] = ()
        if p > 1:
            found = balanced_points(names, costs, plan, p)
            if found is None:
                refused.append((base, f"{p} stages need {p} places to cut; the model has "
                                      f"{len(cut_units(names, plan))}"))
                continue
            points = found
        rows = global_batch // d
        shardings = SHARDINGS if d > 1 and sequential else (None,)   # ZeRO under a pipeline: nn.Sequential
        micro = [m for m in (p, 2 * p) if m <= rows] if p > 1 else [1]
        if not micro:
            refused.append((base, f"{rows} rows per data replica cannot fill {p} micro-batches"))
            continue
        schedules = ("1f1b", "gpipe") if p > 1 else ("gpipe",)
        layouts += [Layout(d, p, t, sharding=s, recompute=r, num_microbatches=m, schedule=k, split_points=points)
                    for s in shardings for r in (False, True) for m in micro for k in schedules]
    return layouts, refused
