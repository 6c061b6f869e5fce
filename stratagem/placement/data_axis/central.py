"""CentralUpdate: every variable once, on the parameter device; replicas compute with copies.

TensorFlow's ``CentralStorageStrategy`` keeps its variables on one device (the CPU by default)
and mirrors only the computation. Here the mirrored placement is given this update rule:

- **Modules.** A module created in scope keeps its parameters and buffers (the *primaries*)
  on the parameter device (:meth:`CentralUpdate.storage`). Each compute replica computes with
  a tensor of its own, held by the module's
  :class:`~stratagem.placement.layout.mirrored_dict.MirroredDict` as the mirrored placement does: a
  replica whose device shares the parameter device's memory (logical CPU devices with the
  parameters on the CPU) computes with a ``Parameter`` over the primary's memory -- replica 0
  with the primary itself -- and any other replica (a GPU) with a copy on its device. Every
  replica's ``Parameter`` has its own ``.grad``: the replicas' backward passes never write the
  same gradient, and nothing depends on which thread finishes first. Buffers keep one copy per
  replica and read, outside ``run``, as their mean over replicas.
- **Optimizers.** An optimizer created in scope is the user's object over the primaries;
  its state lives once, beside them. One logical step, ``optimizer.step()`` on every
  replica's thread inside ``run``, in the order of :mod:`~stratagem.placement.data_axis.step`:

  1. the gradients were summed over the replicas when backward ended (:mod:`.gradient_sync`:
     every replica's ``.grad`` holds the sum); where replica 0 computes with a copy (a GPU),
     its sums are copied into the primaries' ``.grad`` on the parameter device;
  2. the user's step pre-hooks run once, on replica 0, seeing the summed gradients;
  3. the update is applied once to the primaries: split by ranges between the replica
     threads for element-wise optimizers on a CPU parameter device
     (:mod:`~stratagem.placement.data_axis.sharded_update`), else by replica 0's thread;
  4. every replica with a copy of its own copies the new values into it (its own thread);
  5. the post-hooks run once, on replica 0 (parameters they change reach the copies).

  Called outside ``run``, ``step()`` does the same on the calling thread.

With one compute device that shares the parameter device's memory, nothing is copied: the
placement only moves tensors there, as ``OneDeviceStrategy`` does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stratagem._record import record
from stratagem.devices import Device
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope.hooks import base_of, unhooked_step
from stratagem.placement.data_axis.sharded_update import ShardedUpdate
from stratagem.placement.data_axis.update_rule import Storage, UpdateRule, params_of


class CentralUpdate(UpdateRule):
    """Variables and optimizer state once on the parameter device; each compute replica computes
    with its copy (or over the same memory), and the update is applied once.

    Example::

        import torch, stratagem as sg
        from stratagem.placement.data_axis.central import CentralUpdate
        strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
        assert isinstance(strategy.placement.update, CentralUpdate)
        assert strategy.placement.update.parameter_device == torch.device("cpu")
    """

    kind = "CentralStorage"

    def __init__(self, parameter_device: Device):
        #: where the primaries and the optimizer state live
        self.parameter_device = parameter_device.torch_device

    def storage(self, devices: Sequence[torch.device]) -> Storage:
        """The primaries on the parameter device; replica 0 computes with them where its device
        shares their memory, else (a GPU) with a copy, like every other replica."""
        home = self.parameter_device
        same = [_same_memory(d, home) for d in devices]
        return Storage(home, 1 if same[0] else 0, len(devices) > 1 and all(same))

    def bind(self, placement: Any) -> None:
        super().bind(placement)
        self.first_copy = placement.first_copy

    # ------------------------------------------------------------- optimizers

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        record(optimizer).sharded = False   # decided at the first step, once the parameters are placed
        super().add(optimizer)

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        self._check_placed(params_of(optimizer))

    def _check_placed(self, params: list[torch.Tensor]) -> None:
        if self.num_replicas <= self.first_copy:
            return  # one replica computing with the primaries: nothing is copied
        for p in params:
            if self.placement.all_copies(p) is None:
                raise InvalidArgumentError(
                    f"an optimizer created in the scope of {self.placement.strategy!r} was given a parameter "
                    f"of shape {tuple(p.shape)} that was not created in that scope, so it does not "
                    f"live on the parameter device and no replica computes with it. Create the "
                    f"model inside `with strategy.scope():` too")

    def _replica_params(self, primaries: list[torch.Tensor], local_id: int) -> list[torch.Tensor]:
        """The tensors replica ``local_id`` computes with, one per primary."""
        result, all_copies = [], self.placement.all_copies
        for p in primaries:
            copies = all_copies(p)
            result.append(p if copies is None else copies[local_id])
        return result

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers when the update on the parameter device can be split between threads."""
        sharded = record(optimizer).sharded
        if sharded is False:
            with self._lock:   # every replica thread asks at the first step: build it once
                sharded = record(optimizer).sharded
                if sharded is False:
                    if self._claim(optimizer):
                        self.prepare(optimizer)
                    # the update happens on the parameter device, whatever the compute devices
                    sharded = None
                    if ShardedUpdate.supports(optimizer, (self.parameter_device,) * self.num_replicas):
                        sharded = ShardedUpdate(optimizer, lambda p: (p,), self.num_replicas, balance=True)
                    record(optimizer).sharded = sharded
        return sharded

    # the primitives of placement/data_axis/step.py

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, replica: int | None) -> Any:
        """Where replica 0 computes with a copy (a GPU), its sums reach the primaries' ``.grad``."""
        if self.first_copy == 0:
            if replica in (None, 0):
                primaries = params_of(optimizer)
                self._gradients_to_primaries(primaries, self._replica_params(primaries, 0))
            if replica is not None:
                self.collective.exchange(replica, None, "optimizer.step (gradients on the parameter device)")
        return None

    def update_call(self, optimizer: torch.optim.Optimizer, replica: int | None, gradients: Any,
                    closure: Any = None) -> Any:
        """The update of the primaries: this thread's range (split updates), else replica 0's
        (outside ``run``, on this thread: every range, or the one update)."""
        sharded = self.sharded(optimizer)
        if sharded is not None:
            for r in range(self.num_replicas) if replica is None else (replica,):
                sharded.step(r)
            return None
        return unhooked_step(base_of(optimizer))(optimizer) if replica in (None, 0) else None

    def after_update(self, optimizer: torch.optim.Optimizer, replica: int | None, result: Any) -> Any:
        """The replicas meet (replica 0's result for everyone); each copies the new values into
        its own copy (every replica's, outside ``run``)."""
        if replica is not None and self.num_replicas > 1:
            result = self.collective.exchange(replica, result, "optimizer.step (parameters updated)")[0]
        primaries = params_of(optimizer)
        for r in range(self.num_replicas) if replica is None else (replica,):
            self._refresh(primaries, self._replica_params(primaries, r))
        return result

    def hooked_tensors(self, optimizer: torch.optim.Optimizer, replica: int) -> list[torch.Tensor]:
        return params_of(optimizer)   # the hooks see the primaries, which the update reads

    def copy_changed(self, optimizer: torch.optim.Optimizer, replica: int | None, changed: list[int],
                     grads: bool) -> None:
        """Parameters a post-hook changed reach the replicas' copies (gradients: the update read
        the primaries' own)."""
        if grads:
            return
        primaries = params_of(optimizer)
        chosen = [primaries[i] for i in changed]
        for r in range(self.num_replicas) if replica is None else (replica,):
            self._refresh(chosen, [self._replica_params(primaries, r)[i] for i in changed])

    # ---------------------------------------------------------- gradients

    @staticmethod
    def _gradients_to_primaries(primaries: list[torch.Tensor], replica0: list[torch.Tensor]) -> None:
        """The primaries' ``.grad``: replica 0's (every replica holds the same sum since backward
        ended); a copy on the parameter device where replica 0 computes with a copy (a GPU). A
        primary keeps its own gradient where replica 0 has none (a backward outside ``run``
        computes with the primaries themselves)."""
        with torch.no_grad():
            for primary, param in zip(primaries, replica0):
                grad = param.grad
                if param is primary or grad is None:
                    continue
                if primary.grad is None or primary.grad.shape != primary.shape:
                    primary.grad = grad.to(primary.device, copy=True)
                else:
                    primary.grad.copy_(grad)

    def _refresh(self, primaries: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        """Copy the primaries' current values into one replica's copies (shared memory: nothing to do).

        Through ``.data``: the copy's version counter is left alone, so that ``run`` can tell
        this refresh from a replica function writing its copy in place (refused: the write
        would be lost).
        """
        for primary, param in zip(primaries, params):
            if param is not primary and param.data_ptr() != primary.data_ptr():
                param.data.copy_(primary)

    # ------------------------------------------------------ everything else

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        primaries = params_of(optimizer)
        ctx = self.placement.own_replica_context()
        replicas = list(range(self.num_replicas)) if ctx is None else [ctx.local_replica_id]
        tensors = {id(p): p for r in replicas for p in self._replica_params(primaries, r)}
        if self.placement.gradients is not None:
            self.placement.gradients.forget(list(tensors.values()))
        if replicas[0] == 0:   # the sums on the parameter device: replica 0 clears them
            tensors.update((id(p), p) for p in primaries)
        for p in tensors.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # state dicts: UpdateRule's, over the one optimizer (its state, or its range optimizers')

    def add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._check_placed(params)   # before the group is added: a refused group leaves no trace
        super().add_param_group(optimizer, {**param_group, "params": params})


def _same_memory(device: torch.device, home: torch.device) -> bool:
    """Whether a tensor on ``home`` can be computed with on ``device`` as it is."""
    return device.type == home.type == "cpu" or device == home
