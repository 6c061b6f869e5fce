"""A short profile of a model on one device: what the planner's cost model is calibrated with.

The blocks are the children of an ``nn.Sequential`` (where a pipeline may cut it), or the whole
model as one block. For each block, fed what the blocks before it output:

- seconds of its forward, and of its forward and backward, at two batch sizes (the sample's rows
  and a quarter of them), so that a block's time is ``fixed + per_row * rows``: on a CPU the fixed
  part is what makes many small micro-batches slower than a few large ones;
- bytes per row of the tensors its forward saves for the backward (activations, :mod:`.activations`),
  of its input and of its output (what a pipeline sends between stages), and of the input and
  output of each layer a tensor-parallel plan names (what the model axis all-reduces);
- for the optimizer: bytes of state per parameter after a step, and seconds per parameter of
  ``step()``;
- what recomputation costs: a checkpointed forward and backward of the whole model over a plain
  one, at the two batch sizes (``fixed + per_row * rows``).

Each time is the median of :data:`ROUNDS` rounds, every block measured in turn in each round (a
busy moment of the machine slows all blocks alike). Gradients come from ``torch.autograd.grad``:
no ``.grad`` is written.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stratagem.experimental.planning.activations import saved_bytes
from stratagem.experimental.planning.memory import block_parameters, style_of, unit_shapes
from stratagem.placement.dtensor_state import local_state_bytes
from stratagem.placement.layout.pipeline_balance import timed

#: rounds of timing after one warm-up round
ROUNDS = 5


@dataclasses.dataclass
class Profile:
    """What one device measured of a model: per block, per row, and of its optimizer (plain data)."""

    names: list[str]                      # the blocks (children of an nn.Sequential), or [""] for a whole model
    sequential: bool
    rows: int                             # rows of the sample the sizes were measured at
    forward: list[tuple[float, float]]    # seconds: (fixed, per row), per block
    forward_backward: list[tuple[float, float]]
    activation_bytes: list[float]         # saved for backward, per row
    input_bytes: list[float]              # a block's input, per row (its floating tensors)
    output_bytes: list[float]             # per row
    plan_traffic: list[list[tuple[str, float, float]]]   # per block: (style, input, output bytes per row)
    block_params: dict[int, list[float]]  # model-axis size -> parameters of each block on one process
    total_params: float
    element_size: int
    state_per_parameter: float            # bytes of optimizer state per parameter
    step_seconds_per_parameter: float
    # of activation_bytes, what a model axis splits (:mod:`.activations`); whether a block saves its input, its output
    activation_split_bytes: list[float] = dataclasses.field(default_factory=list)
    saves_input: list[bool] = dataclasses.field(default_factory=list)
    saves_output: list[bool] = dataclasses.field(default_factory=list)
    loss_bytes: float = 0.0               # what the loss saves per row besides the output
    input_storage_bytes: float = 0.0      # the first block's input per row (any dtype; 0: input_bytes[0])
    output_storage_bytes: list[float] = dataclasses.field(default_factory=list)   # each block's (empty: output_bytes)
    saved_param_bytes: list[float] = dataclasses.field(default_factory=list)   # of its parameters, each block saves
    # model-axis size -> each block's FSDP units, each the (rows, elements) of its parameters on one process
    unit_rows: dict[int, list[list[list[tuple[float, float]]]]] = dataclasses.field(default_factory=dict)
    recompute_fixed: float = -1.0         # seconds a checkpointed forward and backward adds (-1: not measured)
    recompute_per_row: float = 0.0


def profile(model: nn.Module, sample: tuple[Any, ...], *, make_optimizer: Callable[[Any], torch.optim.Optimizer],
            plan: dict[str, Any] | None, model_sizes: list[int], device: torch.device, target: Any = None,
            loss_fn: Callable | None = None) -> Profile:
    """Measure ``model`` (plain, on ``device``) on ``sample`` (the first block's inputs) and ``loss_fn(output, target)``."""
    sequential = isinstance(model, nn.Sequential)
    if sequential:
        names, blocks = (list(x) for x in zip(*model.named_children()))
    else:
        names, blocks = [""], [model]
    rows = sample[0].shape[0]
    low = max(1, rows // 4)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        inputs = _inputs(blocks, sample)
        sizes = [_sizes(block, args, i == 0, plan, names[i]) for i, (block, args) in enumerate(zip(blocks, inputs))]
        saved = saved_bytes(model, names, blocks, sample, plan, target, loss_fn)
        timings = _timings(blocks, inputs, rows, low, device)
        overhead = _recompute_overhead(model, sample, rows, low, device)
    floats = [q for q in model.parameters() if q.is_floating_point()]
    element = floats[0].element_size() if floats else 4
    state, step = _optimizer(model, make_optimizer, device)
    return Profile(
        names=names, sequential=sequential, rows=rows,
        forward=[_affine(t[0], t[1], rows, low) for t in timings["forward"]],
        forward_backward=[_affine(t[0], t[1], rows, low) for t in timings["forward_backward"]],
        activation_bytes=[w + sp for w, sp in zip(saved.whole, saved.split)], input_bytes=[s[0] / rows for s in sizes],
        output_bytes=[s[1] / rows for s in sizes], plan_traffic=[[(st, i / rows, o / rows) for st, i, o in s[2]]
                                                                 for s in sizes],
        block_params={t: block_parameters(model, plan, t) if sequential else
                      [float(sum(q.numel() for q in model.parameters()))] for t in model_sizes},
        total_params=float(sum(q.numel() for q in model.parameters())), element_size=element,
        state_per_parameter=state, step_seconds_per_parameter=step,
        activation_split_bytes=saved.split, saves_input=saved.saves_input, saves_output=saved.saves_output,
        loss_bytes=saved.loss, input_storage_bytes=saved.input, output_storage_bytes=saved.outputs,
        saved_param_bytes=saved.params, unit_rows={t: unit_shapes(model, plan, t) for t in model_sizes},
        recompute_fixed=overhead[0], recompute_per_row=overhead[1])


def _inputs(blocks: list[nn.Module], sample: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """What each block is fed: the sample, then the output of the block before."""
    inputs, value = [], sample
    with torch.no_grad():
        for block in blocks:
            inputs.append(value)
            out = block(*value)
            value = out if isinstance(out, tuple) else (out,)
    return inputs


def _leaves(args: tuple[Any, ...], first: bool) -> tuple[Any, ...]:
    return tuple(a.detach().requires_grad_(not first and a.is_floating_point()) if isinstance(a, torch.Tensor)
                 else a for a in args)


def _rows(args: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
    return tuple(a[:rows] if isinstance(a, torch.Tensor) else a for a in args)


def _forward(block: nn.Module, args: tuple[Any, ...], first: bool, backward: bool) -> None:
    leaves = _leaves(args, first)
    if not backward:
        with torch.no_grad():
            block(*leaves)
        return
    out = block(*leaves)
    outputs = [t for t in (out if isinstance(out, tuple) else (out,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [q for q in block.parameters() if q.requires_grad] + [a for a in leaves
                                                                if isinstance(a, torch.Tensor) and a.requires_grad]
    if outputs and wrt:
        torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)


def _timings(blocks: list[nn.Module], inputs: list[tuple[Any, ...]], rows: int, low: int,
             device: torch.device) -> dict[str, list[tuple[float, float]]]:
    got: dict[str, list[list[list[float]]]] = {k: [[[], []] for _ in blocks] for k in ("forward", "forward_backward")}
    for round_ in range(ROUNDS + 1):
        for i, (block, args) in enumerate(zip(blocks, inputs)):
            for j, count in enumerate((rows, low)):
                part = _rows(args, count)
                for kind in got:
                    seconds = timed(lambda: _forward(block, part, i == 0, kind == "forward_backward"), device)
                    if round_:   # round 0 warms up
                        got[kind][i][j].append(seconds)
    return {k: [(statistics.median(hi), statistics.median(lo)) for hi, lo in v] for k, v in got.items()}


class _Checkpointed(nn.Module):
    """``model`` run under ``torch.utils.checkpoint`` (non-reentrant), as ``recompute=True`` runs a stage."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.model, *args, use_reentrant=False)


def _recompute_overhead(model: nn.Module, sample: tuple[Any, ...], rows: int, low: int,
                        device: torch.device) -> tuple[float, float]:
    """(fixed, per row) seconds that a checkpointed forward and backward of the whole model takes over a plain
    one, the plain and the checkpointed timed in turn in each round."""
    wrapped = _Checkpointed(model)
    got: list[list[list[float]]] = [[[], []], [[], []]]
    for round_ in range(ROUNDS + 1):
        for j, count in enumerate((rows, low)):
            part = _rows(sample, count)
            for k, module in enumerate((model, wrapped)):
                seconds = timed(lambda: _forward(module, part, True, True), device)
                if round_:
                    got[k][j].append(seconds)
    extra = [max(0.0, statistics.median(got[1][j]) - statistics.median(got[0][j])) for j in range(2)]
    if rows == low or extra[0] <= extra[1]:   # not growing with the rows: torch's checkpoint's own cost, fixed
        return extra[0], 0.0
    return _affine(extra[0], extra[1], rows, low)


def _affine(high: float, low: float, rows: int, low_rows: int) -> tuple[float, float]:
    """(fixed, per row) through the two measurements (per row only when they coincide or cross)."""
    if rows == low_rows or high <= low:
        return 0.0, high / rows
    per_row = (high - low) / (rows - low_rows)
    return max(0.0, high - per_row * rows), per_row


def _sizes(block: nn.Module, args: tuple[Any, ...], first: bool, plan: dict[str, Any] | None,
           name: str) -> tuple[float, float, list[tuple[str, float, float]]]:
    """Bytes of ``block``'s input and output, and of each plan layer's input and output."""
    traffic: list[tuple[str, float, float]] = []
    hooks = []
    for sub, module in block.named_modules(prefix=name):
        style = style_of(sub, plan) if name else None
        if style is not None:
            hooks.append(module.register_forward_hook(
                lambda m, i, o, style=style: traffic.append((str(style), _bytes(i), _bytes(o)))))
    try:
        with torch.no_grad():
            out = block(*_leaves(args, first))
    finally:
        for hook in hooks:
            hook.remove()
    return _bytes(args), _bytes(out), traffic


def _bytes(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.numel() * value.element_size()) if value.is_floating_point() else 0.0
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    return 0.0


def _optimizer(model: nn.Module, make_optimizer: Callable[[Any], torch.optim.Optimizer],
               device: torch.device) -> tuple[float, float]:
    """Bytes of state per parameter and seconds of ``step()`` per parameter, on a copy of the model."""
    import copy
    clone = copy.deepcopy(model)
    params = [q for q in clone.parameters() if q.requires_grad]
    count = sum(q.numel() for q in params) or 1
    optimizer = make_optimizer(clone.parameters())
    for q in params:
        q.grad = torch.full_like(q, 1e-3)
    optimizer.step()   # creates the state
    state = local_state_bytes(optimizer) / count
    seconds = statistics.median(timed(optimizer.step, device) for _ in range(ROUNDS))
    return state, seconds / count
