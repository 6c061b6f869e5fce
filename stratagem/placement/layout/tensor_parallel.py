"""TensorParallelPlacement: modules split over a mesh's "model" axis, replicated over "data".

Modules created in scope wait until ``finalize()``; then every root module (one that
no other module created in scope holds) gets the chief's initial values (so that every
data-parallel group starts alike) and is handed to torch's ``parallelize_module`` with
the plan: each named layer's parameters become DTensors sharded over the model axis
(``ColwiseParallel``: output features; ``RowwiseParallel``: input features;
``SequenceParallel``: activations along the sequence dimension). The strings give a layer
whose input is whole on every process of the model axis the style that takes it whole: an
Embedding's token ids under "rowwise", any input under "sequence" (:func:`torch_style`). The
plan is checked first -- every entry must name a module, with a known style that fits it (an
Embedding's style must take the token ids whole), whose sharded dimension divides by the
model-axis size -- after the processes agreed that they built the same modules, so that a
wrong plan raises the same InvalidArgumentError on every process.

Gradients: when ``backward()`` returns, each process's ``.grad`` holds the global batch's
gradient of the parameters (DTensor shards) it holds, as under the data-parallel strategies:
the placement's data axis (:class:`~stratagem.placement.data_axis.axis.DataAxis`) sums each
gradient's local shard over the mesh's data axis, in packs that leave while backward runs;
``strategy.no_sync()`` and DDP's ``require_backward_grad_sync`` skip that sum as there.
Optimizers created in scope keep torch's own update over the DTensor parameters, in the step's
order (:mod:`stratagem.placement.data_axis.step`, with :class:`~stratagem.placement.data_axis.local_update.LocalUpdate`).
``clip_grad_norm_`` over the model's parameters clips by the norm of the whole gradients, the
shards measured on every process of the model axis (:mod:`stratagem.placement.scope.clipping`).

State: a placed module's ``state_dict()`` holds full tensors (``DTensor.full_tensor``,
a collective over the model axis: every process calls it), and ``load_state_dict``
takes full tensors and keeps each process's shard. The optimizer's state dict does the
same with its DTensor state. ``sg.Checkpoint.save``, called on every process, enters
``prepare_checkpoint``: the writer's model group gathers those full state dicts, and
global rank 0 writes them as one logical copy (the files of any other strategy); a
restore reads full tensors, which ``load_state_dict`` cuts into this layout's shards.
"""

from __future__ import annotations

import fnmatch
import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.placement.dtensor_state import replacing
from stratagem.placement.data_axis.axis import AxisCollective
from stratagem.placement.layout.roots import RootsPlacement
from stratagem.placement.data_axis.local_update import LocalUpdate

#: plan style names and the torch ParallelStyle each stands for
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
#: for each style, the weight dimension that is split: (Linear, Embedding)
_SPLIT_DIM = {"colwise": (0, 1), "rowwise": (1, 0)}


def check_plan(plan: Any) -> dict[str, Any]:
    """The plan as {pattern: style}, styles checked (names or torch ParallelStyle objects)."""
    if not isinstance(plan, dict) or not plan:
        raise InvalidArgumentError(
            f"plan must be a non-empty dict of module name (or glob pattern) -> style, e.g. "
            f"{{'fc1': 'colwise', 'fc2': 'rowwise'}}; got {plan!r}")
    checked = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise InvalidArgumentError(f"plan keys are module names, got {pattern!r}")
        if isinstance(style, str) and style.lower() in STYLES:
            style = style.lower()
        elif not isinstance(style, ParallelStyle):
            raise InvalidArgumentError(
                f"plan entry {pattern!r} has the unknown style {style!r}; use one of {sorted(STYLES)} "
                f"or a torch.distributed.tensor.parallel.ParallelStyle object")
        checked[pattern] = style
    _check_sequence_inputs(checked)
    return checked


def _check_sequence_inputs(plan: dict[str, Any]) -> None:
    """"sequence" takes a plain input as whole (what the plan's strings hand on): refused in a plan whose
    style object hands the next module a plain tensor that is this process's share along the
    sequence (torchtitan's ``RowwiseParallel(output_layouts=Shard(1))``), which it would cut again."""
    sequence = [pattern for pattern, style in plan.items() if style == "sequence"]
    for pattern, style in plan.items():
        if isinstance(style, str) or not getattr(style, "use_local_output", False):
            continue
        layouts = getattr(style, "sequence_sharding" if isinstance(style, SequenceParallel) else "output_layouts", ())
        shares = [layout for layout in layouts or () if isinstance(layout, Shard) and layout.dim != -1]
        if sequence and shares:
            raise InvalidArgumentError(
                f"plan entry {pattern!r} is {style!r}, which hands the next module a plain tensor that is this "
                f"process's share along dimension {shares[0].dim}, but 'sequence' (plan entries {sequence}) takes "
                f"a plain input as whole, the same on every process of the model axis, and would cut it again; "
                f"give the modules after {pattern!r} torch's SequenceParallel() instead of 'sequence', as "
                f"torchtitan does, or leave the output of {pattern!r} whole")


class TensorParallelPlacement(RootsPlacement):
    """Parameters as DTensors over the model axis of ``mesh``; gradients summed over its data axis."""

    kind = "TensorParallel"
    gathering = "Checkpoint.save (full tensors over the model axis)"
    ungathered = ("the tensor-parallel {name} can only be saved by sg.Checkpoint.save called on every process "
                  "(its full tensors are gathered over the model axis first)")

    def __init__(self, strategy: Any, mesh: DeviceMesh, plan: dict[str, Any], data: Collective,
                 everyone: Collective, device: torch.device, *, model: Collective):
        self.mesh = mesh
        self.device = device       # this process's device: modules move there, then are split
        self.plan = check_plan(plan)
        #: the layout: the plan's layers split over the model axis
        self.split = TensorParallel(self.plan, mesh["model"], alone=True)
        self.parts = (self.split,)
        self.data = data           # the data axis (this process's data-parallel peers)
        self.model = model         # the model axis (this process's model group: the shards of its gradients)
        self.everyone = everyone   # every process (start-up agreement)
        self.norm_group = model.group   # (clipping: the shards of a gradient summed over data)
        self._start_roots(strategy, data, LocalUpdate(self))   # the step's primitives: torch's update over the shards
        #: sums the gradients over the data axis when backward ends (None: a data axis of one)
        self.data_axis.gradients = AxisCollective.gradient_sync(self.data_axis, data)

    # ---------------------------------------------------------------- modules

    def finalize(self) -> None:
        roots = self.new_roots()
        if not roots:
            return
        assignments = self.split.resolve(roots, "no module created in scope has that name")
        for root, styles in zip(roots, assignments):
            with replacing(root, self._replaced):
                self.split.place(root, styles)
            if self.gradients is not None:   # (a parameter frozen or unfrozen since: hooked again)
                root.register_forward_pre_hook(functools.partial(_rehook, weakref.ref(self)))
        self._hook_gradients()

    # -------------------------------------------------------------- gradients

    def _hook_gradients(self) -> None:
        """Give the gradient sync the parameters of the placed models that require grad."""
        if self.gradients is None:
            return
        params = list({id(p): p for root in self._placed for p in root.parameters()}.values())
        self.gradients.update(tuple((id(p), p.requires_grad) for p in params), [params])


def _rehook(placement_ref: Any, module: nn.Module, args: Any) -> None:
    placement = placement_ref()   # (weakly: the model does not keep its strategy alive)
    if placement is not None:
        placement._hook_gradients()


class TensorParallel:
    """A layout part: the layers a tensor-parallel plan names, split over a mesh's model axis by torch's
    ``parallelize_module`` (their parameters DTensors sharded over it); the layers it leaves whole are
    the same on every process of the axis. :class:`TensorParallelPlacement` is this part alone; a
    pipeline's stages on a 3-D mesh compose it after the stages, before FSDP2's units
    (:mod:`~stratagem.placement.layout.pipeline`)."""

    def __init__(self, plan: dict[str, Any] | None, mesh: DeviceMesh, *, alone: bool):
        self.plan = plan    # checked by check_plan (None: every layer whole)
        self.mesh = mesh    # the model axis
        self.size = mesh.size()
        self.alone = alone  # on an axis of one process (or with no entry), layers still become DTensors over it

    def resolve(self, roots: list[nn.Module], nowhere: str, mine: set[int] | None = None
                ) -> list[dict[str, ParallelStyle]]:
        """For each of ``roots``, {module name: torch style} of the modules the plan names (those whose id is
        in ``mine``, where given); an entry that names no module of any root is refused (``nowhere``: why)."""
        if self.plan is None:
            return [{} for _ in roots]
        assignments, unmatched = plan_styles(self.plan, roots, self.size, mine)
        if unmatched is not None:
            available = [n for root in roots for n, _ in root.named_modules() if n]
            raise InvalidArgumentError(
                f"the tensor-parallel plan names {unmatched!r}, but {nowhere}; available: {available}")
        return assignments

    def place(self, root: nn.Module, styles: dict[str, ParallelStyle]) -> None:
        """Split the modules of ``root`` that ``styles`` name (:meth:`resolve`)."""
        if self.alone or (styles and self.size > 1):
            parallelize_module(root, self.mesh, styles)

    #: its state is laid out over the model axis alone (the data groups hold the same values)
    spread_over_data = False

    def spreads(self, module: nn.Module) -> bool:
        """Whether ``module``'s state dict gathers DTensors (a collective over the model axis)."""
        return any(isinstance(p, DTensor) for p in module.parameters())

    def norm_axes(self) -> dict[str, int]:
        """Clipping: a layer left whole is the same along the model axis (this process's rank along it)."""
        return {"model": self.mesh.get_local_rank()}


def plan_styles(plan: dict[str, Any], roots: list[nn.Module], size: int, mine: set[int] | None = None
                ) -> tuple[list[dict[str, ParallelStyle]], str | None]:
    """For each of ``roots``, {module name: torch style} of the modules a checked ``plan`` names (those
    whose id is in ``mine``, where given), each entry checked against its module and the model-axis
    ``size`` (:func:`check_entry`); and the first plan entry that names no module of any root
    (None: each names one), where the resolution stopped."""
    assignments: list[dict[str, ParallelStyle]] = [{} for _ in roots]
    for pattern, style in plan.items():
        found = False
        for root, names in zip(roots, assignments):
            for name, module in root.named_modules():
                if name and (name == pattern or fnmatch.fnmatchcase(name, pattern)):
                    check_entry(name, module, style, size)
                    found = True
                    if mine is None or id(module) in mine:
                        names[name] = torch_style(style, module)
        if not found:
            return assignments, pattern
    return assignments, None


def torch_style(style: Any, module: nn.Module) -> ParallelStyle:
    """The torch ParallelStyle that a checked plan style stands for on ``module``.

    Between the modules of a plan of strings, a plain tensor is whole on every process of the model
    axis (the model's input, the output of a "rowwise" or unsplit layer), except after "colwise"
    (this process's share of the features, for a rowwise layer). torch's ``RowwiseParallel()``
    takes its input as a share of the last dimension, right after a colwise Linear; an
    ``nn.Embedding``'s input is the token ids, whole, so "rowwise" gives an Embedding
    ``RowwiseParallel(input_layouts=Replicate())``, as torchtitan splits its token embedding (its
    output whole). torch's ``SequenceParallel()`` takes its input as a share of the sequence, so
    "sequence" is :class:`_SequenceOfWhole`, which cuts that share from the whole input.
    """
    if not isinstance(style, str):
        return style
    if style == "rowwise" and isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "sequence":
        return _SequenceOfWhole()
    return STYLES[style]()


class _SequenceOfWhole(SequenceParallel):
    """The plan string "sequence": torch's SequenceParallel on a module whose plain-tensor input is
    whole on every process of the model axis. The input becomes a replicated DTensor, which torch's
    own input hook (registered after this one) cuts to this process's share of the sequence, a
    local slice; the output is a DTensor sharded along the sequence, so a colwise layer after it
    gathers the whole sequence again (and an unsplit layer or a sum with a plain tensor is refused by
    DTensor: "mixed torch.Tensor and DTensor"). A DTensor input is left to torch."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def whole(_module: nn.Module, inputs: tuple) -> tuple:
            first, *rest = inputs
            if isinstance(first, torch.Tensor) and not isinstance(first, DTensor):
                first = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False)
            return (first, *rest)
        module.register_forward_pre_hook(whole)
        return super()._apply(module, device_mesh)


def check_entry(name: str, module: nn.Module, style: Any, size: int) -> None:
    """Refuses a plan entry that does not fit ``module`` or the model-axis ``size``, naming the fix."""
    if isinstance(module, nn.Embedding):
        _check_embedding_input(name, style)
    if not isinstance(style, str) or style not in _SPLIT_DIM:
        return
    if isinstance(module, nn.Linear):
        dim, dims = _SPLIT_DIM[style][0], ("out_features", "in_features")
    elif isinstance(module, nn.Embedding):
        dim, dims = _SPLIT_DIM[style][1], ("num_embeddings", "embedding_dim")
    else:
        raise InvalidArgumentError(
            f"plan entry {name!r} is {style}, which splits nn.Linear and nn.Embedding layers, but "
            f"{name!r} is a {type(module).__name__}; name its Linear/Embedding children instead")
    length = module.weight.shape[dim]
    if length % size:
        raise InvalidArgumentError(
            f"plan entry {name!r} is {style}: it splits {dims[dim]} ({length}) over the {size} processes "
            f"of the model axis, which does not divide; pick a model-axis size that divides {length}")


def _check_embedding_input(name: str, style: Any) -> None:
    """An Embedding's input is token ids, whole on every process of the model axis: a torch style that
    takes them as this process's share would gather them (a batch of (4, 16) ids looked up as
    (4, 32) on 2 processes), or look up a share of the sequence as if it were all of it. Refused,
    naming the fix; so is "sequence", which splits no table."""
    if style == "sequence" or isinstance(style, SequenceParallel):
        raise InvalidArgumentError(
            f"plan entry {name!r} is {style!r} on an nn.Embedding: 'sequence' splits activations (norms, "
            f"dropout) and leaves a table whole, and torch's SequenceParallel would take the token ids as this "
            f"process's share of the sequence, but every process of the model axis has them all; split the "
            f"embedding with 'rowwise' (its rows) or 'colwise' (its embedding dim)")
    layouts = tuple(getattr(style, "input_layouts", None) or ())
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and layouts != (Replicate(),):
        kind = type(style).__name__
        raise InvalidArgumentError(
            f"plan entry {name!r} gives an nn.Embedding {kind} with input_layouts={layouts[0]!r}: torch would "
            f"take the token ids as this process's share of them and gather the shares over the model axis "
            f"(each process's copy of the ids looked up together), but every process of the model axis has "
            f"the same token ids; pass {kind}(input_layouts=Replicate(), ...) (from "
            f"torch.distributed.tensor), or the plan string {'rowwise' if kind == 'RowwiseParallel' else 'colwise'!r}")

