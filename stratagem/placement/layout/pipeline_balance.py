"""Balanced stages: ``split_points="auto"`` cuts a model where its blocks' measured costs come out even.

The blocks are the children of an ``nn.Sequential``, or, for a model with its own ``forward``,
the entries of its longest ``nn.ModuleList``: torch's tracer cuts the model before each of them
(:func:`~stratagem.placement.layout.pipeline_trace.trace`), so the first piece also holds what
``forward`` does before the list and the last what it does after, as the first and last stage
will. Their cost (``balance_by``):

- ``"time"``: seconds of forward and backward of each block on the first step's micro-batch,
  on this process's device (each block fed what the blocks before it output); the median of
  :data:`ROUNDS` rounds, each measuring every block in turn, so that a busy moment of the
  machine slows all blocks alike;
- ``"memory"``: bytes of each block's parameters, their gradients, its buffers, and the
  tensors its forward saves for the backward of one micro-batch (each storage once).

:func:`partition` then chooses the contiguous stages whose costliest stage is the cheapest
possible. Measuring leaves the model as it was: gradients come from ``torch.autograd.grad``
(no ``.grad`` is written), buffers (BatchNorm's statistics) are copied back, and the random
generators are forked, so that the first step draws what it would draw with the split pinned.

Every process must cut alike (the data groups too, whose gradients are summed stage by stage):
global rank 0 measures and broadcasts the split to every process, which all raise if it could
not. Rank 0 prints the split once, in the form ``split_points=`` takes to pin it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.pipeline_plan import StageLayout
from stratagem.placement.layout.pipeline_trace import even_edges, longest_list, stage_module, trace

#: rounds of timing (each times every block once), after one warm-up round
ROUNDS = 5
BALANCE_BY = ("time", "memory")


def partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Where the stages of an optimal contiguous split of ``costs`` begin, and the end: ``[0, ..., len(costs)]``.

    Optimal: the costliest stage is as cheap as it can be (the bottleneck). Among the splits with
    that bottleneck, the one whose stage costs have the least sum of squares (the other stages
    even too); then the one whose block counts do (free blocks spread evenly); then the one
    whose earlier stages hold more blocks (as an even split of equal blocks does). Dynamic
    programming over the prefix sums, O(num_stages * len(costs)^2).
    """
    n = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise InvalidArgumentError(f"the number of stages must be a positive integer, got {num_stages!r}")
    if n < num_stages:
        raise InvalidArgumentError(
            f"{num_stages} stages need at least {num_stages} blocks to split, got {n}; give fewer stages or a model "
            f"with more blocks")
    if any(not (c >= 0 and c != float("inf")) for c in costs):
        raise InvalidArgumentError(f"block costs must be finite and non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # worst[k][j]: the least bottleneck of blocks j.. in k stages
    inf = float("inf")
    worst = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    worst[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(n - k, -1, -1):
            worst[k][j] = min(max(cost(j, e), worst[k - 1][e]) for e in range(j + 1, n - k + 2))
    bottleneck = worst[num_stages][0]
    # best[k][j]: (the sums of squares of the stages' costs and of their block counts, the edges as
    # negatives) of blocks j.. in k stages, none above the bottleneck: the least is the best
    best: list[list[Any]] = [[None] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = (0.0, 0, ())
    for k in range(1, num_stages + 1):
        for j in range(n - k, -1, -1):
            options = [(cost(j, e) ** 2 + rest[0], (e - j) ** 2 + rest[1], (-e,) + rest[2])
                       for e in range(j + 1, n - k + 2)
                       if cost(j, e) <= bottleneck and (rest := best[k - 1][e]) is not None]
            best[k][j] = min(options) if options else None
    return [0, *(-e for e in best[num_stages][0][2])]


@dataclasses.dataclass
class Balance:
    """A measured split: the blocks' names and costs, and where the stages begin (edges over the blocks)."""

    names: list[str]
    costs: list[float]
    edges: list[int]

    @property
    def points(self) -> list[str]:
        return [self.names[e] for e in self.edges[1:-1]]

    def stage_costs(self, edges: list[int]) -> list[float]:
        return [sum(self.costs[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def balance_layout(model: nn.Module, layout: StageLayout, sample: tuple[torch.Tensor, ...], *,
                   part: Any) -> StageLayout:
    """The layout of ``model`` cut where its blocks' costs are balanced (the same on every process)."""
    if layout.num_stages == 1:   # nothing to choose
        return dataclasses.replace(layout, balance=None)
    everyone, device = part.everyone, part.device   # (the Stages part's)
    measured: Any = None
    error = None
    if everyone.worker_index == 0:
        try:
            with part.tracing(model), torch.random.fork_rng(devices=_cuda(device)):
                names, pieces, spread = _blocks(model, sample, device)
                costs = _measure(pieces, sample, spread, layout.balance, device)
            measured = Balance(names, costs, partition(costs, layout.num_stages))
        except Exception as e:   # raised below, once every process knows
            error, measured = e, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    measured = everyone.group.broadcast_object(measured, "split_points='auto' (the measured split)", src=0)
    if error is not None:
        raise error
    if not isinstance(measured, Balance):
        raise InvalidArgumentError(
            f"split_points='auto': the first process could not measure the {type(model).__name__}'s blocks "
            f"({measured}); its error says why; give split_points=[...] to cut the model without measuring")
    if everyone.worker_index == 0:
        _announce(model, layout, measured)
    if isinstance(model, nn.Sequential):
        return dataclasses.replace(layout, bounds=tuple(zip(measured.edges[:-1], measured.edges[1:])), balance=None)
    return dataclasses.replace(layout, points=tuple(measured.points), balance=None)


def _blocks(model: nn.Module, sample: tuple[torch.Tensor, ...],
            device: torch.device) -> tuple[list[str], list[nn.Module], bool]:
    """The blocks' names (where a stage may begin), the modules that compute them, and whether a
    block's tuple output is spread over the next one's arguments (the traced pieces) or passed whole."""
    if isinstance(model, nn.Sequential):
        names, children = zip(*model.named_children())
        return list(names), list(children), False
    name, blocks = longest_list(model)
    names = [f"{name}.{i}" for i in range(len(blocks))]
    pipe, origin = trace(model, names[1:], sample)
    return names, [stage_module(pipe, s, model, origin, device) for s in range(len(names))], True


def _measure(pieces: list[nn.Module], sample: tuple[torch.Tensor, ...], spread: bool, by: str,
             device: torch.device) -> list[float]:
    """Each piece's cost, fed the outputs of the pieces before it; the pieces' buffers left as they were."""
    buffers = [(b, b.detach().clone()) for piece in pieces for b in piece.buffers()]
    try:
        inputs, value = [], sample
        with torch.no_grad():
            for i, piece in enumerate(pieces):
                inputs.append(value)
                value = piece(*value) if spread or i == 0 else piece(value)
                value = value if isinstance(value, tuple) or not spread else (value,)
        if by == "memory":
            return [_memory(piece, args, spread, i == 0) for i, (piece, args) in enumerate(zip(pieces, inputs))]
        timings: list[list[float]] = [[] for _ in pieces]
        for round_ in range(ROUNDS + 1):
            for i, (piece, args) in enumerate(zip(pieces, inputs)):
                seconds = timed(lambda: _forward_backward(piece, args, spread, i == 0), device)
                if round_:   # round 0 warms up
                    timings[i].append(seconds)
        return [statistics.median(t) for t in timings]
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _call(piece: nn.Module, args: Any, spread: bool, first: bool) -> tuple[Any, list[Any]]:
    """``piece`` on detached ``args`` (which need gradients after the first block, as a stage's inputs do)."""
    leaves = [_leaf(a, not first) for a in (args if spread or first else (args,))]
    return (piece(*leaves) if spread or first else piece(leaves[0])), leaves


def _forward_backward(piece: nn.Module, args: Any, spread: bool, first: bool) -> None:
    out, leaves = _call(piece, args, spread, first)
    outputs = [t for t in flat_tensors(out) if t.requires_grad]
    wrt = [p for p in piece.parameters() if p.requires_grad] + [t for t in flat_tensors(leaves) if t.requires_grad]
    if outputs and wrt:   # gradients returned, never accumulated into .grad
        torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)


def _memory(piece: nn.Module, args: Any, spread: bool, first: bool) -> float:
    storages: dict[int, int] = {}
    own = {t.untyped_storage().data_ptr() for t in [*piece.parameters(), *piece.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(piece, args, spread, first)
    params = sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in piece.parameters())
    return float(params + sum(b.numel() * b.element_size() for b in piece.buffers()) + sum(storages.values()))


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device`` (CUDA: its queued work included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _leaf(value: Any, grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(grad and (value.is_floating_point() or value.is_complex()))
    if isinstance(value, (tuple, list)):
        return type(value)(_leaf(v, grad) for v in value)
    return value


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, a tensor or nested tuples and lists of them (anything else: none)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in flat_tensors(v)]
    return []


def _cuda(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def _announce(model: nn.Module, layout: StageLayout, measured: Balance) -> None:
    unit, scale = ("ms of forward+backward", 1e3) if layout.balance == "time" else ("MiB", 1 / (1 << 20))
    chosen = [round(c * scale, 3) for c in measured.stage_costs(measured.edges)]
    even = [round(c * scale, 3) for c in measured.stage_costs(even_edges(len(measured.costs), layout.num_stages))]
    print(f"PipelineStrategy: split_points='auto' (balance_by={layout.balance!r}) cut the {type(model).__name__} "
          f"into {layout.num_stages} stages at split_points={measured.points!r}; {unit} per stage: {chosen} "
          f"(an even split: {even}); pass split_points={measured.points!r} to pin this split", flush=True)
