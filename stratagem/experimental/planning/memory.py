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
them -- activations, the gradients before they are summed, ZeRO-3's gathered parameters -- depends
on the schedule: :func:`schedule_peak`, from a profile's bytes (:mod:`.activations`).
"""

from __future__ import annotations

import fnmatch
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


def schedule_peak(saved: Sequence[float], io: float, grads: Sequence[float], *, in_flight: int,
                  microbatches: int, recompute: bool, gathered: Sequence[float] = (),
                  regathered: Sequence[float] = (), released: float = 0.0) -> float:
    """The most bytes one stage's schedule adds to what a process keeps between steps.

    ``saved``: what each block saves for one micro-batch; ``io``: what the schedule holds of a
    micro-batch until its backward besides (the stage's output); ``grads``: the gradients each
    block's backward creates (none before the step's first backward: ``zero_grad`` dropped them);
    ``in_flight``: micro-batches between their forward and backward at most (GPipe: all of them;
    1F1B on pipe rank ``s`` of ``p``: ``min(m, p - s)``); with ``recompute`` a micro-batch in flight
    saves nothing, and its backward saves the stage's activations again. ``gathered``: under
    ZeRO-3, what each block saves of its parameters made whole in forward (they count while it runs);
    ``regathered``: each block's parameters made whole for its backward (a replay gathers every block
    it runs again; in a pipeline they stay whole until the schedule ends, as ``grads`` then counts, or
    until a forward: 1F1B's next forward reshards each block as it ends, and the backward after it
    gathers them again, from the last).
    ``released``: what a micro-batch holds from its forward until its backward begins (the loss's
    saved tensors, outside any recomputed region).

    The points: every micro-batch in flight (the last one's forward block by block); the first
    backward, block by block from the last (a block's activations freed as its gradients
    appear); a later backward, or a 1F1B forward, with every gradient there.

    Example::

        from stratagem.experimental.planning.memory import schedule_peak
        # two blocks saving 100 and 10 bytes, gradients 50 and 500: the first backward's end weighs most
        assert schedule_peak([100, 10], 0, [50, 500], in_flight=1, microbatches=1, recompute=False) == 600
        assert schedule_peak([100, 10], 0, [50, 500], in_flight=2, microbatches=2, recompute=False) == 710
    """
    k, total, g = in_flight, sum(saved), sum(grads)
    whole = list(gathered) or [0.0] * len(saved)
    base = io if recompute else total + io
    held = base + released
    prefix = [sum(saved[:i + 1]) for i in range(len(saved))]
    forward = max(whole) if recompute else max(p + w for p, w in zip(prefix, whole))
    again = list(regathered) or [0.0] * len(saved)
    # a replay gathers the blocks again and keeps them until their backward (FSDP does not reshard in backward)
    gone = [max(sum(again[:i + 1]) if recompute else again[i], whole[i]) for i in range(len(saved))]
    first = max(prefix[i] + sum(grads[i + 1:]) + gone[i] for i in range(len(saved)))
    points = [(k - 1) * held + io + released + forward, (k - 1) * held + io + first, (k - 1) * held + g]
    # after the first backward every gradient is there (and the blocks gathered again stay, counted with them)
    if regathered and not recompute and microbatches > k:
        # 1F1B's next forward finds every block whole and reshards each as it ends; the backward after it
        # gathers them again from the last: at block i, what blocks 0..i saved and blocks i.. whole. That
        # forward outweighs that backward (no loss held), and the last backwards, with every block whole again
        # but one micro-batch fewer in flight
        ahead = max(p + sum(again[i:]) for i, p in enumerate(prefix)) + g - sum(again)
        return max(*points, (k - 1) * held + io + released + ahead)
    if microbatches > k:   # 1F1B: the next forward
        points.append((k - 1) * held + io + released + (base - io if regathered else forward) + g)
    others = k - 1 if microbatches > k else k - 2
    if microbatches > 1 and others >= 0:   # a later backward
        points.append(others * held + io + (total if regathered else max(p + w for p, w in zip(prefix, gone))) + g)
    return max(points)
