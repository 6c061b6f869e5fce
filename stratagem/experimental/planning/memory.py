"""Per-process memory of a layout, counted before anything runs: the model states exactly.

A process of a ``{"data": d, "pipe": p, "model": t}`` mesh holds the parameters of its pipeline
stages, of which a tensor-parallel plan splits some over the model axis:

    Ψ_r = Σ over its stages (Ψ_split / t + Ψ_whole)

(Ψ_split: the weights the plan splits, and the biases of its ``"colwise"`` layers; a
``"rowwise"`` layer's bias is added once, whole). With ``e`` bytes per element and ``s`` bytes of
optimizer state per parameter (Adam in float32: 8, SGD without momentum: 0), ZeRO over the data
axis (``sharding=``) gives

    sharding       parameters   gradients   optimizer state
    None           e Ψ_r        e Ψ_r       s Ψ_r
    "optimizer"    e Ψ_r        e Ψ_r       s Ψ_r / d
    "gradients"    e Ψ_r        e Ψ_r       s Ψ_r / d   (a pipeline accumulates every micro-batch's
                                                         gradient before the step: whole until then)
    "parameters"   e Ψ_r / d    e Ψ_r / d   s Ψ_r / d   (FSDP2)

These are the bytes of the tensors' storages, which :func:`storage_bytes` counts on a running
process (``benchmarks/mesh3d.py`` and the planner's trials compare the two). What a step adds to
them -- activations, the gradients before they are summed, ZeRO-3's gathered parameters and the
buffers FSDP gathers them into (:func:`gather_bytes`) -- depends on the schedule:
:func:`schedule_peak`, from a profile's bytes (:mod:`.activations`).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterable, Sequence

import torch
from torch import nn


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; None and meta skipped).

    Example::

        import torch
        from stratagem.experimental.planning.memory import storage_bytes
        w = torch.zeros(4, 4)
        assert storage_bytes([w, w[0], None]) == 64   # one storage, counted once
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def style_of(name: str, plan: dict[str, Any] | None) -> Any:
    """The plan's style for the module ``name`` (its first matching pattern), or None."""
    for pattern, style in (plan or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def block_parameters(model: nn.Module, plan: dict[str, Any] | None, model_size: int, *,
                     split_only: bool = False) -> list[float]:
    """Parameters each child of ``model`` (a pipeline block) puts on one process of a model group of ``model_size``
    (``split_only``: only those the plan splits, this process's share of them)."""
    counts = []
    for prefix, child in model.named_children():
        total = 0.0
        for name, module in child.named_modules(prefix=prefix):
            style = style_of(name, plan)
            for leaf, q in module.named_parameters(recurse=False):
                # colwise splits weight and bias; rowwise the weight only (its bias is added once, whole)
                split = style == "colwise" or (style == "rowwise" and leaf == "weight")
                if split or not split_only:
                    total += q.numel() / model_size if split else q.numel()
        counts.append(total)
    return counts


def rank_parameters(model: nn.Module, bounds: Sequence[tuple[int, int]], plan: dict[str, Any] | None,
                    model_size: int) -> list[float]:
    """Ψ_r of each pipe rank: the parameters of its stage (children ``bounds[r]`` of ``model``) on one process.

    Example::

        import torch
        from stratagem.experimental.planning.memory import rank_parameters
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        # two stages; the plan splits the first layer by columns over a model axis of 2
        assert rank_parameters(mlp, [(0, 2), (2, 3)], {"0": "colwise"}, 2) == [20.0, 18.0]
    """
    blocks = block_parameters(model, plan, model_size)
    if not isinstance(model, nn.Sequential) and len(bounds) == 1:
        return [float(sum(q.numel() for q in model.parameters()))]
    return [sum(blocks[a:b]) for a, b in bounds]


def model_states(psi_r: float, *, data: int, sharding: str | None, element_size: int,
                 state_per_parameter: float) -> tuple[float, float, float]:
    """Bytes of parameters, gradients and optimizer state of a process holding ``psi_r`` parameters.

    Under a data axis (``sharding`` None or ``"optimizer"``) the gradients are the packs that sum
    them, which every ``.grad`` (a DTensor's too) views after the sum: one copy.

    Example::

        from stratagem.experimental.planning.memory import model_states
        # 1 M float32 parameters with Adam (8 bytes of state each), ZeRO-1 over 4 data ranks
        assert model_states(1e6, data=4, sharding="optimizer", element_size=4,
                            state_per_parameter=8) == (4e6, 4e6, 2e6)
    """
    params = element_size * psi_r / data if sharding == "parameters" else element_size * psi_r
    state = state_per_parameter * psi_r / data if sharding else state_per_parameter * psi_r
    return params, params, state


def unit_shapes(model: nn.Module, plan: dict[str, Any] | None,
                model_size: int) -> list[list[list[tuple[float, float]]]]:
    """Each child of ``model`` (a pipeline block) as ZeRO-3 wraps it: its FSDP units (the block, or a container's
    children that hold parameters, looked through), each the ``(rows, elements)`` of its parameters on one
    process of a model group of ``model_size`` (rows: dimension 0, which FSDP shards; a ``"colwise"`` layer's
    are split by the plan, a ``"rowwise"`` one's columns).

    Example::

        import torch
        from stratagem.experimental.planning.memory import unit_shapes
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        assert unit_shapes(mlp, {"0": "colwise"}, 2) == [[[(3.0, 12.0), (3.0, 3.0)]], [], [[(2.0, 12.0), (2.0, 2.0)]]]
    """
    def units(prefix: str, module: nn.Module) -> list[list[tuple[float, float]]]:
        if not any(True for _ in module.parameters()):
            return []
        if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):   # (looked through, as FSDP's units are)
            return [u for name, child in module.named_children() for u in units(f"{prefix}.{name}", child)]
        shapes = []
        for name, sub in module.named_modules(prefix=prefix):
            style = style_of(name, plan)
            for leaf, q in sub.named_parameters(recurse=False):
                rows = float(q.shape[0]) if q.dim() else 1.0
                split = style == "colwise" or (style == "rowwise" and leaf == "weight")
                shapes.append((rows / model_size if style == "colwise" else rows,
                               q.numel() / model_size if split else float(q.numel())))
        return [shapes]
    if not isinstance(model, nn.Sequential):
        return [[[(float(q.shape[0]) if q.dim() else 1.0, float(q.numel())) for q in model.parameters()]]]
    return [units(name, child) for name, child in model.named_children()]


def gather_bytes(unit: Sequence[tuple[float, float]], *, data: int, element_size: int) -> float:
    """Bytes of the buffer FSDP all-gathers a unit's parameters into over ``data`` processes (also what its
    whole parameters take): each parameter's rows padded to a multiple of ``data``.

    Example::

        from stratagem.experimental.planning.memory import gather_bytes
        # a 10 x 4 weight and its bias over 4 processes: 12 rows each (3 a process), float32
        assert gather_bytes([(10, 40), (10, 10)], data=4, element_size=4) == 4 * (12 * 4 + 12)
    """
    return element_size * data * sum(math.ceil(rows / data - 1e-9) * numel / rows for rows, numel in unit if rows)


def _buffers(staged: Sequence[float], recompute: bool) -> tuple[list[float], list[float], list[float]]:
    """What FSDP's all-gather buffers add at each block, by ``staged`` (each block's unit's buffer; 0 for a
    block without parameters): in a forward that gathers, the last unit gathered's (kept until the next
    gather or the stage's end); in a backward that gathers, the unit before's (the backward's prefetch,
    held until that unit's backward takes it); in a recomputed stage's replay (where every unit it gathers
    is its own forward's root, so frees its buffer as it ends), the unit running's -- and, where the last
    block is a unit (its backward gathered it before the replay and prefetched the unit before), that
    prefetched buffer until the replay reaches its unit."""
    n = len(staged)
    units = [i for i in range(n) if staged[i]]
    forward = [staged[max(u for u in units if u <= j)] if units and units[0] <= j else 0.0 for j in range(n)]
    backward = [staged[max(u for u in units if u < j)] if not recompute and units and units[0] < j <= units[-1]
                else 0.0 for j in range(n)]
    pending = max((u for u in units if u < n - 1), default=None) if units and units[-1] == n - 1 else None
    replay = [(staged[j] if j != n - 1 else 0.0) + (staged[pending] if pending is not None and j < pending else 0.0)
              for j in range(n)]
    return forward, backward, replay


def schedule_peak(saved: Sequence[float], io: float, grads: Sequence[float], *, in_flight: int,
                  microbatches: int, recompute: bool, gathered: Sequence[float] = (),
                  regathered: Sequence[float] = (), staged: Sequence[float] = (), released: float = 0.0) -> float:
    """The most bytes one stage's schedule adds to what a process keeps between steps.

    ``saved``: what each block saves for one micro-batch; ``io``: what the schedule holds of a
    micro-batch until its backward besides (the stage's output); ``grads``: the gradients each
    block's backward creates (none before the step's first backward: ``zero_grad`` dropped them);
    ``in_flight``: micro-batches between their forward and backward at most (GPipe: all of them;
    1F1B on pipe rank ``s`` of ``p``: ``min(m, p - s)``); with ``recompute`` a micro-batch in flight
    saves nothing, and its backward saves the stage's activations again. ``gathered``: under
    ZeRO-3, what each block saves of its parameters made whole in forward (they count while it runs);
    ``regathered``: each block's parameters made whole (a replay gathers every block
    it runs again; in a pipeline they stay whole until the schedule ends, as ``grads`` then counts, or
    until a forward: 1F1B's next forward reshards each block as it ends, and the backward after it
    gathers them again, from the last). ``staged``: each block's FSDP all-gather buffer (0 for a block
    without parameters), which outlives its gather: in a forward that gathers, the last one's until the
    next gather; in a backward that gathers, the block before's (prefetched); in a replay, the running
    block's, and the one the last block's backward prefetched before it (:func:`_buffers`).
    ``released``: what a micro-batch holds from its forward until its backward begins (the loss's
    saved tensors, outside any recomputed region).

    The points: every micro-batch in flight (the last one's forward block by block); the first
    backward, block by block from the last (a block's activations freed as its gradients
    appear; with recomputation, its replay block by block first); a later backward, or a 1F1B
    forward, with every gradient there.

    Example::

        from stratagem.experimental.planning.memory import schedule_peak
        # two blocks saving 100 and 10 bytes, gradients 50 and 500: the first backward's end weighs most
        assert schedule_peak([100, 10], 0, [50, 500], in_flight=1, microbatches=1, recompute=False) == 600
        assert schedule_peak([100, 10], 0, [50, 500], in_flight=2, microbatches=2, recompute=False) == 710
    """
    n, k, total, g = len(saved), in_flight, sum(saved), sum(grads)
    whole = list(gathered) or [0.0] * n
    base = io if recompute else total + io
    held = base + released
    prefix = [sum(saved[:i + 1]) for i in range(n)]
    forward = max(whole) if recompute else max(p + w for p, w in zip(prefix, whole))
    again = list(regathered) or [0.0] * n
    ahead_buffer, behind, replaying = _buffers(list(staged) or [0.0] * n, recompute)
    # a replay gathers the blocks again and keeps them until their backward (FSDP does not reshard in backward)
    gone = [max(sum(again[:i + 1]) if recompute else again[i], whole[i]) for i in range(n)]
    first = max(prefix[i] + sum(grads[i + 1:]) + gone[i] + behind[i] for i in range(n))
    points = [(k - 1) * held + io + released + forward, (k - 1) * held + io + first, (k - 1) * held + g]
    if staged:
        # a forward that gathers (every one before the first backward): block j running, its parameters whole,
        # the last gather's buffer (the stage's output and the loss come after the buffer is freed)
        points.append((k - 1) * held + max((0.0 if recompute else prefix[j]) + again[j] + ahead_buffer[j]
                                           for j in range(n)))
    # a replay at block j: blocks 0..j whole again, and the last block, which its backward gathered first
    replayed = [prefix[j] + sum(again[:j + 1]) + (again[-1] if j < n - 1 else 0.0) + replaying[j] for j in range(n)]
    if staged and recompute:
        points.append((k - 1) * held + io + max(replayed))
    # after the first backward every gradient is there (and the blocks gathered again stay, counted with them)
    if regathered and not recompute and microbatches > k:
        # 1F1B's next forward finds every block whole and reshards each as it ends; the backward after it
        # gathers them again from the last: at block i, what blocks 0..i saved and blocks i.. whole (and,
        # gathering, the block before's buffer). The last backwards have every block whole again but one
        # micro-batch fewer in flight
        ahead = max(p + sum(again[i:]) for i, p in enumerate(prefix)) + g - sum(again)
        regathering = max(p + sum(again[i:]) + behind[i] for i, p in enumerate(prefix)) + g - sum(again)
        return max(*points, (k - 1) * held + io + released + ahead, (k - 1) * held + io + regathering)
    if microbatches > k:   # 1F1B: the next forward
        points.append((k - 1) * held + io + released + (base - io if regathered else forward) + g)
        if staged and recompute:   # the backward after it replays what that forward resharded
            points.append((k - 1) * held + io + g - sum(again) + max(replayed))
    others = k - 1 if microbatches > k else k - 2
    if microbatches > 1 and others >= 0:   # a later backward
        points.append(others * held + io + (total if regathered else max(p + w for p, w in zip(prefix, gone))) + g)
    return max(points)
