"""CentralPlacement: every variable once, on the parameter device; replicas compute with copies.

TensorFlow's ``CentralStorageStrategy`` keeps its variables on one device (the CPU by default)
and mirrors only the computation. Here:

- **Modules.** A module created in scope keeps its parameters and buffers (the *primaries*)
  on the parameter device. Each compute replica computes with a tensor of its own, held by
  the module's :class:`~stratagem.placement.mirrored_dict.MirroredDict` as the mirrored
  placement does: a replica whose device shares the parameter device's memory (logical CPU
  devices with the parameters on the CPU) computes with a ``Parameter`` over the primary's
  memory -- replica 0 with the primary itself -- and any other replica (a GPU) with a copy on
  its device. Every replica's ``Parameter`` has its own ``.grad``: the replicas' backward
  passes never write the same gradient, and nothing depends on which thread finishes first.
  Buffers keep one copy per replica and read, outside ``run``, as their mean over replicas.
- **Optimizers.** An optimizer created in scope is the user's object over the primaries;
  its state lives once, beside them. One logical step, ``optimizer.step()`` on every
  replica's thread inside ``run``:

  1. the gradients were summed over the replicas when backward ended (:mod:`.gradient_sync`:
     every replica's ``.grad`` holds the sum); where replica 0 computes with a copy (a GPU),
     its sums are copied into the primaries' ``.grad`` on the parameter device;
  2. the user's step pre-hooks run once, on replica 0, seeing the summed gradients;
  3. the update is applied once to the primaries: split by ranges between the replica
     threads for element-wise optimizers on a CPU parameter device
     (:mod:`~stratagem.placement.sharded_update`), else by replica 0's thread;
  4. the post-hooks run once, on replica 0;
  5. every replica with a copy of its own copies the new values into it (its own thread).

  Called outside ``run``, ``step()`` does the same on the calling thread.

With one compute device that shares the parameter device's memory, nothing is copied: the
placement only moves tensors there, as ``OneDeviceStrategy`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem._profiling import label
from stratagem.comm.collective import Collective
from stratagem.devices import Device, Topology
from stratagem.errors import InvalidArgumentError
from stratagem.placement.hooks import adopt, run_hooks, step_hooks, unhooked_step
from stratagem.placement.mirrored import MirroredPlacement
from stratagem.placement.mirrored_optimizers import refuse_closure
from stratagem.placement.sharded_update import ShardedUpdate

class CentralPlacement(MirroredPlacement):
    """Variables once on the parameter device; each compute replica computes with its copy."""

    kind = "CentralStorage"

    def __init__(self, strategy: Any, topology: Topology, collective: Collective, parameter_device: Device):
        super().__init__(strategy, topology, collective)
        self.home = parameter_device.torch_device
        same = [_same_memory(d, self.home) for d in self.devices]
        self.first_copy = 1 if same[0] else 0
        self.shares_parameters = self.num_replicas > 1 and all(same)

    # ------------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        adopt(optimizer, self)
        optimizer._sg_sharded = False   # decided at the first step, once the parameters are placed
        self._pending_optimizers.append(optimizer)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._check_placed(_params(optimizer))

    def _check_placed(self, params: list[torch.Tensor]) -> None:
        if self.num_replicas <= self.first_copy:
            return  # one replica computing with the primaries: nothing is copied
        for p in params:
            if self.all_copies(p) is None:
                raise InvalidArgumentError(
                    f"an optimizer created in the scope of {self.strategy!r} was given a parameter "
                    f"of shape {tuple(p.shape)} that was not created in that scope, so it does not "
                    f"live on the parameter device and no replica computes with it. Create the "
                    f"model inside `with strategy.scope():` too")

    def twins(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """One optimizer over the parameters themselves: no twins."""
        return [optimizer]

    def _replica_params(self, primaries: list[torch.Tensor], local_id: int) -> list[torch.Tensor]:
        """The tensors replica ``local_id`` computes with, one per primary."""
        result = []
        for p in primaries:
            copies = self.all_copies(p)
            result.append(p if copies is None else copies[local_id])
        return result

    def sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers when the update on the parameter device can be split between threads."""
        sharded = optimizer.__dict__.get("_sg_sharded", False)
        if sharded is False:
            with self._build_lock:   # every replica thread asks at the first step: build it once
                sharded = optimizer.__dict__.get("_sg_sharded", False)
                if sharded is False:
                    if optimizer in self._pending_optimizers:
                        self._pending_optimizers.remove(optimizer)
                        self._prepare_optimizer(optimizer)
                    # the update happens on the parameter device, whatever the compute devices
                    sharded = None
                    if ShardedUpdate.supports(optimizer, (self.home,) * self.num_replicas):
                        sharded = ShardedUpdate(optimizer, lambda p: (p,), self.num_replicas)
                    optimizer._sg_sharded = sharded
        return sharded

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        refuse_closure(closure)
        ctx = self.own_replica_context()
        if ctx is None:
            return self._cross_replica_step(optimizer)
        local_id, exchange = ctx.local_replica_id, self.collective.exchange
        primaries = _params(optimizer)
        mine = self._replica_params(primaries, local_id)
        sharded = self.sharded(optimizer)
        result = None
        with label("stratagem.optimizer.step"):  # the gradients were summed when backward ended
            if self.first_copy == 0:  # 1. replica 0 computes with a copy: its sums reach the primaries
                if local_id == 0:
                    self._gradients_to_primaries(primaries, mine)
                exchange(local_id, None, "optimizer.step (gradients on the parameter device)")
            pre, post = step_hooks(optimizer)
            if pre:  # 2.
                self._once(local_id, "optimizer step pre-hooks", run_hooks, pre, optimizer)
            with label("stratagem.optimizer.update"):  # 3.
                if sharded is not None:
                    sharded.step(local_id)
                    exchange(local_id, None, "optimizer.step (parameters updated)")
                else:  # replica 0 alone (inline: the update stays 3 frames under optimizer.step())
                    result = unhooked_step(optimizer._sg_base)(optimizer) if local_id == 0 else None
                    result = exchange(local_id, result, "optimizer.step (parameters updated)")[0]
            if post:  # 4.
                self._once(local_id, "optimizer step post-hooks", run_hooks, post, optimizer)
            self._refresh(primaries, mine)  # 5.
        return result

    def _once(self, local_id: int, tag: str, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on replica 0 while the others wait.

        (If it raises, replica 0 leaves without the exchange and the runner aborts the others.)
        """
        if local_id == 0:
            fn(*args)
        self.collective.exchange(local_id, None, tag)

    def _cross_replica_step(self, optimizer: torch.optim.Optimizer) -> Any:
        primaries = _params(optimizer)
        replicas = [self._replica_params(primaries, r) for r in range(self.num_replicas)]
        self._gradients_to_primaries(primaries, replicas[0])
        pre, post = step_hooks(optimizer)
        run_hooks(pre, optimizer)
        sharded = self.sharded(optimizer)
        result = None
        if sharded is not None:
            for replica in range(self.num_replicas):
                sharded.step(replica)
        else:
            result = unhooked_step(optimizer._sg_base)(optimizer)
        run_hooks(post, optimizer)
        for params in replicas:
            self._refresh(primaries, params)
        self.record_updates()
        return result

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

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        primaries = _params(optimizer)
        ctx = self.own_replica_context()
        replicas = list(range(self.num_replicas)) if ctx is None else [ctx.local_replica_id]
        tensors = {id(p): p for r in replicas for p in self._replica_params(primaries, r)}
        if self.gradients is not None:
            self.gradients.forget(list(tensors.values()))
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

    # state dicts: the mirrored placement's, over the one optimizer (its state, or its range optimizers')

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._check_placed(params)   # before the group is added: a refused group leaves no trace
        super().optimizer_add_param_group(optimizer, {**param_group, "params": params})

def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _same_memory(device: torch.device, home: torch.device) -> bool:
    """Whether a tensor on ``home`` can be computed with on ``device`` as it is."""
    return device.type == home.type == "cpu" or device == home
