"""The table that ``Model.summary()`` prints, in Keras's layout.

Rows are the module's children (with ``expand_nested``, theirs too), each with its type,
its output shape and its parameter count (parameters and persistent buffers, as Keras counts
a layer's weights). Output shapes come from one forward pass of a copy of the module on the
``meta`` device (shapes only: no memory, no computation, nothing of the model changed), when
``Model.build(input_shape)`` gave the input's shape; else they read ``?``.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.keras import architecture

__all__ = ["summary_lines"]

_BATCH = 7   # the size given to an input dimension written None (shown None again in outputs)


def summary_lines(module: nn.Module, input_spec: Any, *, line_length: int | None = None,
                  positions: Sequence[float] | None = None, expand_nested: bool = False, show_trainable: bool = False,
                  layer_range: Sequence[str] | None = None) -> list[str]:
    """The lines of the summary of ``module`` (``input_spec``: ``(shape, dtype)`` or None)."""
    rows = _rows(module, expand_nested)
    if layer_range is not None:
        rows = _in_range(rows, layer_range)
    shapes, note = _output_shapes(module, input_spec)
    width = line_length or (80 if show_trainable else 65)
    fractions = list(positions or ([0.4, 0.7, 0.85, 1.0] if show_trainable else [0.45, 0.85, 1.0]))
    stops = [int(width * p) if p <= 1 else int(p) for p in fractions]
    headers = ["Layer (type)", "Output Shape", "Param #"] + (["Trainable"] if show_trainable else [])
    if len(stops) != len(headers):
        raise InvalidArgumentError(f"summary(positions=...) needs {len(headers)} column ends, got {list(fractions)}")
    lines = [f'Model: "{type(module).__name__}"', "_" * width, _row(headers, stops), "=" * width]
    for depth, name, item in rows:
        label = "  " * depth + (f"{name} ({type(item).__name__})" if isinstance(item, nn.Module)
                                else f"{name} ({'Parameter' if isinstance(item, nn.Parameter) else 'Buffer'})")
        tensors = _state_tensors(item)
        fields = [label, shapes.get(name, "?") if isinstance(item, nn.Module) else "-",
                  str(sum(t.numel() for t in tensors))]
        if show_trainable:
            fields.append("Y" if any(_trainable(t) for t in tensors) else "N" if tensors else "-")
        lines.append(_row(fields, stops))
    lines.append("=" * width)
    everything = _state_tensors(module)
    trainable = [t for t in everything if _trainable(t)]
    frozen = [t for t in everything if not _trainable(t)]
    for title, tensors in (("Total", everything), ("Trainable", trainable), ("Non-trainable", frozen)):
        count = sum(t.numel() for t in tensors)
        lines.append(f"{title} params: {count:,} ({_size(sum(t.numel() * t.element_size() for t in tensors))})")
    if note is not None:
        lines.append(note)
    lines.append("_" * width)
    return lines


def _rows(module: nn.Module, expand_nested: bool) -> list[tuple[int, str, Any]]:
    rows: list[tuple[int, str, Any]] = []

    def children(m: nn.Module, prefix: str, depth: int) -> None:
        for name, child in m.named_children():
            rows.append((depth, prefix + name, child))
            if expand_nested:
                children(child, f"{prefix}{name}.", depth + 1)

    for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if name not in module._non_persistent_buffers_set:
            rows.append((0, name, tensor))
    children(module, "", 0)
    if not rows:   # a module without children: one row, itself
        rows.append((0, "", module))
    return rows


def _in_range(rows: list[tuple[int, str, Any]], layer_range: Sequence[str]) -> list[tuple[int, str, Any]]:
    names = [name for depth, name, _ in rows if depth == 0]
    if len(layer_range) != 2 or any(name not in names for name in layer_range):
        raise InvalidArgumentError(f"summary(layer_range=...) takes [first, last] among the layer names {names}, "
                                   f"got {list(layer_range)!r}")
    first, last = names.index(layer_range[0]), names.index(layer_range[1])
    kept = set(names[first:last + 1])
    return [row for row in rows if row[1].split(".")[0] in kept]


def _state_tensors(item: Any) -> list[torch.Tensor]:
    """The tensors a state_dict of ``item`` holds, each once (a tensor row: itself)."""
    if isinstance(item, torch.Tensor):
        return [item]
    return list({id(t): t for t in item.state_dict(keep_vars=True).values()}.values())


def _trainable(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) and tensor.requires_grad


def _size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TB"


def _row(fields: list[str], stops: list[int]) -> str:
    line = ""
    for field, stop in zip(fields, stops):
        line += " " + field
        line += " " * max(stop - len(line), 0)
    return line.rstrip()


def _output_shapes(module: nn.Module, input_spec: Any) -> tuple[dict[str, str], str | None]:
    """``{child name: output shape}`` from a forward pass of a meta-device copy, and a note when
    that pass failed."""
    if input_spec is None:
        return {}, None
    shape, dtype = input_spec
    given = tuple(_BATCH if d is None else d for d in shape)
    if dtype is None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    shapes: dict[str, str] = {}
    try:
        tensors: list[torch.Tensor] = []
        data = architecture.dump(architecture.clean_copy(module), {}, tensors, what="the module",
                                 to_stored=lambda t: t)
        copy = architecture.load(data, {}, tensors, safe_mode=False, custom_objects=None, path="(summary)",
                                 to_live=lambda t: torch.empty_like(t, device="meta"))
        for name, m in copy.named_modules(remove_duplicate=False):
            m.register_forward_hook(functools.partial(_record, shapes, name, shape[0] is None))
        copy.eval()
        with torch.no_grad():
            copy(torch.zeros(given, dtype=dtype, device="meta"))
    except Exception as err:   # the table is still useful without shapes: say why they are missing
        return {}, (f"(output shapes unknown: a forward pass on an input of shape {tuple(shape)} failed: "
                    f"{type(err).__name__}: {err})")
    return shapes, None


def _record(shapes: dict[str, str], name: str, batch_unknown: bool, module: nn.Module, inputs: Any,
            output: Any) -> None:
    shapes[name] = _describe(output, batch_unknown)


def _describe(value: Any, batch_unknown: bool) -> str:
    if isinstance(value, torch.Tensor):
        dims = [None if i == 0 and batch_unknown and d == _BATCH else d for i, d in enumerate(value.shape)]
        return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_describe(v, batch_unknown) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v, batch_unknown)}" for k, v in value.items()) + "}"
    return "?"
