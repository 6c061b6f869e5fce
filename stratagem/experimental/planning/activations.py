"""What a model's forward saves for backward, per block and per row: the profile's activation bytes.

One forward over the blocks (the children of an ``nn.Sequential``, or the whole model) and the
loss, under ``torch.autograd.graph.saved_tensors_hooks``: each storage saved (the parameters'
left out) counts once, for the block that saved it first. A tensor-parallel plan splits what is
saved between a ``"colwise"`` layer and the ``"rowwise"`` one that closes it (the colwise layer's
output, what is computed from it, the rowwise layer's input) over the model axis: those bytes are
counted apart (``split``), the colwise layer's own input stays whole.

Where a pipeline cuts, a stage's input and output are tensors of their own (received, sent), held
for each micro-batch in flight: ``saves_input`` and ``saves_output`` say whether a block saves the
tensor it is given, or the one it returns, itself (then it is among its saved bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from stratagem.experimental.planning.memory import style_of
from stratagem.placement.layout.pipeline_balance import flat_tensors


@dataclasses.dataclass
class Saved:
    """Bytes per row saved for backward, per block (``whole`` and ``split`` by a plan), and by the loss."""

    whole: list[float]
    split: list[float]
    saves_input: list[bool]
    saves_output: list[bool]
    loss: float   # what the loss saves besides the model's output (the output and target rows it keeps)
    input: float = 0.0   # the storages of the first block's input (any dtype)
    outputs: list[float] = dataclasses.field(default_factory=list)   # of each block's output
    params: list[float] = dataclasses.field(default_factory=list)    # bytes of its parameters it saves (not per row)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved_bytes(model: nn.Module, names: list[str], blocks: list[nn.Module], sample: tuple[Any, ...],
                plan: dict[str, Any] | None, target: Any = None, loss_fn: Callable | None = None) -> Saved:
    """Run ``blocks`` (``model``'s, named ``names``) on ``sample`` and the loss on ``target``; count what is saved.

    Example::

        import torch
        from stratagem.experimental.planning.activations import saved_bytes
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        got = saved_bytes(mlp, ["0", "1", "2"], list(mlp), (torch.randn(5, 4),), {"0": "colwise", "2": "rowwise"})
        # the first layer saves its input (whole); ReLU its output, which the last layer saves too (split)
        assert got.whole == [16.0, 0.0, 0.0] and got.split == [0.0, 32.0, 0.0]
        assert got.saves_input == [True, False, True] and got.saves_output == [False, True, False]
    """
    rows = flat_tensors(sample)[0].shape[0]
    n = len(blocks)
    own = {_ptr(t) for t in [*model.parameters(), *model.buffers()]}
    seen: set[int] = set()
    whole, split, params = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * n   # (the last slot: the loss)
    during: list[set[int]] = [set() for _ in range(n + 1)]
    where = {"block": 0, "open": False, "inside": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = _ptr(t)
        during[where["block"]].add(ptr)
        if ptr in own and ptr not in seen and where["block"] < n:   # (ZeRO-3 gathers these while they are saved)
            seen.add(ptr)
            params[where["block"]] += t.untyped_storage().nbytes()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            kind = split if where["open"] and not where["inside"] else whole
            kind[where["block"]] += t.untyped_storage().nbytes()
        return t

    def enter(style: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            where["inside"] += style == "colwise"
        return hook

    def leave(style: str) -> Callable:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if style == "colwise":
                where["inside"] -= 1
            where["open"] = style == "colwise"
        return hook

    handles = []
    for name, block in zip(names, blocks):
        for sub, module in block.named_modules(prefix=name):
            style = style_of(sub, plan) if sub else None
            if style in ("colwise", "rowwise"):
                handles += [module.register_forward_pre_hook(enter(style)),
                            module.register_forward_hook(leave(style))]
    inputs, outputs, sizes, first = [], [], [], 0.0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in sample)
            for i, block in enumerate(blocks):
                where["block"] = i
                inputs.append({_ptr(t) for t in flat_tensors(value)})
                if i == 0:
                    first = float(sum(t.untyped_storage().nbytes() for t in flat_tensors(value)))
                out = block(*value)
                outputs.append({_ptr(t) for t in flat_tensors(out)})
                sizes.append(float(sum(t.untyped_storage().nbytes() for t in flat_tensors(out))))
                value = out if isinstance(out, tuple) else (out,)
            loss = 0.0
            if loss_fn is not None and target is not None:
                where["block"] = n
                before = sum(whole) + sum(split)
                seen.update(outputs[-1])   # held anyway: the schedule keeps each micro-batch's output
                loss_fn(out, target)
                loss = sum(whole) + sum(split) - before
    finally:
        for handle in handles:
            handle.remove()
    return Saved(whole=[w / rows for w in whole[:n]], split=[s / rows for s in split[:n]],
                 saves_input=[bool(inputs[i] & during[i]) for i in range(n)],
                 saves_output=[bool(outputs[i] & during[i]) for i in range(n)], loss=loss / rows,
                 input=first / rows, outputs=[size / rows for size in sizes], params=params)
