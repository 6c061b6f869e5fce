"""ParameterServerStrategy: asynchronous data parallelism with parameter servers.

Variables (parameters and buffers of modules created in scope) live on the ps tasks:
whole variables round-robin over the tasks, or split along dim 0 by the
``variable_partitioner`` into shards spread round-robin too; an ``nn.Embedding`` table
is row-sparse (steps read and update only the rows they use). Optimizers created in
scope keep their state beside each shard and apply updates there.

On the coordinator (the user's program) a scoped module still reads as one model:
its tensors are refreshed from the ps when read after steps have run, ``state_dict()``
is one logical copy, and ``load_state_dict()`` pushes values back (re-creating them on a
fresh ps), as do the optimizer's ``state_dict()`` / ``load_state_dict()``.
Steps run on workers through :class:`~stratagem.ClusterCoordinator`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from stratagem import _context
from stratagem.devices import Device
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.ps.client import ParameterServerClient, call_each
from stratagem.ps.variables import (RemoteVariable, Shard, ShardedVariable, gradients_by_ps,
                                    is_pickling_for_worker, remote_of)
from stratagem.rpc.auth import cluster_token
from stratagem.strategies.base import Strategy
from stratagem.strategies.mirroring import _distributed_class, install_hooks
from stratagem.strategies.replica_context import ReplicaContext, split_sizes


STARTUP_TIMEOUT_SECONDS = 120.0


class ParameterServerStrategy(Strategy):
    """Asynchronous training: variables on parameter servers, steps scheduled onto workers.

    Example (the coordinator script of ``stratagem launch --workers 2 --ps 2 train.py``)::

        # strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
        #                                       variable_partitioner=sg.MinSizePartitioner(max_shards=2))
        # coordinator = sg.ClusterCoordinator(strategy)
        # with strategy.scope():
        #     model = Net(); optimizer = torch.optim.Adam(model.parameters())
    """

    def __init__(self, cluster_resolver: Any, variable_partitioner: Callable | None = None):
        spec = cluster_resolver.cluster_spec()
        for job in ("ps", "worker"):
            if job not in spec.jobs or spec.num_tasks(job) == 0:
                raise ClusterConfigError(
                    f"ParameterServerStrategy needs {job!r} tasks in the cluster, but it has "
                    f"{sorted(spec.jobs) or 'none'}; start the cluster with `stratagem launch --workers N "
                    f"--ps M script.py` or list them in TF_CONFIG")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise InvalidArgumentError(
                f"variable_partitioner must be a partitioner such as sg.MinSizePartitioner(), got "
                f"{variable_partitioner!r}")
        super().__init__((Device("cpu", 0),))
        install_hooks()
        self._resolver = cluster_resolver
        self._token = cluster_token()
        self._ps_addresses = list(spec.job_tasks("ps"))
        self._worker_addresses = list(spec.job_tasks("worker"))
        self._ps_clients = [ParameterServerClient(a, self._token, task=f"ps {i}")
                            for i, a in enumerate(self._ps_addresses)]
        for client in self._ps_clients:  # the ps tasks may still be starting: wait for them
            client.wait_ready(timeout=STARTUP_TIMEOUT_SECONDS)
        self._partitioner = variable_partitioner
        self._placement = _Placement(self)
        self._contexts = [ReplicaContext(self, 0, 0, None)]
        self._coordinator: Any = None

    def __reduce__(self) -> Any:  # a step function that mentions the strategy runs on a worker
        return (_WorkerStrategy, ())

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    # --------------------------------------------------------------- run

    def _run_replicas(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        args, kwargs = per_replica_args[0]
        ctx = self._contexts[0]
        ctx._global_batch_size = global_batch_size
        _context.push(self, ctx)
        try:
            return [fn(*args, **kwargs)]
        finally:
            _context.pop()

    def _replica_exchange(self, ctx: ReplicaContext, tensors: list, tag: str) -> list:
        return [tensors]

    def _replica_all_reduce(self, ctx: ReplicaContext, op: Any, tensors: list) -> list:
        return [t.clone() for t in tensors]

    def _replica_all_gather(self, ctx: ReplicaContext, tensors: list, axis: int) -> list:
        return [t.clone() for t in tensors]

    def _sync_before_schedule(self) -> None:
        self._placement.finalize()
        self._placement.sync_hyperparameters()

    # -------------------------------------------------------- optimizers

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> None:
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported in parameter-server training")
        self._placement.finalize()
        per_ps = gradients_by_ps(p for g in optimizer.param_groups for p in g["params"])
        call_each([(self._ps_clients[ps], "push", {"grads": g}) for ps, g in per_ps.items()])
        self._placement.stale()

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer._sg_base.zero_grad(optimizer, set_to_none)

    def _optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        optimizer._sg_base.add_param_group(optimizer, param_group)
        self._placement.attach_optimizer(optimizer)

    def _reduce_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        from stratagem.coordinator.worker import worker_optimizer

        var_ids = [remote_of(p).var_id for g in optimizer.param_groups for p in g["params"]]
        return (worker_optimizer, (var_ids,))

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return self._placement.optimizer_state_dict(optimizer)

    def _optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self._placement.load_optimizer_state_dict(optimizer, state_dict)

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy({len(self._worker_addresses)} workers, "
                f"{len(self._ps_addresses)} ps)")


class _WorkerStrategy:
    """What a ParameterServerStrategy mentioned by a step function is, on a worker."""

    num_replicas_in_sync = 1

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        return value


class PSEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table lives on parameter servers (rows pulled on use)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from stratagem.coordinator.worker import embedding_forward

        return embedding_forward(self, ids)


class _VariableDict(dict):
    """``module._parameters`` / ``_buffers`` of a module placed on parameter servers.

    Holds the coordinator's copy of each variable (refreshed from the ps when read
    after steps ran). Pickled for a worker, it becomes metadata only.
    """

    def __init__(self, placement: "_Placement", items: Any = ()):
        super().__init__(items)
        self._placement = placement
        self._pulled_at = -1

    def __reduce__(self) -> Any:
        from stratagem.coordinator.worker import worker_parameters

        entries = tuple((name, remote_of(t) if t is not None else None, isinstance(t, nn.Parameter))
                        for name, t in dict.items(self))
        if is_pickling_for_worker():
            return (worker_parameters, (entries,))
        return (dict, ({k: (None if v is None else v.detach().clone()) for k, v in self.items()},))

    def _refresh(self) -> None:
        if self._pulled_at != self._placement.version and not self._placement.loading:
            self._pulled_at = self._placement.version
            self._placement.pull_into([t for t in dict.values(self) if t is not None])

    def __getitem__(self, key: str) -> Any:
        self._refresh()
        return dict.__getitem__(self, key)

    def __iter__(self):
        return dict.__iter__(self)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self):
        self._refresh()
        return list(dict.values(self))

    def items(self):
        self._refresh()
        return list(dict.items(self))


class _Placement:
    """Creates the variables of scoped modules on the parameter servers and keeps track of them."""

    def __init__(self, strategy: ParameterServerStrategy):
        self.strategy = strategy
        self.version = 0          # bumped whenever the ps values may have changed
        self._ids = itertools.count()
        self._next_ps = itertools.count()
        self._pending: list[nn.Module] = []
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._remotes: dict[str, RemoteVariable] = {}
        self._specs: dict[str, Any] = {}            # var_id -> optimizer spec
        self._sent_hyper: dict[int, list[dict]] = {}
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.loading = False

    # ------------------------------------------------------------ modules

    def on_registered(self, module: nn.Module) -> None:
        if not self._pending or self._pending[-1] is not module:
            self._pending.append(module)

    def before_run(self) -> None:
        self.finalize()

    def after_run(self) -> None:
        pass

    def all_copies(self, tensor: torch.Tensor) -> None:
        return None

    def replica_copy(self, tensor: torch.Tensor, replica: int) -> torch.Tensor:
        return tensor

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
        if self.strategy._partitioner is not None and tensor.dim() > 0:
            num_shards = max(1, min(int(self.strategy._partitioner(tuple(tensor.shape), tensor.dtype)[0]), rows))
        sizes = split_sizes(rows, num_shards)
        shards, start = [], 0
        for i, size in enumerate(sizes):
            shards.append(Shard(f"{var_id}/part_{i}", next(self._next_ps) % len(self.strategy._ps_clients),
                                start, start + size))
            start += size
        remote = RemoteVariable(var_id, tuple(tensor.shape), tensor.dtype, tuple(shards),
                                trainable=bool(getattr(tensor, "requires_grad", False)),
                                row_sparse=isinstance(module, nn.Embedding) and name == "weight")
        self._remotes[var_id] = remote
        for shard in shards:
            self.strategy._ps_clients[shard.ps].create(shard.shard_id, shard.of(tensor.detach()).clone())
        if num_shards > 1 and is_parameter:
            placed = ShardedVariable(tensor.detach(), remote, requires_grad=tensor.requires_grad)
        else:
            placed = tensor
            placed._sg_remote = remote
        return placed

    def pull_into(self, tensors: list[torch.Tensor]) -> None:
        wanted: dict[int, list[str]] = {}
        for t in tensors:
            for shard in remote_of(t).shards:
                wanted.setdefault(shard.ps, []).append(shard.shard_id)
        clients = self.strategy._ps_clients
        values: dict[str, torch.Tensor] = {}
        calls = [(clients[ps], "pull", {"var_ids": ids}) for ps, ids in wanted.items()]
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
        self._set_state(state)

    def _set_state(self, per_ps: dict[int, dict[str, dict]]) -> None:
        clients = self.strategy._ps_clients
        for ps in per_ps:  # after a failure the ps may still be restarting
            clients[ps].wait_ready(timeout=STARTUP_TIMEOUT_SECONDS)
        call_each([(clients[ps], "set_state", {"state": s}) for ps, s in per_ps.items()])
        self.stale()
        coordinator = self.strategy._coordinator
        if coordinator is not None:
            coordinator._variables_restored()

    # --------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.__class__ = _distributed_class(type(optimizer))
        optimizer._sg_strategy = self.strategy
        self._pending_optimizers.append(optimizer)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every variable of ``optimizer`` its own optimizer on its ps, in place (the
        values stay where they are)."""
        base = optimizer._sg_base
        calls = []
        clients = self.strategy._ps_clients
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
                    self.strategy._ps_clients[ps].set_hyperparameters(ids, changed)
            self._sent_hyper[id(optimizer)] = now

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """One logical optimizer state dict, assembled from the shards' states."""
        self.finalize()
        result = optimizer._sg_base.state_dict(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        states = self._get_states(params)
        logical: dict[int, dict] = {}
        for index, p in enumerate(params):
            pieces = [states[s.shard_id]["optimizer_state"] for s in remote_of(p).shards]
            per_shard = [(piece or {}).get("state", {}).get(0, {}) for piece in pieces]
            if not per_shard or not per_shard[0]:
                continue
            merged = {}
            for key, first in per_shard[0].items():
                if isinstance(first, torch.Tensor) and first.dim() > 0 and len(per_shard) > 1:
                    merged[key] = torch.cat([s[key] for s in per_shard])
                else:
                    merged[key] = first
            logical[index] = merged
        result["state"] = logical
        return result

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        base = optimizer._sg_base
        base.load_state_dict(optimizer, {"state": {}, "param_groups": state_dict["param_groups"]})
        self.finalize()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        try:
            self.pull_into(params)
        except Exception:  # noqa: BLE001 - a fresh ps lacks them: keep the coordinator's values
            pass
        per_ps: dict[int, dict[str, dict]] = {}
        index = 0
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                remote = remote_of(p)
                self._specs[remote.var_id] = (base, hyper)
                state = state_dict["state"].get(index, state_dict["state"].get(str(index)))
                for shard in remote.shards:
                    piece = None
                    if state is not None:
                        piece = {k: (v[shard.start:shard.stop].clone() if isinstance(v, torch.Tensor)
                                     and v.dim() > 0 and v.shape[0] == remote.shape[0] else v)
                                 for k, v in state.items()}
                    group_state = {**hyper, "params": [0]}
                    per_ps.setdefault(shard.ps, {})[shard.shard_id] = {
                        "value": shard.of(p.detach()).clone(), "optimizer_spec": (base, hyper),
                        "optimizer_state": None if piece is None else {"state": {0: piece},
                                                                      "param_groups": [group_state]}}
                index += 1
        self._set_state(per_ps)
        self._sent_hyper[id(optimizer)] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def _get_states(self, params: list[torch.Tensor]) -> dict[str, dict]:
        wanted: dict[int, list[str]] = {}
        for p in params:
            for shard in remote_of(p).shards:
                wanted.setdefault(shard.ps, []).append(shard.shard_id)
        clients = self.strategy._ps_clients
        states: dict[str, dict] = {}
        for got in call_each([(clients[ps], "get_state", {"var_ids": ids}) for ps, ids in wanted.items()]):
            states.update(got)
        return states
