"""Models whose input is several tensors, or whose output is not one tensor.

Modules written for the ecosystem take named inputs and return records: a Hugging Face
``BertForSequenceClassification`` is called ``module(input_ids=..., attention_mask=...)`` and
returns a ``SequenceClassifierOutput`` (a dict whose keys are its fields that are set). Keras
has the same two shapes: a model with named inputs is fed a dict ``{name: array}``, one with
several outputs returns a list or a dict. So ``sg.Model``:

- calls the module with a dict ``x`` as keyword arguments (``module(**x)``), with a tuple
  ``x`` as positional arguments (``module(*x)``), with anything else as one argument
  (:func:`call_module`), after checking that ``forward`` takes them (:func:`check_inputs`).
  A list is not spread: it stays one argument, and a list given to ``fit`` is an iterable of
  batches;
- gives the loss and the metrics one tensor of the output (:meth:`OutputChoice.for_loss`):
  the output named by ``sg.Model(module, output=...)`` (a key of a dict or ``ModelOutput``,
  an index of a tuple), or, when ``output`` is None, the output itself if it is a tensor, its
  ``"logits"`` if it is a dict or a ``ModelOutput`` that has them, its first element if it is
  a tuple or list;
- returns from ``predict`` the named output, or without ``output=`` the whole output
  (:meth:`OutputChoice.for_predict`): every leaf must then be a tensor with a row per example,
  so that the slices of the replicas join along rows.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.errors import InvalidArgumentError
from stratagem.values import flatten

__all__ = ["OutputChoice", "call_module", "check_inputs"]


def call_module(module: Any, x: Any) -> Any:
    """``module(**x)`` for a dict, ``module(*x)`` for a tuple, else ``module(x)``.

    A replica's slice of a last batch with fewer rows than replicas is empty, and the module
    runs on it (its loss adds nothing); a module that cannot (attention reshaping with ``-1``
    fails on 0 rows) gets an error saying why and what to change.
    """
    try:
        if isinstance(x, dict):
            return module(**x)
        if isinstance(x, tuple):
            return module(*x)
        return module(x)
    except Exception as err:
        leaves = [leaf for leaf in flatten(x) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
        if not leaves or leaves[0].shape[0] > 0:
            raise
        raise InvalidArgumentError(
            f"{type(module).__name__} failed on this replica's empty slice of a batch with fewer rows than "
            f"replicas ({type(err).__name__}: {err}); choose batch_size and the number of rows so that every batch "
            f"has at least num_replicas_in_sync rows, or drop the last partial batch "
            f"(DataLoader(..., drop_last=True))") from err


def check_inputs(module: Any, x: Any) -> None:
    """Raise, naming ``forward``'s parameters, when ``module`` cannot take ``x`` as
    :func:`call_module` passes it -- before the call, so that a misspelt key is not swallowed
    by a ``**kwargs`` whose accepted keys are declared (``**kwargs: Unpack[SomeTypedDict]``, as
    Hugging Face models declare theirs)."""
    signature, keywords = _forward_of(type(module), module)
    if signature is None:
        return
    args, kwargs = ((), x) if isinstance(x, dict) else (x, {}) if isinstance(x, tuple) else ((x,), {})
    try:
        signature.bind(*args, **kwargs)
        unknown = sorted(set(kwargs) - keywords) if keywords is not None else []
        if unknown:
            raise TypeError(f"it takes no {', '.join(map(repr, unknown))}")
    except TypeError as err:
        given = (f"the keys {sorted(x)} of the dict x" if isinstance(x, dict)
                 else f"{len(x)} positional inputs (a tuple x)" if isinstance(x, tuple) else "one input x")
        stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        params = ", ".join(stars.get(p.kind, "") + name for name, p in signature.parameters.items())
        raise InvalidArgumentError(
            f"{type(module).__name__}.forward({params}) cannot take {given}: {err}. A dict x is passed as keyword "
            f"arguments and a tuple x as positional ones: name the inputs as forward's parameters (drop the "
            f"others), or give x as one tensor") from None


#: a module class -> forward's signature and the keywords it takes (None: any); read once per class
_FORWARDS: dict[type, tuple[inspect.Signature | None, frozenset[str] | None]] = {}


def _forward_of(cls: type, module: Any) -> tuple[inspect.Signature | None, frozenset[str] | None]:
    found = _FORWARDS.get(cls)
    if found is None:
        signature = _signature(module.forward)
        keywords: set[str] | None = set()
        for name, parameter in (signature.parameters.items() if signature is not None else ()):
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                keywords.add(name)
            elif parameter.kind is parameter.VAR_KEYWORD:
                declared = _typed_keys(parameter.annotation)
                keywords = None if declared is None or keywords is None else keywords | declared
        found = _FORWARDS[cls] = (signature, None if keywords is None else frozenset(keywords))
    return found


def _signature(forward: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(forward, eval_str=True)   # annotations written as strings too
    except Exception:   # a name an annotation uses cannot be resolved: the annotations as written
        pass
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _typed_keys(annotation: Any) -> set[str] | None:
    """The keys of ``**kwargs: Unpack[TD]`` (a TypedDict), or None: any key."""
    if getattr(typing.get_origin(annotation), "_name", None) != "Unpack":   # typing's or typing_extensions'
        return None
    (typed,) = typing.get_args(annotation)
    required, optional = getattr(typed, "__required_keys__", None), getattr(typed, "__optional_keys__", None)
    return None if required is None or optional is None else set(required) | set(optional)


@dataclass(frozen=True)
class OutputChoice:
    """Which part of the module's output the loss, the metrics and ``predict`` read.

    ``key``: None (the rules of the module docstring), a ``str`` (a key of a dict or of a
    Hugging Face ``ModelOutput``), or an ``int`` (an index of a tuple or list).
    """

    key: str | int | None = None

    def __post_init__(self) -> None:
        if self.key is not None and (isinstance(self.key, bool) or not isinstance(self.key, (str, int))):
            raise InvalidArgumentError(f"sg.Model(module, output=...) takes a key (str), an index (int) or None, "
                                       f"got {self.key!r}")

    def for_loss(self, outputs: Any) -> torch.Tensor:
        """The tensor the loss and the metrics are given: one row per example."""
        if self.key is None:
            chosen, name = self._default(outputs)
        else:
            chosen, name = self._named(outputs), f"output {self.key!r}"
        if not isinstance(chosen, torch.Tensor) or chosen.dim() == 0:
            what = ("a 0-d tensor" if isinstance(chosen, torch.Tensor) else f"a {type(chosen).__name__}")
            raise InvalidArgumentError(
                f"the module's {name} is {what}; the loss and the metrics need a tensor with one row per example. "
                f"Choose another with sg.Model(module, output=KEY){_keys_hint(outputs)}")
        return chosen

    def for_predict(self, outputs: Any) -> Any:
        """What ``predict`` returns for one slice: the named output, or every output."""
        if self.key is not None:
            return self.for_loss(outputs)
        for leaf in flatten(outputs):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                what = "a 0-d tensor" if isinstance(leaf, torch.Tensor) else f"a {type(leaf).__name__}"
                raise InvalidArgumentError(
                    f"predict joins the module's outputs along rows, and one of them is {what}; return only "
                    f"tensors with one row per example, or predict one output with "
                    f"sg.Model(module, output=KEY){_keys_hint(outputs)}")
        return outputs

    def _default(self, outputs: Any) -> tuple[Any, str]:
        if isinstance(outputs, torch.Tensor):
            return outputs, "output"
        if isinstance(outputs, Mapping):
            if "logits" not in outputs:
                raise InvalidArgumentError(
                    f"the module returned a {type(outputs).__name__} without 'logits', so sg.Model does not know "
                    f"which output the loss reads; name it: sg.Model(module, output=KEY){_keys_hint(outputs)}")
            return outputs["logits"], "output 'logits'"
        if isinstance(outputs, (tuple, list)) and outputs:
            return outputs[0], "first output"
        raise InvalidArgumentError(
            f"the module returned a {type(outputs).__name__}; sg.Model needs a tensor, a dict or Hugging Face "
            f"ModelOutput (its 'logits', or the key named by sg.Model(module, output=KEY)), or a tuple (its first "
            f"element, or the index named by output=)")

    def _named(self, outputs: Any) -> Any:
        key = self.key
        if isinstance(key, str):
            if not isinstance(outputs, Mapping):
                raise InvalidArgumentError(f"sg.Model(module, output={key!r}) reads a key, but the module returned a "
                                           f"{type(outputs).__name__}; use an index (int) or output=None")
            if key not in outputs:
                raise InvalidArgumentError(f"the module's output has no {key!r}{_keys_hint(outputs)}; fix "
                                           f"sg.Model(module, output=...)")
            return outputs[key]
        if not isinstance(outputs, (tuple, list)):
            raise InvalidArgumentError(f"sg.Model(module, output={key}) reads an index, but the module returned a "
                                       f"{type(outputs).__name__}; use a key (str) or output=None")
        if not -len(outputs) <= key < len(outputs):
            raise InvalidArgumentError(f"sg.Model(module, output={key}): the module returned {len(outputs)} "
                                       f"outputs; fix the index")
        return outputs[key]


def _keys_hint(outputs: Any) -> str:
    if isinstance(outputs, Mapping):
        return f" (its keys: {', '.join(repr(k) for k in outputs)})"
    if isinstance(outputs, (tuple, list)):
        return f" (it returned {len(outputs)} outputs: an index 0..{len(outputs) - 1})"
    return ""
