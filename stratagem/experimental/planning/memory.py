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

and, with a model axis and a data axis under None or ``"optimizer"``, the split parameters'
gradients once more (:func:`model_states`' ``copied``: measured, see there).

These are the bytes of the tensors' storages, which :func:`storage_bytes` counts on a running
process (``benchmarks/mesh3d.py`` and the planner's trials compare the two). Activations depend
on the schedule and are estimated from a profile instead (:mod:`.cost`).
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
                 state_per_parameter: float, copied: float = 0.0) -> tuple[float, float, float]:
    """Bytes of parameters, gradients and optimizer state of a process holding ``psi_r`` parameters.

    ``copied``: gradient elements held twice. A tensor-parallel process with a data axis
    (``sharding`` None or ``"optimizer"``) sums its gradients over that axis in packs, and a split
    layer's gradient becomes a DTensor over a copy of its sum, while the pack stays for the next
    step: its split parameters' gradients count twice.

    Example::

        from stratagem.experimental.planning.memory import model_states
        # 1 M float32 parameters with Adam (8 bytes of state each), ZeRO-1 over 4 data ranks
        assert model_states(1e6, data=4, sharding="optimizer", element_size=4,
                            state_per_parameter=8) == (4e6, 4e6, 2e6)
    """
    params = element_size * psi_r / data if sharding == "parameters" else element_size * psi_r
    state = state_per_parameter * psi_r / data if sharding else state_per_parameter * psi_r
    return params, params + element_size * copied, state
