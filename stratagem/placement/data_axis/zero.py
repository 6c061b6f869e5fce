"""ZeroUpdate: mirrored parameters with the optimizer update sharded over the workers (ZeRO).

The parameters of every optimizer created in scope are laid end to end and cut into one
contiguous range per worker. Worker ``r`` keeps the optimizer state of range ``r`` only
(a range optimizer over views of its parameters: :mod:`.zero_ranges`, the ranges a pipeline's
data axis is cut in too) and updates only that range; the updated ranges are then all-gathered
so that every worker again holds the whole model for the next forward pass.

Stages (``MultiWorkerMirroredStrategy(sharding=...)``):

- ``"optimizer"`` (ZeRO-1): gradients are all-reduced as without sharding (in packs
  launched during backward; ``.grad`` is the whole sum when backward returns), each worker
  updates its range from the summed gradient;
- ``"gradients"`` (ZeRO-2): the gradients are reduce-scattered in packs launched during
  backward (:mod:`stratagem.comm.scattered_gradients`), so each worker only ever receives the
  summed gradient of its own range, and the local gradients are freed pack by pack.
  ``param.grad`` is None after backward; ``clip_grad_norm_`` over the parameters finishes the
  packs early, measures every worker's range and scales this worker's, which the step then
  applies (:mod:`stratagem.placement.scope.clipping`).

Stage 3 (``"parameters"``) is :mod:`stratagem.placement.layout.fully_sharded`. Stages 1 and 2 are this
update rule of the mirrored placement (:mod:`.update_rule`): the modules are mirrored (one
replica per worker), the step runs in the order of :mod:`.step`, only the update differs.

``optimizer.state_dict()`` reads as one logical optimizer: it gathers every worker's
ranges, so every worker must call it (as every worker calls ``Checkpoint.save``, which
gathers the state on every worker once and lets the chief write it).
``load_state_dict`` takes one logical state dict; each worker keeps its slices.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from stratagem._profiling import label
from stratagem._record import record
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping
from stratagem.placement.scope.hooks import base_of, placement_of, step_hooks
from stratagem.placement.data_axis.sharded_update import ShardedUpdate
from stratagem.placement.data_axis.update_rule import UpdateRule, params_of
from stratagem.placement.data_axis.zero_ranges import ZeroRanges

#: ``sharding=`` values, and the ones that exist only as names so far
STAGES = ("optimizer", "gradients", "parameters")


def check_sharding(sharding: Any, num_local_replicas: int) -> None:
    """Refuse a ``sharding`` value this strategy cannot run, before anything starts."""
    if sharding is None:
        return
    if sharding not in STAGES:
        raise InvalidArgumentError(
            f"sharding must be None, 'optimizer', 'gradients' or 'parameters', got {sharding!r}")
    if num_local_replicas != 1:
        raise InvalidArgumentError(
            f"sharding={sharding!r} needs one replica per worker (the model's state is split between "
            f"workers), "
            f"got {num_local_replicas} local devices; run one process per device (e.g. "
            f"`stratagem launch --workers N` or torchrun) and pass devices=[one device] or none")


class ZeroUpdate(UpdateRule):
    """One replica per worker; the optimizer state and update sharded over the workers (or, bound to
    a pipeline's data axis, over its data ranks: :mod:`.pipeline_optimizers`).

    Example::

        import stratagem as sg
        from stratagem.placement.data_axis.zero import ZeroUpdate
        strategy = sg.MultiWorkerMirroredStrategy(sharding="optimizer")   # no cluster: one worker
        assert isinstance(strategy.placement.update, ZeroUpdate)
        assert strategy.placement.update.stage == "optimizer"
    """

    kind = "Mirrored"

    def __init__(self, stage: str):
        if stage not in ("optimizer", "gradients"):
            raise InvalidArgumentError(
                f"ZeroUpdate's stage must be 'optimizer' or 'gradients' (sharding='parameters' is "
                f"FullyShardedPlacement), got {stage!r}")
        #: ``"optimizer"`` (ZeRO-1) or ``"gradients"`` (ZeRO-2)
        self.stage = stage
        #: stage 1 sums whole gradients when backward ends; stage 2 reduce-scatters them instead
        self.sums_gradients = stage == "optimizer"
        # id(parameter) -> the ranges whose packs take its gradients (sharding="gradients")
        self._ranges_by_param: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def bind(self, placement: Any, axis: Any = None) -> None:
        """Serve ``placement`` over its workers, or over ``axis``, a pipeline's data axis: there stage 2
        sums when the schedule ends (:meth:`.zero_ranges.ZeroRanges.reduce`, called by the placement),
        which also answers clipping."""
        check_sharding(self.stage, placement.num_replicas)
        super().bind(placement, axis)
        self.over_data_axis = axis is not None
        if self.stage == "gradients" and not self.over_data_axis:
            clipping.register(placement)   # no worker holds a whole gradient: clipping asks the placement

    @property
    def _rank(self) -> int:
        return self.collective.worker_index

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate:
        """The range optimizers of ``optimizer``: one range per worker, built at first use."""
        return self.ranges(optimizer).sharded

    def ranges(self, optimizer: torch.optim.Optimizer) -> ZeroRanges:
        """``optimizer``'s ranges over the workers (:mod:`.zero_ranges`), built at first use."""
        mine = record(optimizer)
        if mine.sharded is False:
            self.placement.finalize()
            packs = self.stage == "gradients" and self.collective.num_workers > 1 and not self.over_data_axis
            between, instead = ("the data ranks", " or sharding=None / 'parameters'") if self.over_data_axis \
                else ("workers", " or sharding=None")
            with self._lock:
                ranges = ZeroRanges(optimizer, self.collective, self.stage, between=between, instead=instead, packs=packs,
                                    bytes_per_pack=self.collective.options.bytes_per_pack if packs else 0)
                if ranges.scattered is not None:
                    for p in ranges.params:   # one set of hooks per parameter: the newest optimizer's
                        older = self._ranges_by_param.get(id(p))
                        if older is not None:
                            older.scattered.close()
                    for p in ranges.params:
                        self._ranges_by_param[id(p)] = ranges
                mine.sharded, mine.zero = ranges.sharded, ranges
        return mine.zero

    def grad_scaler_refusal(self) -> str | None:
        if self.stage == "optimizer":
            return None   # whole gradients on every worker, as without sharding
        return (f"with sharding={self.stage!r} each worker only ever holds its share of the summed "
                f"gradients, inside optimizer.step(), where GradScaler.unscale_ cannot see them; use "
                f"sharding='optimizer' for float16 with a GradScaler")

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if self.stage == "gradients":   # the packs' hooks must exist before the first backward
            try:
                self.sharded(optimizer)
            except InvalidArgumentError:
                pass   # raised again, to the user, at the optimizer's first use

    # ---------------------------------------------------------------- step

    # the primitives of placement/data_axis/step.py

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        """The gradient of each piece of this worker's range: stage 1, of the whole sums in ``.grad``
        since backward ended; stage 2, of this worker's range of the sum (the packs reduce-scattered
        during backward)."""
        ranges = self.ranges(optimizer)
        # (over a pipeline's data axis, .grad moves into the range at the step even on one data rank)
        reduced = self.stage == "gradients" and (self.collective.num_workers > 1 or self.over_data_axis)
        if self.stage == "gradients" and step_hooks(optimizer)[0]:
            raise InvalidArgumentError(
                "optimizer step pre-hooks see whole gradients, which sharding='gradients' never "
                "forms; remove the hook or use sharding='optimizer'")
        if not reduced:
            return ranges.gradients(False)
        with label("stratagem.gradients.cross_worker"):
            return ranges.gradients(True)

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        """This worker's range of the update (the user's hooks fire once, outside)."""
        return record(optimizer).sharded.step(self._rank, gradients)

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        """Every worker's updated range reaches every worker (all-gather)."""
        if self.collective.num_workers > 1:
            with label("stratagem.parameters.all_gather"):
                self.ranges(optimizer).gather()
        return None

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        return params_of(optimizer)   # one replica per worker: the parameters themselves

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        return None   # one replica per worker: no other copy to reach

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        """The parameters whose gradients packs take during backward (several workers)."""
        found = [self._ranges_by_param.get(id(p)) for p in params]
        return [ranges is not None and ranges.scattered.takes(p) for ranges, p in zip(found, params)]

    def reduce_scattered(self, params: list[torch.Tensor]) -> list[ZeroRanges]:
        """The ranges whose packs take gradients of ``params`` (clipping's pieces: :class:`~.axis.DataAxis`)."""
        found = (self._ranges_by_param.get(id(p)) for p in params)
        return list(dict.fromkeys(ranges for ranges in found if ranges is not None))

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if self.placement.gradients is not None:
            self.placement.gradients.forget(params_of(optimizer))
        base_of(optimizer).zero_grad(optimizer, set_to_none)
        ranges = record(optimizer).zero
        if ranges is not None:
            ranges.discard()   # a clip's sum that no step used; what packs reduced with no step after

    # --------------------------------------------------------- state dicts

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        mine = record(optimizer)
        ready, mine.gathered_state = mine.gathered_state, None   # read once
        result = base_of(optimizer).state_dict(optimizer)
        result["state"] = ready if ready is not None else self.gather_state(optimizer)
        return result

    def gather_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
        """Every worker's ranges of the state, merged as one optimizer's (a collective)."""
        return self.ranges(optimizer).state("optimizer.state_dict (sharded state)")

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        ranges = self.ranges(optimizer)
        base_of(optimizer).load_state_dict(optimizer, {**state_dict, "state": {}})
        ranges.load(state_dict["state"])

    @contextlib.contextmanager
    def prepare_checkpoint(self, objects: dict[str, Any]) -> Iterator[None]:
        """Every worker, around the chief's writing: gather each sharded optimizer's state once.

        The writer reads it once, in ``state_dict()``; what a failed write left unread is
        dropped on exit, so a later ``state_dict()`` gathers afresh with the other workers.
        """
        sharded = [obj for obj in objects.values()
                   if isinstance(obj, torch.optim.Optimizer) and placement_of(obj) is self.placement]
        for optimizer in sharded:
            state = self.gather_state(optimizer)
            if self._rank == 0:
                record(optimizer).gathered_state = state
        try:
            yield
        finally:
            for optimizer in sharded:
                record(optimizer).gathered_state = None
