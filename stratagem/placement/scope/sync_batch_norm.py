"""``torch.nn.SyncBatchNorm`` under a strategy: batch statistics over every replica and worker.

torch's own ``SyncBatchNorm`` needs CUDA and a ``torch.distributed`` process group: under
``MirroredStrategy`` (replica threads, no process group) it normalizes each replica's slice
alone, and under ``MultiWorkerMirroredStrategy`` on CPU it fails inside torch. A
``torch.nn.SyncBatchNorm`` that registers its tensors in a synchronous strategy's scope (built
there, or made there by ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``) gets the subclass
:class:`SyncBatchNorm` below instead (its class is replaced, as a scoped optimizer's is; its
name, ``isinstance`` checks, state dict and pickling stay torch's). In training mode its
forward combines the batch statistics of every replica of every worker -- TensorFlow's
``SyncBatchNormalization``, Horovod's ``SyncBatchNorm`` -- so that a model trains as plain
PyTorch does on the whole global batch:

- forward: each replica computes its slice's count, mean and sum of squared deviations per
  channel; one all-gather through the strategy's collective gives everyone every replica's,
  combined exactly (Chan's parallel formula: uneven slices, empty ones included); the input is
  normalized with the global mean and biased variance; the running statistics are updated
  with the global mean and the *unbiased* global variance, as torch does;
- backward: one all-reduce of the two per-channel sums of the output gradient (``sum dy`` and
  ``sum dy * x_hat``) gives the input gradient of the whole batch; the weight and bias get this
  replica's own sums, which the strategy's gradient sum adds up like every other gradient.

Who takes part: inside ``strategy.run``, every replica (the replica threads and the workers);
outside ``run``, this process as one contribution (with one replica per worker, the code
outside ``run`` is that replica); eval mode uses the running statistics and exchanges nothing.
The collective and the replica are captured by the forward, so a backward that autograd runs
on another thread (a CUDA device thread, where no replica context is set) still speaks for
its replica.

Placements that cannot keep this promise (the mesh family: tensor and pipeline parallel)
refuse the first training-mode forward, naming the fix (:func:`refusal`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem import _context
from stratagem.comm import agreement
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.placement.scope.hooks import module_placement
from stratagem.values import ReduceOp

#: what the collectives of this module say in a mismatch across workers
_WORDS = "(torch.nn.SyncBatchNorm statistics)"


def adopt(module: nn.Module) -> None:
    """``module`` registered a tensor in a strategy's scope: a torch ``SyncBatchNorm`` becomes ours."""
    if type(module) is nn.SyncBatchNorm:
        module.__class__ = SyncBatchNorm


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's ``SyncBatchNorm`` whose training-mode statistics span the replicas of the strategy
    it was built under (see the module's docstring); anywhere else it is torch's.

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
                torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
        x = torch.randn(8, 3, 6, 6)
        out = strategy.gather(strategy.run(model, args=(strategy.experimental_distribute_values_from_function(
            lambda ctx: x[4 * ctx.replica_id_in_sync_group:][:4]),)), axis=0)
        plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        plain.load_state_dict(model.state_dict())
        torch.testing.assert_close(out, plain(x))   # the whole batch's statistics
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)   # running statistics (or the batch's, untracked): no exchange
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        group = _group(self)
        if group is None:   # one replica in all (torch's own would want a GPU where a process group exists)
            return F.batch_norm(input, *self._statistics(), self.weight, self.bias, True, self._factor(), self.eps)
        running_mean, running_var = self._statistics()
        return _SyncBatchNorm.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                    self._factor(), group)

    def _factor(self) -> float:
        """The running statistics' update factor, counting this batch (torch's rule)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return factor

    def _statistics(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.track_running_stats:
            return self.running_mean, self.running_var
        return None, None


def refusal(placement: Any) -> str:
    """Why a training-mode ``SyncBatchNorm`` cannot be synchronized under ``placement``."""
    return (f"torch.nn.SyncBatchNorm cannot combine batch statistics under {placement.strategy!r}: its "
            f"replicas split the model itself (tensor or pipeline parallel), so a layer's slice of the batch "
            f"is not one replica's. Use a normalization without batch statistics (torch.nn.LayerNorm, "
            f"torch.nn.GroupNorm), or torch.nn.BatchNorm (statistics of each data-parallel replica's batch), "
            f"or train the model under MirroredStrategy or MultiWorkerMirroredStrategy")


class _Group:
    """Who a forward's statistics are combined with, kept for its backward: the strategy's
    collective and this replica's local id, or None (outside ``run``: this process, over the
    workers)."""

    __slots__ = ("collective", "local_id")

    def __init__(self, collective: Any, local_id: int | None):
        self.collective, self.local_id = collective, local_id

    def gather(self, stats: torch.Tensor) -> torch.Tensor:
        with agreement.noted(_WORDS):
            if self.local_id is None:
                return self.collective.worker_gathers([stats], 0, "torch.nn.SyncBatchNorm")[0]
            return self.collective.all_gather(self.local_id, [stats], 0)[0]

    def sum(self, sums: torch.Tensor) -> torch.Tensor:
        with agreement.noted(_WORDS):
            if self.local_id is None:
                return self.collective.worker_sums([sums], "torch.nn.SyncBatchNorm")[0]
            return self.collective.all_reduce(self.local_id, [sums], ReduceOp.SUM)[0]


def _group(module: nn.Module) -> _Group | None:
    """Whom ``module``'s training-mode forward on this thread combines with; None: nobody else."""
    from_scope = module_placement(module)
    if from_scope is None:
        return None
    if not from_scope.synchronizes_batch_norm:
        raise InvalidArgumentError(refusal(from_scope))
    collective = from_scope.collective
    frame = _context.current_frame()
    ctx = frame.replica_context if frame is not None else None
    if ctx is not None and not frame.strategy.is_default:
        if frame.strategy is not from_scope.strategy:
            raise ContextError(
                f"a torch.nn.SyncBatchNorm created in the scope of {from_scope.strategy!r} was called inside "
                f"run of {frame.strategy!r}; use each module only with the strategy it was created under")
        return _Group(collective, ctx.local_replica_id) if collective.num_replicas > 1 else None
    return _Group(collective, None) if collective.num_workers > 1 else None


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``x`` (channels on dimension 1)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalization over the whole global batch (forward and backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, group: _Group) -> torch.Tensor:
        channels = x.shape[1]
        acc = torch.promote_types(x.dtype, torch.float32)   # statistics of half inputs in float32
        xa = x.to(acc)
        count = xa.numel() // channels
        if count:
            var, mean = torch.var_mean(xa, dim=_reduced_dims(xa), correction=0)
        else:   # an empty slice takes part with nothing
            var = mean = xa.new_zeros(channels)
        mine = torch.cat([mean.new_full((1,), float(count)), mean, var * count]).to(torch.float64)
        everyone = group.gather(mine.unsqueeze(0)).to(mine.device)   # [replicas, 1 + 2C]
        counts, means, squares = everyone[:, :1], everyone[:, 1:1 + channels], everyone[:, 1 + channels:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over every "
                             f"replica (input size {list(x.shape)} on this one)")
        global_mean = (counts * means).sum(0) / total
        deviations = (squares + counts * (means - global_mean) ** 2).sum(0)   # Chan et al.: exact for any split
        global_var = deviations / total
        invstd = torch.rsqrt(global_var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((deviations / (total - 1)).to(running_var.dtype), alpha=momentum)
        mean_acc, invstd_acc = global_mean.to(acc), invstd.to(acc)
        y = (xa - _channel_view(mean_acc, xa)) * _channel_view(invstd_acc, xa)
        if weight is not None:
            y = y * _channel_view(weight.to(acc), xa)
        if bias is not None:
            y = y + _channel_view(bias.to(acc), xa)
        ctx.save_for_backward(x, weight, mean_acc, invstd_acc)
        ctx.total, ctx.group = total.item(), group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, mean, invstd = ctx.saved_tensors
        acc = mean.dtype
        dy, xa = grad.to(acc), x.to(acc)
        dims = _reduced_dims(xa)
        x_hat = (xa - _channel_view(mean, xa)) * _channel_view(invstd, xa)
        sum_dy = dy.sum(dims) if xa.numel() else dy.new_zeros(mean.shape)
        sum_dy_xhat = (dy * x_hat).sum(dims) if xa.numel() else dy.new_zeros(mean.shape)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:   # the same on every replica: the same model
            both = ctx.group.sum(torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64)).to(dy.device, acc)
            total_dy, total_dy_xhat = both.split(mean.numel())
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = (dy - _channel_view(total_dy / ctx.total, xa)
                      - x_hat * _channel_view(total_dy_xhat / ctx.total, xa)) * _channel_view(scale, xa)
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
