"""ZeroUpdate: mirrored parameters with the optimizer update sharded over the workers (ZeRO).

The parameters of every optimizer created in scope are laid end to end and cut into one
contiguous range per worker. Worker ``r`` keeps the optimizer state of range ``r`` only
(a range optimizer over views of its parameters: :mod:`.sharded_update`) and updates
only that range; the updated ranges are then all-gathered so that every worker again
holds the whole model for the next forward pass.

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
from stratagem.comm import worker_ops
from stratagem.comm.scattered_gradients import ScatteredGradients
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping
from stratagem.placement.scope.hooks import base_of, placement_of, step_hooks
from stratagem.placement.data_axis.sharded_update import ELEMENTWISE, ShardedUpdate
from stratagem.placement.data_axis.update_rule import UpdateRule, params_of

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
    """One replica per worker; the optimizer state and update sharded over the workers.

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
        # id(parameter) -> the layout whose packs take its gradients (sharding="gradients")
        self._layout_by_param: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def bind(self, placement: Any) -> None:
        check_sharding(self.stage, placement.num_replicas)
        super().bind(placement)
        if self.stage == "gradients":
            clipping.register(self)   # no worker holds a whole gradient: clipping asks this rule

    @property
    def _rank(self) -> int:
        return self.collective.worker_index

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate:
        """The range optimizers of ``optimizer``: one range per worker, built at first use."""
        sharded = record(optimizer).sharded
        if sharded is False:
            self.placement.finalize()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            check_splittable(base_of(optimizer), params, self.stage, "workers", " or sharding=None")
            with self._lock:
                sharded = ShardedUpdate(optimizer, lambda p: (p,), self.collective.num_workers)
                layout = _Layout(params, sharded)
                if self.stage == "gradients" and self.collective.num_workers > 1:
                    for p in params:   # one set of hooks per parameter: the newest optimizer's
                        older = self._layout_by_param.get(id(p))
                        if older is not None:
                            older.scattered.close()
                    layout.scattered = ScatteredGradients(
                        params, layout.offsets, layout.bounds, self._rank, self.collective.group,
                        bytes_per_pack=self.collective.options.bytes_per_pack)
                    for p in params:
                        self._layout_by_param[id(p)] = layout
                mine = record(optimizer)
                mine.sharded, mine.zero = sharded, layout
        return sharded

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
        """Stage 1: the whole sums, in ``.grad`` since backward ended. Stage 2: this worker's range
        of the sum (the packs reduce-scattered during backward)."""
        self.sharded(optimizer)
        if self.stage != "gradients":
            return None
        if step_hooks(optimizer)[0]:
            raise InvalidArgumentError(
                "optimizer step pre-hooks see whole gradients, which sharding='gradients' never "
                "forms; remove the hook or use sharding='optimizer'")
        if self.collective.num_workers == 1:
            return None
        with label("stratagem.gradients.cross_worker"):
            return self._reduce_scattered(record(optimizer).zero)

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        """This worker's range of the update."""
        return self.sharded(optimizer).step(self._rank, gradients)

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        """Every worker's updated range reaches every worker (all-gather)."""
        if self.collective.num_workers > 1:
            with label("stratagem.parameters.all_gather"):
                gather_ranges(self.collective.group, record(optimizer).sharded, self._rank, record(optimizer).zero.params)
        return None

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        return params_of(optimizer)   # one replica per worker: the parameters themselves

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        return None   # one replica per worker: no other copy to reach

    def _reduce_scattered(self, layout: "_Layout") -> Any:
        """Sum the gradients over workers, each worker receiving its own range only (the packs
        of :mod:`stratagem.comm.scattered_gradients`, launched during backward)."""
        shard, exists = self._summed(layout)
        layout.summed = None
        base = layout.bounds[self._rank]

        def piece(index: int, start: int, stop: int) -> torch.Tensor | None:
            if not exists[index]:
                return None
            lo = layout.offsets[index] + start - base
            return shard[lo:lo + stop - start]
        return piece

    def _summed(self, layout: "_Layout") -> tuple[torch.Tensor, list[int]]:
        """This worker's range of the step's summed gradients, and which exist: the packs finished
        at the first ask of the step (clipping, else the step), kept until the step uses them. A
        later ask first adds what backward reduced since, if any worker has some (a collective)."""
        if layout.summed is None:
            layout.summed = layout.scattered.finish()
            return layout.summed
        pending = torch.tensor([int(layout.scattered.pending())], dtype=torch.int32)
        if self.collective.group.all_reduce(pending, "gradients since clipping (sharding='gradients')").item():
            shard, exists = layout.scattered.finish()
            layout.summed[0].add_(shard)
            layout.summed = (layout.summed[0], [max(a, b) for a, b in zip(layout.summed[1], exists)])
        return layout.summed

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        """The parameters whose gradients packs take during backward (several workers)."""
        found = [self._layout_by_param.get(id(p)) for p in params]
        return [layout is not None and layout.scattered.takes(p) for layout, p in zip(found, params)]

    def gradient_parts(self, params: list[torch.Tensor]) -> clipping.GradientParts:
        """Clipping: the pieces of this worker's range of the summed gradients that belong to
        ``params`` (the packs finished now, the range kept for the step)."""
        chosen = {id(p) for p in params}
        parts = []
        for layout in dict.fromkeys(self._layout_by_param[id(p)] for p in params):
            shard, exists = self._summed(layout)
            parts += [piece for _, piece in clipping.range_parts(
                shard, exists, [p.numel() for p in layout.params], layout.offsets, layout.bounds[self._rank],
                layout.bounds[self._rank + 1], [id(p) in chosen for p in layout.params])]
        return clipping.GradientParts(parts, parts, self.collective.group)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if self.placement.gradients is not None:
            self.placement.gradients.forget(params_of(optimizer))
        base_of(optimizer).zero_grad(optimizer, set_to_none)
        layout = record(optimizer).zero
        if layout is not None and layout.scattered is not None:
            layout.summed = None             # a clip's sum that no step used
            layout.scattered.discard()   # gradients reduced during a backward that no step followed

    # --------------------------------------------------------- state dicts

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        mine = record(optimizer)
        ready, mine.gathered_state = mine.gathered_state, None   # read once
        result = base_of(optimizer).state_dict(optimizer)
        result["state"] = ready if ready is not None else self.gather_state(optimizer)
        return result

    def gather_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
        """Every worker's ranges of the state, merged as one optimizer's (a collective)."""
        return gather_state(self.sharded(optimizer), self._rank, self.collective, "optimizer.state_dict (sharded state)")

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        sharded = self.sharded(optimizer)
        base_of(optimizer).load_state_dict(optimizer, {**state_dict, "state": {}})
        sharded.load_state(state_dict["state"], replicas=[self._rank])

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


class _Layout:
    """Where each parameter sits in the workers' end-to-end concatenation (``sharded``'s ranges), and
    stage 2's packs and range of the sum."""

    def __init__(self, params: list[torch.Tensor], sharded: ShardedUpdate):
        self.params = params
        self.offsets, self.bounds = sharded.offsets, sharded.bounds
        self.scattered: ScatteredGradients | None = None   # sharding="gradients", several workers
        self.summed: tuple[torch.Tensor, list[int]] | None = None   # the step's range of the sum, once finished


# ZeRO's ranges over any group: the workers here, a pipeline's data axis (data_axis_zero.py)

def check_splittable(base: type, tensors: list[torch.Tensor], stage: str, between: str, instead: str) -> None:
    """Refuse an optimizer class or tensors that ranges cannot split (``instead``: the other choices)."""
    if base not in ELEMENTWISE:
        raise InvalidArgumentError(
            f"sharding={stage!r} splits the update element-wise between {between}, which {base.__name__} does "
            f"not allow; use one of {sorted(c.__name__ for c in ELEMENTWISE)}{instead}")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1 or any(t.is_sparse or not t.is_contiguous() for t in tensors):
        raise InvalidArgumentError(
            f"sharding={stage!r} needs dense contiguous parameters of one dtype and device, got "
            f"{sorted(str(k) for k in kinds)}; use one dtype for the model{instead if between == 'workers' else ''}")

def gather_ranges(group: Any, sharded: ShardedUpdate, rank: int, tensors: list[torch.Tensor]) -> None:
    """Every rank's updated range of ``tensors`` (laid end to end as ``sharded``'s ranges cut them;
    ``rank`` updated its own) reaches every rank of ``group`` (an all-gather)."""
    views = [view.detach().reshape(-1) for _, _, view, _, _ in sharded.pieces[rank]]
    mine = torch.cat(views) if views else tensors[0].new_empty(0) if tensors else torch.empty(0)
    sizes = [(b - a,) for a, b in zip(sharded.bounds, sharded.bounds[1:])]
    full = worker_ops.gather(group, [mine], sizes, 0, 1)
    with torch.no_grad():
        for t, offset in zip(tensors, sharded.offsets):
            t.view(-1).copy_(full[offset:offset + t.numel()])


def gather_state(sharded: ShardedUpdate, rank: int, collective: Any, what: str) -> dict[int, dict]:
    """Every rank's range of the optimizer state (``rank``'s own here), merged as one optimizer's, by
    position in ``sharded``'s tensors (a collective over ``collective``'s workers)."""
    mine = {index: [(start, {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                             for k, v in state.items()}) for start, state in pieces]
            for index, pieces in sharded.parts([rank]).items()}
    everyone = [mine] if collective.num_workers == 1 else collective.all_gather_object(mine, what)
    merged: dict[int, list] = {}
    for worker in everyone:
        for index, pieces in worker.items():
            merged.setdefault(index, []).extend(pieces)
    return sharded.merge(merged)
