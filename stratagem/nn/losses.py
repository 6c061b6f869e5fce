"""Per-replica losses whose gradients, summed over replicas, equal the single-device ones.

A synchronous strategy sums the replicas' gradients, so a replica's loss is its share of the
global batch's loss. The losses these functions return are marked as scaled, and a loss that
is a per-replica mean instead is refused (or warned about) at ``backward()``
(:mod:`stratagem.nn.loss_check`).
"""

from __future__ import annotations

import torch

from stratagem import _context
from stratagem.errors import InvalidArgumentError
from stratagem.nn.loss_check import mark


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None,
                         sample_weight: torch.Tensor | float | None = None) -> torch.Tensor:
    """Sum of (weighted) per-example losses divided by the *global* batch size.

    With ``global_batch_size=None`` the true size of the current global batch is
    used, also for an uneven last batch: it comes from the distributed dataset when
    the batch came from one, and is otherwise summed over replicas.

    Example::

        import torch, stratagem as sg
        loss = sg.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]))
        assert loss.item() == 2.0
    """
    if not isinstance(per_example_loss, torch.Tensor):
        raise InvalidArgumentError(
            f"per_example_loss must be a tensor of per-example losses, got {type(per_example_loss).__name__}")
    if per_example_loss.dim() == 0:
        raise InvalidArgumentError(
            "per_example_loss is a scalar; compute it with reduction='none' so that it has one "
            "entry per example, e.g. F.cross_entropy(logits, y, reduction='none')")
    loss = per_example_loss
    if sample_weight is not None:
        loss = loss * torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
    scaled_for = None   # a global batch size given: exact whatever the replicas in sync
    if global_batch_size is None:
        global_batch_size, scaled_for = _global_batch_and_replicas(per_example_loss.shape[0])
    elif not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0:
        raise InvalidArgumentError(f"global_batch_size must be a positive int or None, got {global_batch_size!r}")
    return mark(loss.sum() / global_batch_size, "compute_average_loss", scaled_for)


def current_global_batch_size(local_size: int) -> int:
    """The current global batch's size, for a replica with ``local_size`` rows of it."""
    return _global_batch_and_replicas(local_size)[0]


def _global_batch_and_replicas(local_size: int) -> tuple[int, int]:
    """The global batch's size, and the replicas in sync it was found for."""
    ctx = _context.acting_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return local_size or 1, 1 if ctx is None else ctx.num_replicas_in_sync
    if ctx.global_batch_size is not None:
        return ctx.global_batch_size, ctx.num_replicas_in_sync
    return int(ctx.all_reduce("sum", local_size)) or 1, ctx.num_replicas_in_sync


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """``regularization_loss / num_replicas_in_sync``: added on every replica, it sums to one copy.

    Example::

        import torch, stratagem as sg
        weight = torch.ones(3, requires_grad=True)
        loss = sg.nn.scale_regularization_loss(1e-4 * weight.pow(2).sum())   # one replica: unchanged
    """
    n = _num_replicas()
    return mark(regularization_loss / n, "scale_regularization_loss", n)


def mean_over_replicas(loss: torch.Tensor) -> torch.Tensor:
    """``loss / num_replicas_in_sync``: DistributedDataParallel's averaging, for a per-replica mean.

    DDP averages the replicas' gradients; stratagem sums them. Dividing each replica's mean
    loss by the number of replicas gives DDP's result: exactly the single-device gradient when
    every replica's batch has the same size, and, for an uneven last batch, the average of the
    replicas' means (an example of a smaller batch weighs more, as under DDP).
    :func:`compute_average_loss` is exact for uneven batches too.

    A token mean is not a per-example mean: with ignored labels (``-100``) falling unevenly over
    the replicas, this of each replica's token mean is not the global token mean. The exact form
    divides the sum of token losses by the global number of counted tokens, e.g. inside ``run``
    ``tokens = sg.get_replica_context().all_reduce("sum", int((y != -100).sum()))`` and
    ``compute_average_loss(per_token_losses, global_batch_size=int(tokens))`` (or that count as
    Hugging Face's ``num_items_in_batch=``).

    Example::

        import torch, torch.nn.functional as F, stratagem as sg
        logits, labels = torch.randn(4, 3, requires_grad=True), torch.tensor([0, 1, 2, 0])
        loss = sg.nn.mean_over_replicas(F.cross_entropy(logits, labels))   # one replica: unchanged
        loss.backward()
    """
    n = _num_replicas()
    return mark(loss / n, "mean_over_replicas", n)


def skip_loss_scaling_check(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged, let through the check that refuses a per-replica mean loss.

    Inside ``strategy.run`` with several replicas in sync, ``backward()`` of a loss that is a
    mean over the replica's own examples raises (the replicas' gradients are summed, so it would
    train with N times the gradient). Use this only where the loss is scaled on purpose in a
    way the check cannot see, e.g. gradients divided by hand before ``optimizer.step()``.

    Example::

        import torch, stratagem as sg
        x = torch.ones(2, 3, requires_grad=True)
        loss = sg.nn.skip_loss_scaling_check(x.pow(2).mean())
        loss.backward()
    """
    if not isinstance(loss, torch.Tensor):
        raise InvalidArgumentError(f"skip_loss_scaling_check needs the loss tensor, got {type(loss).__name__}")
    return mark(loss, "skip_loss_scaling_check")


def _num_replicas() -> int:
    ctx = _context.acting_replica_context()
    return ctx.num_replicas_in_sync if ctx is not None else _context.get_strategy().num_replicas_in_sync
