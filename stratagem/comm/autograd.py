"""Differentiable collectives: autograd Functions whose backward is the matching collective.

With these, a collective can sit inside a loss (the building block of tensor
parallelism). For replica ``r`` with input ``x_r`` and output ``y_r`` and a loss that
sums every replica's part, the gradients are:

=================  ==========================  ==========================================
collective         forward                     backward (what each replica computes)
=================  ==========================  ==========================================
all_reduce SUM     ``y_r = sum_s x_s``         all-reduce SUM of the output gradients
all_reduce MEAN    ``y_r = sum_s x_s / N``     all-reduce MEAN of the output gradients
all_gather         ``y_r = cat_s x_s``         reduce-scatter SUM, slice ``r`` its own length
reduce_scatter     ``y_r = (sum_s x_s)[r]``    all-gather of the output gradients (/ N: MEAN)
all_to_all         ``y_r[s] = x_s[r]``         all-to-all of the output gradients, back
broadcast          ``y_r = x_src``             all-reduce SUM; the source keeps it, others 0s
=================  ==========================  ==========================================

``reduce``, ``gather`` and ``scatter`` are not differentiable: a replica that receives
nothing has no output through which its backward could take part.

**Lockstep.** A backward collective is a collective: every replica must run the
backward through it, in the same order. That is what happens when every replica
computes the same loss with the same code, because each replica's backward walks its
own graph in creation order (the autograd engine runs a CPU graph on the thread that
calls ``backward()``, which is the replica's own thread). A replica that skips the
backward leaves the others waiting until it returns from its function, which then
raises ``CollectiveMismatchError`` rather than hanging. Between workers, each decides
alone whether to record the collective (its inputs require grad): the message before the
collective says so (:func:`~stratagem.comm.agreement.noted`), and every worker refuses a
collective that some workers record and others do not. Each Function keeps the replica's ``local_id`` from the forward,
so a backward run on another thread (a CUDA device thread) still speaks for its replica.

``anchor`` is None, or a scalar leaf that requires grad: a replica whose own inputs
need no gradient while another's do passes one, so that its outputs still take part in
the backward (its inputs then get no gradient).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stratagem.comm import agreement
from stratagem.values import ReduceOp

# Across workers, said with the call in its message: a worker whose inputs require grad records
# the collective, and one whose inputs do not would skip its backward (every worker refuses it).
FORWARD, BACKWARD = "(recorded for autograd)", "(in backward)"


def _like(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(t.shape, t.dtype, t.device) for t in tensors]


def _grads(grads: Sequence[torch.Tensor | None], like: Sequence[tuple]) -> list[torch.Tensor]:
    """The output gradients, zeros where autograd passed none (every replica the same)."""
    return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            for g, (shape, dtype, device) in zip(grads, like)]


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, collective: Any, local_id: int, op: ReduceOp, anchor: Any, *tensors: torch.Tensor):
        ctx.collective, ctx.local_id, ctx.op = collective, local_id, op
        with agreement.noted(FORWARD):
            results = collective.all_reduce(local_id, list(tensors), op)
        ctx.like = _like(results)
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        with agreement.noted(BACKWARD):
            summed = ctx.collective.all_reduce(ctx.local_id, _grads(grads, ctx.like), ctx.op)
        return (None, None, None, None, *summed)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, collective: Any, local_id: int, axis: int, anchor: Any, *tensors: torch.Tensor):
        with agreement.noted(FORWARD):
            results, sizes = collective.all_gather_parts(local_id, list(tensors), axis)
        ctx.collective, ctx.local_id, ctx.axis, ctx.sizes = collective, local_id, axis, sizes
        ctx.like = _like(results)
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        collective = ctx.collective
        with agreement.noted(BACKWARD):
            return (None, None, None, None, *[collective.reduce_scatter(ctx.local_id, g, ReduceOp.SUM, ctx.axis, sizes)
                                              for g, sizes in zip(_grads(grads, ctx.like), ctx.sizes)])


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, collective: Any, local_id: int, op: ReduceOp, axis: int, sizes: Any,
                anchor: Any, tensor: torch.Tensor):
        ctx.collective, ctx.local_id, ctx.op, ctx.axis = collective, local_id, op, axis
        with agreement.noted(FORWARD):
            result = collective.reduce_scatter(local_id, tensor, op, axis, sizes)
        ctx.like = _like([result])
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with agreement.noted(BACKWARD):
            full = ctx.collective.all_gather(ctx.local_id, _grads([grad], ctx.like), ctx.axis)[0]
        if ctx.op is ReduceOp.MEAN:
            full = full / ctx.collective.num_replicas
        return None, None, None, None, None, None, full


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, collective: Any, local_id: int, anchor: Any, *tensors: torch.Tensor):
        ctx.collective, ctx.local_id = collective, local_id
        with agreement.noted(FORWARD):
            results = collective.all_to_all(local_id, list(tensors))
        ctx.like = _like(results)
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        with agreement.noted(BACKWARD):
            return (None, None, None, *ctx.collective.all_to_all(ctx.local_id, _grads(grads, ctx.like)))


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, collective: Any, local_id: int, source: int, anchor: Any, *tensors: torch.Tensor):
        ctx.collective, ctx.local_id, ctx.source = collective, local_id, source
        ctx.inputs = _like(tensors)
        with agreement.noted(FORWARD):
            results = collective.broadcast(local_id, list(tensors), source)
        ctx.like = _like(results)
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        collective = ctx.collective
        with agreement.noted(BACKWARD):
            summed = collective.all_reduce(ctx.local_id, _grads(grads, ctx.like), ReduceOp.SUM)
        mine = collective.replica_id(ctx.local_id) == ctx.source
        return (None, None, None, None, *(summed if mine else _grads([None] * len(summed), ctx.inputs)))
