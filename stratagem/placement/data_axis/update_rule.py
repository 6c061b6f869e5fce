"""Update rules: how a synchronous placement applies an optimizer's update and keeps its state.

:class:`~stratagem.placement.layout.mirrored.MirroredPlacement` mirrors modules on the local replicas,
keeps the gradient contract (:mod:`.gradient_sync`) and runs a step in the order of
:mod:`.step`. What differs between mirrored, central storage and ZeRO training is one object
given to it, the update rule:

- where the primaries live and which replicas compute with copies (:meth:`UpdateRule.storage`),
  read once by the placement;
- whether whole gradients are summed when backward ends (:attr:`UpdateRule.sums_gradients`);
- the step's primitives: ``prepare_gradients``, ``update_call``, ``after_update``,
  ``hooked_tensors``, ``copy_changed`` (:class:`~stratagem.placement.data_axis.step.UpdatePrimitives`);
- the optimizer's ``zero_grad``, state dicts and ``add_param_group``; whether a
  ``GradScaler`` works; what a checkpoint must gather first; how clipping finds the gradients
  where no process holds them whole.

Implementations: :class:`~stratagem.placement.data_axis.mirrored_update.MirroredUpdate` (the default: a
twin optimizer per replica, or one update split by ranges on shared memory),
:class:`~stratagem.placement.data_axis.central.CentralUpdate` (``CentralStorageStrategy``: one optimizer
over the primaries on the parameter device), :class:`~stratagem.placement.data_axis.zero.ZeroUpdate`
(``MultiWorkerMirroredStrategy(sharding="optimizer" | "gradients")``: the update and its state
split over the workers).

A rule serves one placement (:meth:`UpdateRule.bind`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from stratagem._record import record
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope.hooks import base_of


class Storage(NamedTuple):
    """Where a placement keeps the primaries (the tensors the modules' dicts hold)."""

    home: torch.device         # the primaries' device
    first_copy: int            # replicas below it compute with the primary itself; the others with copies
    shares_parameters: bool    # the replicas' parameters share the primary's memory


class RulePlacement(Protocol):
    """What an update rule reads of its placement (``MirroredPlacement``)."""

    strategy: Any
    collective: Any
    devices: list[torch.device]
    num_replicas: int
    home: torch.device
    first_copy: int
    shares_parameters: bool
    gradients: Any   # the GradientSync, or None

    def all_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None: ...
    def own_replica_context(self) -> Any: ...
    def finalize(self) -> None: ...


class UpdateRule:
    """The declared interface of an update rule, with what every rule shares: the optimizers
    waiting to be prepared, and one optimizer's state dict, whole or held by range optimizers."""

    #: prefix of the names of optimizer classes (``MirroredSGD``, ``CentralStorageAdam``)
    kind = "Mirrored"
    #: whether the placement sums whole gradients when backward ends (:mod:`.gradient_sync`)
    sums_gradients = True

    placement: RulePlacement

    def storage(self, devices: Sequence[torch.device]) -> Storage:
        """Where the primaries live for replicas on ``devices``: by default, replica 0's device, every
        other replica with a copy (sharing the primary's memory on logical CPU devices)."""
        return Storage(devices[0], 1, len(devices) > 1 and all(d.type == "cpu" for d in devices))

    def bind(self, placement: RulePlacement, axis: Any = None) -> None:
        """Serve ``placement`` (once its storage is set; a rule serves one placement), over its
        collective, or over ``axis`` (a mesh's data axis: one replica per process)."""
        if getattr(self, "placement", placement) is not placement:
            raise InvalidArgumentError(f"{type(self).__name__} already serves {self.placement.strategy!r}; "
                                       f"give each strategy a rule of its own")
        self.placement = placement
        self.collective = placement.collective if axis is None else axis
        self.num_replicas = placement.num_replicas
        self.shares_parameters = placement.shares_parameters if axis is None else False
        self._lock = threading.Lock()   # replica threads ask at the first step: build once
        self._pending: list[torch.optim.Optimizer] = []

    # ------------------------------------------------------------ optimizers

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` was created in scope (and adopted): prepare it at the next ``finalize``."""
        self._pending.append(optimizer)

    def finalize(self) -> None:
        if self._pending:
            optimizers, self._pending = self._pending, []
            for optimizer in optimizers:
                self.prepare(optimizer)

    def _claim(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take ``optimizer`` off the pending list (prepared now by the caller); whether it was on it."""
        if optimizer in self._pending:
            self._pending.remove(optimizer)
            return True
        return False

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Get ``optimizer`` ready once its parameters are placed (checks, twins, range hooks)."""

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """The optimizers that hold state for ``optimizer`` on this process (by default, itself)."""
        return [optimizer]

    def sharded(self, optimizer: torch.optim.Optimizer) -> Any:
        """The range optimizers of ``optimizer`` (:class:`~.sharded_update.ShardedUpdate`), or None."""
        return None

    # the primitives of placement/data_axis/step.py

    def check_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """``step(closure)``: refused (the replicas' gradients are summed when backward ends)."""
        refuse_closure(optimizer)

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        return None   # every replica's .grad holds the sum since backward ended

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        raise NotImplementedError

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        raise NotImplementedError

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        raise NotImplementedError

    # the optimizer's other methods

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        raise NotImplementedError

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """One logical copy: the optimizer's own (replica 0's twin), the state from its range
        optimizers where the update is split."""
        result = base_of(optimizer).state_dict(optimizer)
        sharded = self.sharded(optimizer)
        if sharded is not None:
            result["state"] = sharded.state()
        return result

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        base = base_of(optimizer)
        sharded = self.sharded(optimizer)
        if sharded is not None:  # hyperparameters here, the state in the range optimizers
            base.load_state_dict(optimizer, {**state_dict, "state": {}})
            sharded.load_state(state_dict["state"])
            return
        base.load_state_dict(optimizer, state_dict)
        for twin in self.twins(optimizer)[1:]:
            base.load_state_dict(twin, state_dict)

    def add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        mine = record(optimizer)
        if mine.sharded:
            raise InvalidArgumentError(
                "add_param_group after the first step is not supported for an optimizer created in a "
                "multi-replica scope; pass every parameter group when creating the optimizer")
        mine.sharded = False  # decided again at the next step
        base_of(optimizer).add_param_group(optimizer, param_group)
        if mine.twins:
            mine.twins = None
            self.twins(optimizer)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of per-element optimizer state (moments, momentum; not step counters) this
        process holds for ``optimizer``."""
        sharded = self.sharded(optimizer)
        holders = self.twins(optimizer) if sharded is None else [o for o in sharded.optimizers if o is not None]
        return sum(v.numel() * v.element_size() for holder in holders for state in holder.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    # ---------------------------------------------------- placement-wide answers

    def grad_scaler_refusal(self) -> str | None:
        """Why a ``GradScaler`` cannot work with this rule, or None: by default every replica's copy
        has its ``.grad`` after backward."""
        return None

    def prepare_checkpoint(self, objects: dict[str, Any]) -> contextlib.AbstractContextManager:
        """Entered on every worker around the chief's writing of ``objects`` (nothing to gather by
        default)."""
        return contextlib.nullcontext()

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        """Whether no process holds each parameter's whole gradient between backward and step."""
        return [False] * len(params)

    def reduce_scattered(self, params: list[torch.Tensor]) -> list[Any]:
        """The ZeRO-2 ranges that hold the summed gradients of some of ``params`` instead of ``.grad``
        (clipping measures their pieces: :meth:`~.axis.DataAxis.gradient_parts`); by default none."""
        return []


def refuse_closure(optimizer: torch.optim.Optimizer) -> None:
    raise InvalidArgumentError(
        "optimizer.step(closure) is not supported for optimizers created in a strategy's "
        "scope: compute the loss and call loss.backward() before optimizer.step()")


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, group after group."""
    return [p for group in optimizer.param_groups for p in group["params"]]
