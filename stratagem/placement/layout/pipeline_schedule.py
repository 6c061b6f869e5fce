"""One pipelined forward-and-backward over the micro-batches of a batch, on torch's schedules.

torch's ``PipelineStage`` learns the shapes of the tensors it receives from the first
micro-batch it sees and keeps them: every micro-batch of every later step must have
that shape. So this module keeps one stage and schedule per micro-batch shape (built
when a shape first appears, on every process of the pipeline at the same step since
they all see the same batch), and makes every micro-batch of a step the same size:

- a batch of ``B`` rows is cut into ``m`` micro-batches of ``ceil(B / m)`` rows; when
  ``m`` does not divide ``B``, the short micro-batches are filled up with copies of a
  real row (padding);
- the schedule's ``target`` is not the user's target but each row's index in the batch
  (``-1`` for padding). The loss of a micro-batch is the user's loss over its real rows
  only, weighted by their share of the global batch (``rows / B_global``; summed over
  the data axis later); padding rows never reach a loss, so they get no gradient.

The step's gradient is then the gradient of the user's (mean) loss over the whole
global batch, whatever ``B`` and ``m``; the losses are summed on the process holding the
last stage and broadcast over the pipe axis, so every process returns the same value.
"""

from __future__ import annotations

import collections
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from stratagem.comm.collective import Collective
from stratagem.errors import InvalidArgumentError
from stratagem.observe import record
from stratagem.placement.layout import recompute
from stratagem.placement.layout.stages import SplitModel
from stratagem.placement.layout.pipeline_plan import SCHEDULES

#: micro-batch shapes kept per model (each holds torch's stages and receive buffers)
MAX_SHAPES = 8


class _Loss:
    """The schedule's loss function: the user's loss over a micro-batch's real rows, weighted."""

    def __init__(self) -> None:
        self.loss_fn: Callable | None = None
        self.target: Any = None
        self.total = 1
        self.padded = False       # whether some rows of this step are padding
        self.kept: list | None = None   # (rows, output) of each micro-batch, when the outputs are asked for

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        real = rows >= 0
        count = int(real.sum()) if self.padded else rows.numel()   # (no device sync without padding)
        if count == 0:   # a micro-batch of padding only (a batch smaller than num_microbatches)
            return sum(o.sum() for o in output) * 0.0 if isinstance(output, tuple) else output.sum() * 0.0
        if count < rows.numel():
            output = tuple(o[real] for o in output) if isinstance(output, tuple) else output[real]
            rows = rows[real]
        if self.kept is not None:
            kept = tuple(o.detach() for o in output) if isinstance(output, tuple) else output.detach()
            self.kept.append((rows, kept))
        target = None if self.target is None else self.target[rows]
        loss = self.loss_fn(output) if target is None else self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise InvalidArgumentError(
                f"the pipeline's loss_fn must return a scalar tensor (the mean loss of the micro-batch it "
                f"is given), got {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}")
        return loss * (count / self.total)


class PipelineSchedules:
    """Stages and schedules of one split model, per micro-batch shape; runs a step."""

    def __init__(self, split: SplitModel, *, schedule: str, num_microbatches: int, pipe_rank: int,
                 pipe: Collective, data: Collective, device: torch.device, same_shape_over_data: bool = False):
        self.split = split
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.pipe_rank = pipe_rank
        self.pipe, self.data, self.device = pipe, data, device
        # FSDP over the data axis: a new micro-batch shape runs torch's shape inference, whose forward
        # gathers parameters over data, so every data group pads its batch to the longest one's shape
        self.same_shape_over_data = same_shape_over_data and data.num_workers > 1
        self._loss = _Loss()
        self._built: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        layout = split.layout
        self.first = 0 in split.stages
        self.last = layout.num_stages - 1 in split.stages
        self.last_rank = layout.rank_of(layout.num_stages - 1)

    def step(self, inputs: tuple[torch.Tensor, ...], target: Any, loss_fn: Callable,
             return_outputs: bool = False) -> Any:
        """Forward and backward of every micro-batch; this data group's share of the mean loss
        (and, with ``return_outputs``, the model's output for the batch, on every process)."""
        rows = inputs[0].shape[0]
        for x in inputs:
            if x.shape[0] != rows:
                raise InvalidArgumentError(
                    f"the model's inputs must share their first (batch) dimension, got "
                    f"{[tuple(t.shape) for t in inputs]}")
        if target is not None and (not isinstance(target, torch.Tensor) or target.shape[0] != rows):
            raise InvalidArgumentError(
                f"the target must be a tensor with one row per example ({rows}), got "
                f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
        self._check_same_batch(inputs, rows)
        total, empty, longest = rows, rows == 0, rows
        if self.data.num_workers > 1:   # the global batch: every data group's rows
            counts = torch.tensor([rows, int(rows == 0)], device=self.data.group.device)
            total, empty = self.data.group.all_reduce(counts, "forward_backward (global batch size)").tolist()
        if self.same_shape_over_data:
            most = torch.tensor([rows], device=self.data.group.device)
            longest = int(self.data.group.all_reduce(most, "forward_backward (longest batch)", op="max").item())
        if empty:
            raise InvalidArgumentError(
                f"forward_backward got an empty batch (0 rows) on {'some data group' if total else 'every process'}: "
                f"every pipeline needs at least one row per step; drop a global batch smaller than the number "
                f"of data groups ({self.data.num_workers})")
        order = _row_order(rows, self.num_microbatches, longest)
        if order is not None:
            inputs = tuple(x[order.clamp(min=0).to(x.device)] for x in inputs)
        index = order if order is not None else torch.arange(rows)
        schedule = self._schedule_for(inputs)
        self._loss.loss_fn, self._loss.target, self._loss.total = loss_fn, target, total
        self._loss.padded = order is not None
        self._loss.kept = [] if return_outputs and self.last else None
        losses: list[torch.Tensor] = []
        try:
            with self.pipe.group.guard("forward_backward (the pipeline schedule)"):
                schedule.step(*(inputs if self.first else ()),
                              target=index.to(self.device) if self.last else None,
                              losses=losses if self.last else None, return_outputs=False)
        finally:
            self._loss.target, kept, self._loss.kept = None, self._loss.kept, None
        loss = self._broadcast_loss(losses, inputs[0])
        return (loss, self._share_outputs(kept, rows)) if return_outputs else loss

    def _check_same_batch(self, inputs: tuple[torch.Tensor, ...], rows: int) -> None:
        """Every process of the pipeline got a batch of the same shapes (else all raise, none waits)."""
        if self.pipe.num_workers == 1:
            return
        shapes = zlib.crc32(repr([(tuple(x.shape), str(x.dtype)) for x in inputs]).encode())
        mine = torch.tensor([rows, shapes, -rows, -shapes], dtype=torch.int64, device=self.pipe.group.device)
        group = self.pipe.group
        with group.guard("forward_backward (the batch shapes of the pipeline)"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group.group)
        high, low = mine[:2].tolist(), [-v for v in mine[2:].tolist()]
        if high != low:
            raise InvalidArgumentError(
                f"the processes of a pipeline got batches of different shapes at this step (between {low[0]} and "
                f"{high[0]} rows; this process: {[tuple(x.shape) for x in inputs]}); every process of a pipeline "
                f"must call forward_backward with the same batch: distribute the input with "
                f"strategy.experimental_distribute_dataset")

    def _schedule_for(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        key = (tuple((tuple(x.shape), x.dtype) for x in inputs), self.split.mode())
        built = self._built.get(key)
        if built is not None:
            self._built.move_to_end(key)
            return built
        layout = self.split.layout
        group = self.pipe.group.group
        micro = tuple(x.narrow(0, 0, x.shape[0] // self.num_microbatches) for x in inputs)   # (padded: divides)
        modules = self.split.modules_for(micro)
        recompute.apply(modules, layout.recompute, self.split.model,
                        check_over=self.pipe if self.split.traced is not None else None)
        stages = [record.watch_stage(_without_side_effects(PipelineStage(module, s, layout.num_stages, self.device,
                                                                         group=group)), s)
                  for s, module in sorted(modules.items())]
        cls = getattr(schedules, SCHEDULES[self.schedule][0])
        if SCHEDULES[self.schedule][2] == 1:
            built = cls(stages[0], n_microbatches=self.num_microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            built = cls(stages, n_microbatches=self.num_microbatches, loss_fn=self._loss, scale_grads=False)
        self._built[key] = built
        if len(self._built) > MAX_SHAPES:
            self._built.popitem(last=False)
        return built

    def _broadcast_loss(self, losses: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        if losses:
            loss = torch.stack([l.detach().to(dtype) for l in losses]).sum()
        else:
            loss = torch.zeros((), dtype=dtype, device=self.device)
        if self.pipe.num_workers > 1:
            group = self.pipe.group
            with group.guard("forward_backward (the loss from the last stage)"):
                dist.broadcast(loss, src=group.global_rank(self.last_rank), group=group.group)
        return loss

    def _share_outputs(self, kept: list | None, rows: int) -> Any:
        """The last stage's outputs of the micro-batches, in batch order, sent over the pipe axis."""
        outputs = None
        if kept is not None:
            index = torch.cat([r for r, _ in kept])
            columns = zip(*((o if isinstance(o, tuple) else (o,)) for _, o in kept))
            outputs = tuple(_in_order(torch.cat(parts), index, rows) for parts in columns)
        if self.pipe.num_workers > 1:
            sent = None if outputs is None else tuple(o.cpu() for o in outputs)
            outputs = self.pipe.group.broadcast_object(sent, "forward_backward (the outputs of the last stage)",
                                                       src=self.last_rank)
            outputs = tuple(o.to(self.device) for o in outputs)
        return outputs[0] if len(outputs) == 1 else outputs


def _without_side_effects(stage: PipelineStage) -> PipelineStage:
    """``stage``, whose shape inference leaves the module's buffers as they were.

    A new stage learns its shapes by running its module once, before the schedule's real
    forwards, on uninitialised tensors of the micro-batch's shape (torch forks the random
    generators around it): that run would move BatchNorm's running statistics by garbage.
    The buffers are copied when the inference starts and written back once torch has dropped
    the inference's graph (writing them earlier would change tensors that graph saved); so are
    the parameters' gradients, which torch's cleanup drops under FSDP.
    """
    infer = getattr(stage, "_forward_metadata_inference", None)
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if infer is None or cleanup is None:   # another torch: its inference is its own
        return stage
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    grads: dict[int, tuple[torch.Tensor, Any]] = {}   # (torch's cleanup drops FSDP gradients)

    def keep_buffers(*args: Any, **kwargs: Any) -> Any:
        if not saved:
            saved.extend((buffer, buffer.detach().clone()) for buffer in stage.submod.buffers())
        if not grads:
            grads.update((id(p), (p, p.grad)) for p in stage.submod.parameters())
        return infer(*args, **kwargs)

    def put_back() -> None:
        cleanup()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        for param, grad in grads.values():   # what earlier forward_backward calls of the step accumulated
            param.grad = grad
        saved.clear()
        grads.clear()

    stage._forward_metadata_inference = keep_buffers
    stage._post_metadata_inference_cleanup = put_back
    return stage


def _in_order(parts: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    ordered = parts.new_empty((rows, *parts.shape[1:]))
    ordered[index.to(parts.device)] = parts
    return ordered


def _row_order(rows: int, num_microbatches: int, longest: int = 0) -> torch.Tensor | None:
    """Each padded row's index in the batch (-1: padding), micro-batch after micro-batch, every micro-batch
    as long as those of a batch of ``max(rows, longest)`` rows; None: no padding."""
    size = -(-max(rows, longest) // num_microbatches)
    if size * num_microbatches == rows:
        return None
    counts = [len(c) for c in torch.arange(rows).tensor_split(num_microbatches)]
    order, start = [], 0
    for count in counts:
        order += list(range(start, start + count)) + [-1] * (size - count)
        start += count
    return torch.tensor(order)


def forward_only(split: SplitModel, inputs: tuple[torch.Tensor, ...], *, pipe_rank: int, pipe: Collective,
                 device: torch.device) -> Any:
    """The model's output for the whole batch, on every process of the pipeline (no gradients).

    The stages run one after the other, the whole batch at once (no micro-batches: a pass for
    evaluation, not for speed); where the next stage lives on another process, the activations
    travel from the process that computed them to every process of the pipeline.
    """
    layout = split.layout
    value: Any = inputs
    modules = split.modules_for(inputs)
    with torch.no_grad():
        for stage in range(layout.num_stages):
            owner = layout.rank_of(stage)
            if owner == pipe_rank:
                value = modules[stage](*value)
                value = value if isinstance(value, tuple) else (value,)
            last = stage == layout.num_stages - 1
            if pipe.num_workers > 1 and (last or layout.rank_of(stage + 1) != owner):
                sent = tuple(v.cpu() for v in value) if owner == pipe_rank else None
                value = pipe.group.broadcast_object(sent, "predict (activations between stages)", src=owner)
                value = tuple(v.to(device) for v in value)
    return value[0] if len(value) == 1 else value
