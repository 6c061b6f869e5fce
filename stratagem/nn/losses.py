"""Per-replica losses whose gradients, summed over replicas, equal the single-device ones."""

from __future__ import annotations

import torch

from stratagem import _context
from stratagem.errors import InvalidArgumentError


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
    if global_batch_size is None:
        global_batch_size = _current_global_batch_size(per_example_loss.shape[0])
    elif not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0:
        raise InvalidArgumentError(f"global_batch_size must be a positive int or None, got {global_batch_size!r}")
    return loss.sum() / global_batch_size


def _current_global_batch_size(local_size: int) -> int:
    ctx = _context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return local_size or 1
    if ctx.global_batch_size is not None:
        return ctx.global_batch_size
    return int(ctx.all_reduce("sum", local_size)) or 1


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """``regularization_loss / num_replicas_in_sync``: added on every replica, it sums to one copy."""
    ctx = _context.get_replica_context()
    num_replicas = ctx.num_replicas_in_sync if ctx is not None else _context.get_strategy().num_replicas_in_sync
    return regularization_loss / num_replicas
