"""The loss-scaling trap, caught at ``backward()``: a per-replica mean under summed gradients.

A synchronous strategy *sums* the replicas' gradients (TensorFlow's convention), so the loss
a replica differentiates must be its share of the global batch's loss: per-example losses
summed and divided by the *global* batch size (:func:`~stratagem.nn.compute_average_loss`).
A PyTorch habit, ``loss = F.cross_entropy(model(x), y)``, is a mean over the replica's own
examples; summed over N replicas it trains with about N times the gradient, silently.
(DistributedDataParallel averages gradients instead, which is why the habit is right there.)

Where ``backward()`` is looked at is :mod:`stratagem.nn.loss_watch`'s: inside a ``run`` with
more than one replica in sync, and outside ``run`` where the process holds one of several. The
check looks at the
few nodes of the autograd graph nearest the loss -- the scalar arithmetic
(``+ - * /``, dtype casts, views) down to the first reductions -- at most
:data:`MAX_NODES` of them, so the cost is a few microseconds whatever the model:

- a node made by :func:`~stratagem.nn.compute_average_loss`,
  :func:`~stratagem.nn.scale_regularization_loss`, :func:`~stratagem.nn.mean_over_replicas`,
  ``sg.Model``'s steps (through ``compute_average_loss``) or
  :func:`~stratagem.nn.skip_loss_scaling_check` is marked (in its ``grad_fn.metadata``), and
  reaching one means the loss was scaled on purpose;
- a reduction is a *mean* (``Tensor.mean``, a torch loss with ``reduction="mean"``, a sum
  divided by its rows) or a *sum*;
- a factor on the way to it is read: one of ``1/num_replicas_in_sync`` (DDP's average),
  ``1/global_batch_size``, or ``rows/global_batch_size`` scales the term for the global batch.
  Only CPU numbers are read (a Python number is one, also beside a GPU tensor), never a
  device's tensor, which would synchronise: a factor held on a GPU (a ``GradScaler``'s scale
  there) is one the check cannot place, so a mean under it warns instead of raising.

A mean that nothing scales is the trap. With no other factor than ones >= 1 on its way (a
CPU ``GradScaler``'s scale, a weight), no scaled term beside it, and the whole scalar part of
the graph seen within :data:`MAX_NODES` nodes, the verdict is exact and
``backward()`` raises :class:`~stratagem.errors.InvalidArgumentError` naming both fixes.
Where a correct loss could look the same -- a mean weighted by an unknown factor below 1
(``loss / accumulation_steps``, a token count over a global token count) or a mean term added
to a scaled one (an unscaled regularization term) -- it warns once per strategy with
:class:`LossScalingWarning`. Sums, custom autograd functions and anything
else unrecognised pass: the check refuses only what it recognises.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem._frames import warn_at_users_line
from stratagem.errors import InvalidArgumentError

__all__ = ["LossScalingWarning", "MAX_NODES", "check", "mark"]

#: the most autograd nodes one check looks at
MAX_NODES = 32
_KEY = "stratagem.loss_scaling"
_REPLICAS = "stratagem.loss_scaling.replicas"   # the replicas in sync the mark scaled for
#: nodes of scalar arithmetic: the walk goes through them
_THROUGH = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0", "RsubBackward1",
    "NegBackward0", "ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
    "ReshapeAliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "SqueezeBackward3", "UnsqueezeBackward0", "ExpandBackward0"})
_MULTIPLY = frozenset({"MulBackward0", "MulBackward1"})
_DIVIDE = frozenset({"DivBackward0", "DivBackward1"})
_MEANS = frozenset({"MeanBackward0", "MeanBackward1"})
_SUMS = frozenset({"SumBackward0", "SumBackward1"})
_TORCH_NAMES = {
    "NllLossBackward0": "F.cross_entropy(...) or F.nll_loss(...)", "MseLossBackward0": "F.mse_loss(...)",
    "BinaryCrossEntropyWithLogitsBackward0": "F.binary_cross_entropy_with_logits(...)",
    "BinaryCrossEntropyBackward0": "F.binary_cross_entropy(...)", "SmoothL1LossBackward0": "F.smooth_l1_loss(...)",
    "HuberLossBackward0": "F.huber_loss(...)", "SoftMarginLossBackward0": "F.soft_margin_loss(...)",
    "MultiMarginLossBackward0": "F.multi_margin_loss(...)"}


class LossScalingWarning(UserWarning):
    """A loss given to ``backward()`` inside ``strategy.run`` looks like a per-replica mean while
    the strategy sums the replicas' gradients; the message names the fix.

    Example::

        import warnings, stratagem as sg
        with warnings.catch_warnings():
            warnings.simplefilter("error", sg.nn.LossScalingWarning)   # an error inside this block
    """


def mark(loss: torch.Tensor, how: str, num_replicas: int | None = None) -> torch.Tensor:
    """Note on ``loss``'s autograd node that it is scaled for summed gradients (``how``): for
    ``num_replicas`` replicas in sync, or for any number (None: exact whatever it is)."""
    node = loss.grad_fn if isinstance(loss, torch.Tensor) else None
    if node is not None:
        node.metadata[_KEY] = how
        node.metadata[_REPLICAS] = num_replicas
    return loss


# ---------------------------------------------------------------- what a loss looks like


@dataclass
class _Term:
    """One reduction (or mark) reached from the loss, with the factors met on the way."""

    kind: str                     # "marked", "mean", "sum", "unknown", "cut" (the walk stopped)
    node: Any = None
    rows: int = 1                 # the first dimension of what the reduction reduced
    numel: int = 1
    factors: list[float] = field(default_factory=list)
    unsure: bool = False          # a factor that could not be read, or a product of two losses
    replicas: int | None = None   # a mark's: the replicas in sync it scaled for (None: any)


def _terms(roots: list[Any]) -> list[_Term]:
    terms: list[_Term] = []
    todo = deque((node, [], False) for node in roots)   # breadth first: terms in the order written
    seen = 0
    while todo:
        node, factors, unsure = todo.popleft()
        if node is None:
            continue
        seen += 1
        if seen > MAX_NODES:
            terms.append(_Term("cut"))   # not looked at: it could hold a scaled term
            break
        if node.metadata.get(_KEY) is not None:
            terms.append(_Term("marked", node, replicas=node.metadata.get(_REPLICAS)))
            continue
        name = node.name()
        inputs = [next_node for next_node, _ in node.next_functions]
        if name in _THROUGH:
            todo += [(n, factors, unsure) for n in inputs]
        elif name in _MULTIPLY or name in _DIVIDE:
            todo += _scaled(node, name in _DIVIDE, inputs, factors, unsure)
        elif name in _MEANS or name in _SUMS:
            sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()))
            numel = math.prod(sizes)
            if numel == 1 or (len(sizes) == 1 and _stacked(inputs)):
                # a scalar reduced (nothing reduced), or a reduction of scalar losses stacked
                # together (torch.stack([a, b]).mean()): each of them is a term
                todo += [(n, factors, unsure) for n in _stacked(inputs) or inputs]
            else:
                kind = "mean" if name in _MEANS else "sum"
                terms.append(_Term(kind, node, sizes[0] if sizes else 1, numel, factors, unsure))
        else:
            terms.append(_loss_term(node, factors, unsure))
    return terms


def _stacked(inputs: list[Any]) -> list[Any]:
    """The nodes stacked together by ``torch.stack`` of scalars, if that made ``inputs[0]``."""
    node = inputs[0] if len(inputs) == 1 else None
    if node is None or node.name() != "StackBackward0":
        return []
    return [n for n, _ in node.next_functions]


def _scaled(node: Any, divide: bool, inputs: list[Any], factors: list[float], unsure: bool) -> list:
    """The inputs of ``a * b`` or ``a / b`` to walk, with the constant factor noted."""
    if len(inputs) == 2 and inputs[1] is None and inputs[0] is not None:
        value = _number(_saved(node, "_saved_other"))
        if value is None or value == 0:
            return [(inputs[0], factors, True)]
        return [(inputs[0], factors + [1 / value if divide else value], unsure)]
    if len(inputs) == 2 and inputs[0] is None and not divide:
        value = _number(_saved(node, "_saved_self"))
        if value is None:
            return [(inputs[1], factors, True)]
        return [(inputs[1], factors + [value], unsure)]
    if len(inputs) == 1:   # a Python number kept in the node (MulBackward1, DivBackward1)
        value = _number(_saved(node, "_saved_other"))
        if value is None or value == 0:
            return [(inputs[0], factors, True)]
        return [(inputs[0], factors + [1 / value if divide else value], unsure)]
    return [(n, factors, True) for n in inputs]   # a product of two computed values


def _loss_term(node: Any, factors: list[float], unsure: bool) -> _Term:
    reduction = _saved(node, "_saved_reduction")
    if reduction not in (1, 2):   # not a torch loss, or reduction="none"
        return _Term("unknown", node)
    this = _saved(node, "_saved_self")
    rows = this.shape[0] if isinstance(this, torch.Tensor) and this.dim() else 1
    numel = this.numel() if isinstance(this, torch.Tensor) else 1
    return _Term("mean" if reduction == 1 else "sum", node, rows, numel, factors, unsure)


def _saved(node: Any, name: str) -> Any:
    try:
        return getattr(node, name, None)
    except RuntimeError:   # freed by an earlier backward: that backward will say so
        return None


def _number(value: Any) -> float | None:
    """A factor's value, where reading it costs nothing (never a device's tensor)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_cpu:
        return float(value.item())
    return None


# ------------------------------------------------------------------------- the verdict


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5)


def _classify(term: _Term, num_replicas: int, global_batch: int | None) -> str:
    """"good" (scaled), "neutral", "trap" (certainly a per-replica mean), "doubt", or
    "mismatch" (scaled by a helper for another number of replicas in sync)."""
    if term.kind == "marked":
        return "good" if term.replicas in (None, num_replicas) else "mismatch"
    if term.kind not in ("mean", "sum"):
        return "neutral"
    factors = list(term.factors)
    if term.kind == "sum":
        if global_batch and any(_close(f, 1 / global_batch) for f in factors):
            return "good"
        # a sum divided by its own rows (or elements) is a mean
        means = [f for f in factors if (term.rows > 1 and _close(f, 1 / term.rows)) or _close(f, 1 / term.numel)]
        if not means:
            return "neutral"
        factors.remove(means[0])
        term.factors = factors   # the division that made the mean is not a weight
    # a mean's share of the global batch: DDP's 1/N, or rows/global batch (also split in two
    # factors: * rows, then / global batch)
    shares = [1 / num_replicas] + ([1 / global_batch, term.rows / global_batch] if global_batch else [])
    if any(_close(f, share) for f in factors for share in shares):
        return "good"
    if term.unsure or any(f < 1 for f in factors):
        return "doubt"
    return "trap"


def _describe(term: _Term) -> str:
    name = term.node.name()
    rows = f"this replica's {term.rows} rows"
    if name in _MEANS:
        return f"a .mean() over {rows}"
    if name in _SUMS:
        return f"a sum divided by {rows}"
    torch_name = _TORCH_NAMES.get(name, f"a loss ({name})")
    if term.kind == "sum":
        return f"{torch_name} with reduction='sum', divided by {rows}"
    return f"{torch_name} with reduction='mean', over {rows}"


def _advice(num_replicas: int) -> str:
    return (f"The gradients of the {num_replicas} replicas in sync are summed (TensorFlow's convention; "
            f"DistributedDataParallel averages them instead), so this trains with about {num_replicas}x the "
            f"single-device gradient. Scale the loss for the global batch: "
            f"`loss = sg.nn.compute_average_loss(F.cross_entropy(logits, labels, reduction=\"none\"))`, or divide "
            f"a sum by the global batch size (`per_example_loss.sum() / global_batch_size`); a term every "
            f"replica adds in full (regularization) goes through `sg.nn.scale_regularization_loss(term)`. "
            f"For DistributedDataParallel's averaging write `sg.nn.mean_over_replicas(loss)`. If the loss is "
            f"scaled elsewhere on purpose, `loss = sg.nn.skip_loss_scaling_check(loss)` lets it through")


def check(roots: list[Any], strategy: Any, num_replicas: int, global_batch: int | None,
          where: str = "in a replica of", confirm: Any = None) -> None:
    """Raise or warn (once per strategy) if the loss whose graph starts at ``roots`` is a
    per-replica mean under gradients summed over ``num_replicas`` replicas. ``where`` places the
    backward in the messages; ``confirm(roots)``, if given, must say True (the loss reaches the
    strategy's parameters) before anything is raised or warned."""
    judged = [(term, _classify(term, num_replicas, global_batch)) for term in _terms(roots)]
    verdicts = [verdict for _, verdict in judged]
    if confirm is not None and any(v in ("mismatch", "trap", "doubt") for v in verdicts) and not confirm(roots):
        return   # (asked once: a whole-graph walk) the loss does not reach the strategy's parameters
    if "mismatch" in verdicts:
        term = next(term for term, verdict in judged if verdict == "mismatch")
        how = term.node.metadata.get(_KEY)
        raise InvalidArgumentError(
            f"loss.backward() {where} {strategy!r} got a loss scaled by sg.nn.{how} for "
            f"{term.replicas} replica(s) in sync, but the gradients are summed over {num_replicas}: the "
            f"loss was computed outside this strategy's scope and strategy.run (where the default "
            f"strategy's one replica is in sync), so it trains with the wrong gradient. Compute the loss "
            f"inside `with strategy.scope():` or inside strategy.run, where sg.nn.{how} scales for "
            f"{num_replicas} replicas")
    if "trap" in verdicts and "good" not in verdicts and all(term.kind != "cut" for term, _ in judged):
        term = next(term for term, verdict in judged if verdict == "trap")
        raise InvalidArgumentError(
            f"loss.backward() {where} {strategy!r} got a per-replica mean loss: "
            f"{_describe(term)}. {_advice(num_replicas)}")
    mixed = "good" in verdicts
    for term, verdict in judged:
        if verdict in ("trap", "doubt"):
            _warn_once(strategy, (
                f"loss.backward() {where} {strategy!r} got a loss with a term that looks like a "
                f"per-replica mean not scaled for the global batch: {_describe(term)}"
                f"{_why_unsure(term, mixed)}. {_advice(num_replicas)}"))
            return


def _why_unsure(term: _Term, mixed: bool) -> str:
    small = [f for f in term.factors if f < 1]
    why = ""
    if small:
        shown = ", ".join(f"{f:.4g}" for f in small)
        why = f", times {shown} (neither 1/num_replicas_in_sync nor rows/global batch size)"
    elif term.unsure:
        why = ", times a factor not read here (a device's tensor, or another computed value)"
    if mixed:
        why += ", added to a term that is scaled (an unscaled regularization or auxiliary term?)"
    return why


_warned: weakref.WeakSet = weakref.WeakSet()
_warned_lock = threading.Lock()


def _warn_once(strategy: Any, message: str) -> None:
    with _warned_lock:
        if strategy in _warned:
            return
        _warned.add(strategy)
    warn_at_users_line(message, LossScalingWarning)
