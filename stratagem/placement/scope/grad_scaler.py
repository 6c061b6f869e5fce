"""GradScalers created in a strategy's scope: one scale and one skip decision for every replica.

``torch.amp.GradScaler`` keeps, per optimizer and iteration, a stage (ready, unscaled,
stepped) and the result of its inf/NaN check, and one scale. Replica threads sharing a
plain scaler trip over each other (the second replica's ``unscale_`` finds the optimizer
already unscaled), and on every thread it would unscale the user's optimizer's parameters,
which are replica 0's. So a scaler created in a synchronous strategy's scope
(``torch.amp.GradScaler``, or the ``torch.cpu.amp`` / ``torch.cuda.amp`` subclasses) gets its
class replaced, as a scoped optimizer does (:mod:`stratagem.placement.scope.hooks` wraps
``GradScaler.__init__`` while a scope is open), by a subclass named after the placement
(``MirroredGradScaler``) that keeps per local replica:

- the per-optimizer state of the iteration, so ``unscale_`` / ``step`` / ``update`` run on
  every replica's thread exactly as in plain PyTorch;
- its own scale and growth tracker, on that replica's device. Every replica updates its
  copy from the same combined inf check, so the copies never differ and no replica waits
  for another one to move a shared scale.

``unscale_(optimizer)`` on replica ``r`` unscales the gradients of the tensors replica ``r``
computes with (``placement.replica_copy``), checks them, and sums the check over every
replica of every worker (one small all-reduce). ``step`` then skips on every replica or on
none, and ``update`` backs off or grows every copy alike: an inf or NaN anywhere skips the
step everywhere, as plain PyTorch does on the whole batch. (When the gradients are summed at
the end of backward every replica's check already agrees; the all-reduce makes a differing
decision impossible even so.)

Outside ``run`` the scaler reads as replica 0's (``get_scale()``, ``state_dict()``);
``load_state_dict`` and ``update`` reach every replica's copy; ``unscale_`` and ``step``
belong inside ``run`` when this process holds several replicas (refused outside). With one
replica per process (``MultiWorkerMirroredStrategy`` with one device per worker, as under
DistributedDataParallel) they act outside ``run`` as that replica, the inf check still summed
over the workers.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from stratagem import _context
from stratagem._record import attach, record
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.values import ReduceOp

__all__ = ["ReplicaGradScaler", "adopt", "refuse_unscoped"]


class _ReplicaState:
    """One replica's share of a scaler: the scale, the growth tracker, the iteration's state."""

    __slots__ = ("scale", "growth_tracker", "per_optimizer")

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.growth_tracker: torch.Tensor | None = None
        self.per_optimizer: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)


def _routed(field: str) -> property:
    """An attribute torch's methods use, read and written in the calling replica's state."""
    def get(self: "ReplicaGradScaler") -> Any:
        return getattr(_state(self), field)

    def set(self: "ReplicaGradScaler", value: Any) -> None:
        setattr(_state(self), field, value)
    return property(get, set)


class _Gradients:
    """What torch's unscaling reads of an optimizer: its parameters (here, one replica's tensors)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.param_groups = [{"params": tensors}]


class ReplicaGradScaler(torch.amp.GradScaler):
    """Base of the classes a GradScaler created in scope gets (``MirroredGradScaler``, ...).

    Never created directly: create a ``torch.amp.GradScaler`` inside ``strategy.scope()``.
    Its record (:mod:`stratagem._record`) holds the placement, each replica's state
    (``scaler_states``) and the replica a cross-replica ``update`` moves (``pinned``).
    """

    _scale = _routed("scale")
    _growth_tracker = _routed("growth_tracker")
    _per_optimizer_states = _routed("per_optimizer")

    # ------------------------------------------------------------ the step

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._enabled:
            _require_replica(self, "unscale_")
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """Unscale this replica's gradients; the inf check summed over every replica and worker."""
        local_id = _require_replica(self, "unscale_")
        placement = record(self).placement
        tensors = replica_tensors(placement, optimizer, local_id)
        per_device = super()._unscale_grads_(_Gradients(tensors), inv_scale, found_inf, allow_fp16)
        total = found_inf.clone()
        for found in per_device.values():
            total += found.to(total.device)
        if placement.strategy.num_replicas_in_sync > 1:
            total = placement.collective.all_reduce(local_id, [total], ReduceOp.SUM)[0]
        return {total.device: total}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_`` (unless done), then ``optimizer.step()`` unless an inf or NaN was found on
        any replica of any worker (torch's ``step``; optimizers that unscale inside their own
        fused step are unscaled here first, so that the check is the combined one)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        _require_replica(self, "step")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """On a replica: that replica's copy (every replica moves its own alike). Outside
        ``run``: every replica's copy that exists."""
        if not self._enabled or _replica(self) is not None:
            return super().update(new_scale)
        mine = record(self)
        started = [r for r, state in enumerate(mine.scaler_states) if state.scale is not None] or [0]
        for replica in started:
            mine.pinned.replica = replica
            try:
                super().update(new_scale)
            finally:
                del mine.pinned.replica

    # ----------------------------------------------------- everything else

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._enabled:   # every replica's copy, not only the calling thread's
            for state in record(self).scaler_states:
                if state.scale is not None:
                    state.scale.fill_(state_dict["scale"])
                if state.growth_tracker is not None:
                    state.growth_tracker.fill_(state_dict["_growth_tracker"])

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a GradScaler created in a strategy's scope cannot be pickled or deep-copied; save its "
            "state_dict() instead (one logical scaler)")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self._device!r}, enabled={self._enabled}, created in the "
                f"scope of {record(self).placement.strategy!r})")


# ------------------------------------------------------------------ routing

def _replica(scaler: ReplicaGradScaler) -> int | None:
    """The calling thread's local replica id, None in cross-replica context (or outside scopes)."""
    frame = _context.current_frame()
    ctx = frame.replica_context if frame is not None else None
    if ctx is None:
        return None
    strategy = record(scaler).placement.strategy
    if ctx.strategy is not strategy:
        raise ContextError(
            f"a {type(scaler).__name__} created in the scope of {strategy!r} was used in a run of "
            f"{ctx.strategy!r}; create a GradScaler in the scope of the strategy that runs the step")
    return ctx.local_replica_id


def _state(scaler: ReplicaGradScaler) -> _ReplicaState:
    """The state the calling thread reads and writes: its replica's, else the pinned one (0)."""
    local_id = _replica(scaler)
    mine = record(scaler)
    if local_id is None:
        local_id = getattr(mine.pinned, "replica", 0)
    return mine.scaler_states[local_id]


def _require_replica(scaler: ReplicaGradScaler, method: str) -> int:
    local_id = _replica(scaler)
    if local_id is not None:
        return local_id
    strategy = record(scaler).placement.strategy
    acting = strategy.outside_replica_context()   # one replica in this process: the step without run
    if acting is not None:
        return acting.local_replica_id
    raise ContextError(
        f"GradScaler.{method}() was called outside strategy.run, but the gradients it checks "
        f"belong to the {strategy.topology.num_local_replicas} replicas of this process "
        f"({strategy!r}); call scaler.{method}(optimizer) inside the replica function given to "
        f"strategy.run, after loss.backward()")


def replica_tensors(placement: Any, optimizer: torch.optim.Optimizer, local_id: int) -> list[torch.Tensor]:
    """The tensors whose gradients replica ``local_id`` unscales for ``optimizer``: its own copy
    of each parameter (the update reads replica 0's: under ``CentralStorageStrategy`` too)."""
    tensors: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            mine = placement.replica_copy(p, local_id)
            tensors.setdefault(id(mine), mine)
    return list(tensors.values())


_CLASSES: dict[tuple[type, str], type] = {}


def _scaler_class(base: type, kind: str) -> type:
    cls = _CLASSES.get((base, kind))
    if cls is None:
        name = f"{kind}{base.__name__}"
        cls = type(name, (ReplicaGradScaler, base), {
            "__module__": "stratagem.placement",
            "__doc__": f"A {base.__name__} created in a stratagem strategy's scope ({kind.lower()} placement): "
                       f"one scale and one skip decision for every replica and worker.",
        })
        cls.__qualname__ = name
        _CLASSES[(base, kind)] = cls
    return cls


def adopt(scaler: torch.amp.GradScaler, placement: Any) -> None:
    """Make ``scaler`` (just created in the scope of ``placement``'s strategy) replica-aware."""
    reason = placement.grad_scaler_refusal()
    if reason is not None:
        raise InvalidArgumentError(
            f"a torch.amp.GradScaler cannot be created in the scope of {placement.strategy!r}: {reason}. "
            f"Train in bfloat16 instead, which needs no loss scaling (torch.autocast(device_type, "
            f"dtype=torch.bfloat16) around the forward pass, or sg.Model.compile(..., "
            f"mixed_precision='mixed_bfloat16'))")
    for name in ("_scale", "_growth_tracker", "_per_optimizer_states"):
        scaler.__dict__.pop(name, None)   # (None or empty: just created)
    attach(scaler, placement=placement, pinned=threading.local(),
           scaler_states=[_ReplicaState() for _ in range(placement.strategy.topology.num_local_replicas)])
    scaler.__class__ = _scaler_class(type(scaler), placement.kind)


def refuse_unscoped(scaler: torch.amp.GradScaler, method: str) -> None:
    """Refuse a GradScaler created outside every scope used inside a multi-replica ``run``.

    Its one state would be shared by the replica threads (the second ``unscale_`` fails), it
    would unscale replica 0's gradients from every thread, and each worker would decide alone
    whether to skip the step.
    """
    frame = _context.current_frame()
    if frame is None or frame.replica_context is None or frame.strategy.num_replicas_in_sync < 2:
        return
    raise ContextError(
        f"GradScaler.{method}() was called inside a run of {frame.strategy!r} on a GradScaler created "
        f"outside its scope: its replicas would share one scaler state and could decide differently "
        f"whether to skip the step. Create the GradScaler inside `with strategy.scope():` (next to the "
        f"optimizer); it then unscales each replica's gradients and skips the step on every replica "
        f"when any of them finds an inf or NaN")
