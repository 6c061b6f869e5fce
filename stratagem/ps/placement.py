"""ParameterServerPlacement: where the variables of a ParameterServerStrategy's scope live, on the coordinator.

A module created in scope has its ``_parameters`` and ``_buffers`` replaced by a
:class:`_VariableDict` once it is complete (:meth:`ParameterServerPlacement.finalize`, before the first
optimizer, ``run`` or ``schedule``): each variable is created on the parameter servers --
whole, round-robin over the ps tasks, or split along dim 0 by the partitioner into shards
spread round-robin too -- and the module keeps a coordinator copy tagged with where it
lives (its record's ``remote``, a :class:`~stratagem.ps.variables.RemoteVariable`). A
whole ``nn.Embedding`` becomes a :class:`~stratagem.ps.embedding.PSEmbedding`, its table
row-sparse.

The coordinator copies are refreshed from the ps when read after steps ran
(:meth:`ParameterServerPlacement.stale` marks them old), and ``load_state_dict`` writes them back.
Optimizers created in scope get, per variable shard, an optimizer of the same class on the
shard's ps (:meth:`ParameterServerPlacement.attach_optimizer`); their hyperparameters follow the
coordinator's before each schedule, and their state dicts are assembled from the shards. An
embedding table's optimizer without a row-sparse rule (RMSprop...) warns here, once: the ps
will update the whole table each step (:func:`~stratagem.ps.sparse_update.updates_rows_only`).

It implements the declared :class:`~stratagem.placement.scope.base.Placement` interface; the
optimizer operations push gradients (``optimizer_step``) and read or write the shards'
optimizer states (the state dicts).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from stratagem._frames import warn_at_users_line
from stratagem._profiling import label
from stratagem._record import attach
from stratagem.data.sharding import split_sizes
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope.base import Placement
from stratagem.placement.scope.hooks import adopt, base_of
from stratagem.ps import optimizer_states
from stratagem.ps.checkpointing import read_state, write_state
from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.embedding import PSEmbedding
from stratagem.ps.sparse_update import dense_updates_warning, updates_rows_only
from stratagem.ps.variables import RemoteVariable, Shard, ShardedVariable, gradients_by_ps, remote_of

__all__ = ["ParameterServerPlacement", "STARTUP_TIMEOUT_SECONDS"]

STARTUP_TIMEOUT_SECONDS = 120.0


class _VariableDict(dict):
    """``module._parameters`` / ``_buffers`` of a module placed on parameter servers.

    Holds the coordinator's copy of each variable (refreshed from the ps when read
    after steps ran). Pickled for a worker it becomes metadata only
    (:class:`~stratagem.ps.closures.ClosurePickler`); pickled otherwise, a plain dict.
    """

    def __init__(self, placement: "ParameterServerPlacement", items: Any = ()):
        super().__init__(items)
        self._placement = placement
        self._pulled_at = -1

    def entries(self) -> tuple[tuple[str, RemoteVariable | None, bool], ...]:
        """What a worker needs to make its copies: (name, where it lives, is a parameter)."""
        return tuple((name, remote_of(t) if t is not None else None, isinstance(t, nn.Parameter))
                     for name, t in dict.items(self))

    def __reduce__(self) -> Any:  # a copy or a checkpoint: plain tensors holding the values
        return (dict, ({k: (None if v is None else v.detach().clone()) for k, v in self.items()},))

    def _refresh(self) -> None:
        if self._placement.written_buffers:
            self._placement.warn_written_buffers(dict.values(self))
        if self._pulled_at != self._placement.version and not self._placement.loading:
            self._pulled_at = self._placement.version
            self._placement.pull_into([t for t in dict.values(self) if t is not None])

    def __getitem__(self, key: str) -> Any:
        self._refresh()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self):
        self._refresh()
        return list(dict.values(self))

    def items(self):
        self._refresh()
        return list(dict.items(self))


class ParameterServerPlacement(Placement):
    """Creates the variables of scoped modules on the parameter servers and keeps track of them.

    ``strategy`` only names the owner in errors (and is what scoped optimizers report to);
    the parameter servers are reached through ``ps_clients``, and ``partitioner`` decides
    how many shards a variable gets (None: one). ``on_restored`` is called after values
    were written back to the ps (a ClusterCoordinator sets it).
    """

    kind = "ParameterServer"

    def __init__(self, strategy: Any, ps_clients: Sequence[ParameterServerClient],
                 partitioner: Callable | None):
        self.strategy = strategy
        self.ps_clients = list(ps_clients)
        self.partitioner = partitioner
        self.startup_timeout = STARTUP_TIMEOUT_SECONDS
        self.on_restored: Callable[[], None] | None = None
        self.version = 0          # bumped whenever the ps values may have changed
        self.writes = 0           # bumped when the coordinator itself changed ps values (workers re-pull)
        self._ids = itertools.count()
        self._next_ps = itertools.count()
        self._pending: list[nn.Module] = []
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._specs: dict[str, Any] = {}            # var_id -> optimizer spec
        self._sent_hyper: dict[int, list[dict]] = {}
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.loading = False
        self.written_buffers: set[str] = set()    # var ids of buffers steps wrote on workers
        self._warned_buffers: set[str] = set()
        self._warned_dense: set[str] = set()    # var ids of tables whose optimizer has no row rule

    # ------------------------------------------------------------ modules

    def buffers_written_on_workers(self, var_ids: Sequence[str]) -> None:
        """Steps on a worker wrote these buffers in place; the writes stay on the worker."""
        self.written_buffers.update(var_ids)

    def warn_written_buffers(self, tensors: Any) -> None:
        """Once per buffer: reading a buffer the workers wrote shows only the coordinator's copy."""
        for t in tensors:
            remote = None if t is None or isinstance(t, nn.Parameter) else remote_of(t)
            if remote is None or remote.var_id not in self.written_buffers or remote.var_id in self._warned_buffers:
                continue
            self._warned_buffers.add(remote.var_id)
            name = remote.var_id.split("/", 1)[-1]
            warnings.warn(
                f"buffer {name} was changed by steps on the workers; worker-side buffers are not sent "
                f"back to the coordinator or the parameter servers, so reading it here shows the "
                f"coordinator's copy (its last known value) -- compute metrics from values the step "
                f"returns, e.g. return (correct, total) and sum the RemoteValues", UserWarning, stacklevel=4)

    def on_module_registered(self, module: nn.Module) -> None:
        if not self._pending or self._pending[-1] is not module:
            self._pending.append(module)

    def stale(self) -> None:
        self.version += 1

    def finalize(self) -> None:
        if self._pending:
            modules = list({id(m): m for m in self._pending}.values())
            self._pending = []
            for module in modules:
                self._place(module)
        if self._pending_optimizers:
            optimizers, self._pending_optimizers = self._pending_optimizers, []
            for optimizer in optimizers:
                self.attach_optimizer(optimizer)

    def _place(self, module: nn.Module) -> None:
        if type(module) is nn.Embedding:
            module.__class__ = PSEmbedding
        for attr in ("_parameters", "_buffers"):
            entries = module.__dict__[attr]
            placed = _VariableDict(self)
            for name, tensor in dict.items(entries):
                if tensor is not None and remote_of(tensor) is None:
                    tensor = self._create(module, name, tensor, is_parameter=attr == "_parameters")
                dict.__setitem__(placed, name, tensor)
            placed._pulled_at = self.version
            module.__dict__[attr] = placed
        # load_state_dict writes the coordinator's copies (no pull first: a fresh ps may not have
        # them yet), then the values go to the ps
        module.register_load_state_dict_pre_hook(lambda *_: setattr(self, "loading", True))
        module.register_load_state_dict_post_hook(lambda m, _: self._after_load(m))

    def _create(self, module: nn.Module, name: str, tensor: torch.Tensor, is_parameter: bool) -> torch.Tensor:
        var_id = f"{next(self._ids)}/{type(module).__name__}.{name}"
        rows = tensor.shape[0] if tensor.dim() else 1
        num_shards = 1
        if self.partitioner is not None and tensor.dim() > 0:
            num_shards = max(1, min(int(self.partitioner(tuple(tensor.shape), tensor.dtype)[0]), rows))
        sizes = split_sizes(rows, num_shards)
        shards, start = [], 0
        for i, size in enumerate(sizes):
            shards.append(Shard(f"{var_id}/part_{i}", next(self._next_ps) % len(self.ps_clients),
                                start, start + size))
            start += size
        remote = RemoteVariable(var_id, tuple(tensor.shape), tensor.dtype, tuple(shards),
                                trainable=bool(getattr(tensor, "requires_grad", False)),
                                row_sparse=isinstance(module, nn.Embedding) and name == "weight")
        for shard in shards:
            self.ps_clients[shard.ps].call("create", var_id=shard.shard_id,
                                           value=shard.of(tensor.detach()).clone())
        if num_shards > 1 and is_parameter:
            placed = ShardedVariable(tensor.detach(), remote, requires_grad=tensor.requires_grad)
        else:
            placed = tensor
            attach(placed, remote=remote)
        return placed

    def pull_into(self, tensors: list[torch.Tensor]) -> None:
        wanted: dict[int, list[str]] = {}
        for t in tensors:
            for shard in remote_of(t).shards:
                wanted.setdefault(shard.ps, []).append(shard.shard_id)
        values: dict[str, torch.Tensor] = {}
        calls = [(self.ps_clients[ps], "pull", {"var_ids": ids}) for ps, ids in wanted.items()]
        with label("stratagem.ps.pull"):
            for pulled in call_each(calls, writable_reply=False):   # only copied into the tensors below
                values.update(pulled)
            with torch.no_grad():
                for t in tensors:
                    for shard in remote_of(t).shards:
                        shard.of(t.data).copy_(values[shard.shard_id].reshape(shard.of(t.data).shape))

    def _after_load(self, module: nn.Module) -> None:
        self.loading = False
        self.push_module(module)

    def push_module(self, module: nn.Module) -> None:
        """After load_state_dict on the coordinator: write the values to the ps (re-creating them)."""
        state: dict[int, dict[str, dict]] = {}
        for attr in ("_parameters", "_buffers"):
            for t in dict.values(module.__dict__[attr]):
                if t is None:
                    continue
                remote = remote_of(t)
                for shard in remote.shards:
                    state.setdefault(shard.ps, {})[shard.shard_id] = {
                        "value": shard.of(t.detach()).clone(), "optimizer_spec": self._specs.get(remote.var_id),
                        "optimizer_state": None}
        self.write_states(state)

    def write_states(self, per_ps: dict[int, dict[str, dict]]) -> None:
        """``set_state`` on each ps (``{ps: {shard id: entry}}``), all at once."""
        clients = self.ps_clients
        for ps in per_ps:  # after a failure the ps may still be restarting
            clients[ps].wait_ready(timeout=self.startup_timeout)
        call_each([(clients[ps], "set_state", {"state": s}) for ps, s in per_ps.items()])
        self.restored()

    def restored(self) -> None:
        """Values were written to the ps: the coordinator's copies are old."""
        self.writes += 1
        self.stale()
        if self.on_restored is not None:
            self.on_restored()

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> Any:
        """Every ps writes its shards of ``obj`` into the checkpoint, in parallel (:mod:`.checkpointing`)."""
        return write_state(self, obj, directory, name)

    def read_checkpoint_state(self, obj: Any, skeleton: Any, directory: Any, name: str,
                              manifest: dict | None = None) -> Any:
        """Every ps restores its shards of ``obj`` from its own files, when they are this layout's
        and those ``manifest`` lists."""
        return read_state(self, obj, skeleton, directory, name, manifest)

    def optimizer_spec(self, var_id: str) -> Any:
        return self._specs.get(var_id)   # how the ps makes the optimizer of var_id (None: none yet)

    # --------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        adopt(optimizer, self)
        self._pending_optimizers.append(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> None:
        """``optimizer.step()`` on the coordinator: the dense gradients go to the ps, which
        apply them with the shards' optimizers."""
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported in parameter-server training")
        self.finalize()
        per_ps = gradients_by_ps(p for g in optimizer.param_groups for p in g["params"])
        with label("stratagem.ps.push"):
            call_each([(self.ps_clients[ps], "push", {"grads": g}) for ps, g in per_ps.items()])
        self.writes += 1
        self.stale()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every variable of ``optimizer`` its own optimizer on its ps, in place (the
        values stay where they are)."""
        base = base_of(optimizer)
        calls = []
        clients = self.ps_clients
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            per_ps: dict[int, list[str]] = {}
            for p in group["params"]:
                remote = remote_of(p)
                if remote is None:
                    raise InvalidArgumentError(
                        f"an optimizer created in the scope of {self.strategy!r} was given a parameter "
                        f"of shape {tuple(p.shape)} that was not created in that scope; create the "
                        f"model inside `with strategy.scope():` too")
                self._specs[remote.var_id] = (base, hyper)
                if (remote.row_sparse and not updates_rows_only(base, remote.dtype)
                        and remote.var_id not in self._warned_dense):
                    self._warned_dense.add(remote.var_id)
                    name = remote.var_id.split("/", 1)[-1]
                    warn_at_users_line(dense_updates_warning(base.__name__, name, remote.shape))
                for shard in remote.shards:
                    per_ps.setdefault(shard.ps, []).append(shard.shard_id)
            calls += [(clients[ps], "set_optimizer", {"var_ids": ids, "optimizer_spec": (base, hyper)})
                      for ps, ids in per_ps.items()]
        call_each(calls)
        self._sent_hyper[id(optimizer)] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._optimizers.add(optimizer)

    def sync_hyperparameters(self) -> None:
        """Send hyperparameters changed on the coordinator (by a scheduler) to the ps."""
        for optimizer in list(self._optimizers):
            sent = self._sent_hyper.get(id(optimizer))
            now = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if sent is None or sent == now:
                continue
            for group, before, after in zip(optimizer.param_groups, sent, now):
                changed = {k: v for k, v in after.items() if before.get(k) != v}
                if not changed:
                    continue
                per_ps: dict[int, list[str]] = {}
                for p in group["params"]:
                    for shard in remote_of(p).shards:
                        per_ps.setdefault(shard.ps, []).append(shard.shard_id)
                for ps, ids in per_ps.items():
                    self.ps_clients[ps].call("set_hyperparameters", var_ids=ids, values=changed)
            self._sent_hyper[id(optimizer)] = now

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        base_of(optimizer).zero_grad(optimizer, set_to_none)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        base_of(optimizer).add_param_group(optimizer, param_group)
        self.attach_optimizer(optimizer)

    def optimizer_reduce(self, optimizer: torch.optim.Optimizer) -> Any:
        # A scheduled function carries it to a worker by reference (stratagem.ps.closures);
        # there is no other copy of an optimizer whose state lives on the parameter servers.
        raise TypeError(
            f"a {base_of(optimizer).__name__} created in the scope of {self.strategy!r} cannot be pickled "
            f"or deep-copied outside a scheduled function; save its state_dict() instead (one logical copy)")

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """One logical optimizer state dict, assembled from the shards' states."""
        return optimizer_states.state_dict(self, optimizer)

    def load_param_groups(self, optimizer: torch.optim.Optimizer, param_groups: list[dict], *,
                          send: bool = False) -> None:
        """The coordinator's part of loading an optimizer state: its groups' hyperparameters
        (``send``: all of them to the ps now; else the caller sends them with the states)."""
        base = base_of(optimizer)
        base.load_state_dict(optimizer, {"state": {}, "param_groups": param_groups})
        self.finalize()
        now = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for group, hyper in zip(optimizer.param_groups, now):
            for p in group["params"]:
                self._specs[remote_of(p).var_id] = (base, hyper)
        self._sent_hyper[id(optimizer)] = [{} for _ in now] if send else now
        if send:
            self.sync_hyperparameters()   # none is known to be on the ps: sends every one

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        optimizer_states.load_state_dict(self, optimizer, state_dict)
