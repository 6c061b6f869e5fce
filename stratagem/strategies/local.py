"""Strategies whose replicas all live in this process: the replica threads and the
optimizer protocol that keeps mirrored copies identical.

``run`` with one local replica calls the function inline. With several, replica 0
runs on the caller's thread and replica ``r`` on a persistent daemon thread; torch's
intra-op threads are divided between CPU replicas so that they do not oversubscribe
the cores (each thread sets its own OpenMP thread count).

Optimizer step in replica context, on every replica's thread:

1. deposit this replica's gradients (one exchange);
2. a parameter that has a gradient on some replicas but not others gets zeros
   where it is missing (and the exchange is repeated);
3. the cross-device op sums the gradients in place, each thread reducing its share;
4. cross-worker reduction (multi-worker strategies);
5. each replica's twin optimizer applies the identical update to its own copy.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Sequence

import torch

from stratagem import _context
from stratagem.comm.cross_device_ops import CrossDeviceOps, _sum_into, default_cross_device_ops
from stratagem.comm.sync import ReplicaAborted, ReplicaSync
from stratagem.devices import Device
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.strategies.base import Strategy
from stratagem.strategies.mirroring import MirroredDict, Placement, install_hooks
from stratagem.strategies.replica_context import ReplicaContext
from stratagem.strategies.sharded_update import ShardedUpdate
from stratagem.values import ReduceOp


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LocalStrategy(Strategy):
    """Base of strategies with one or more replicas in this process."""

    def __init__(self, devices: Sequence[Device], cross_device_ops: CrossDeviceOps | None = None):
        super().__init__(devices)
        install_hooks()
        if cross_device_ops is None:
            cross_device_ops = default_cross_device_ops(self._devices)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise InvalidArgumentError(
                f"cross_device_ops must be sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice() "
                f"or sg.NcclAllReduce(), got {cross_device_ops!r}")
        cross_device_ops.validate(self._devices)
        self._cross_device_ops = cross_device_ops
        self._placement = Placement(self, self._devices)
        self._sync = ReplicaSync(len(self._devices))
        self._contexts = [ReplicaContext(self, self._first_replica_id + i, i, self._sync)
                          for i in range(len(self._devices))]
        self._threads: _ReplicaThreads | None = None
        self._run_lock = threading.Lock()
        self._build_lock = threading.Lock()

    # ------------------------------------------------------------------ run

    def _run_replicas(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        if not self._run_lock.acquire(blocking=False):
            raise ContextError(
                f"{self!r} is already running a step (strategy.run was called from inside a "
                f"replica function, a merge_call, or another thread); runs of one strategy "
                f"cannot nest or overlap")
        try:
            for ctx in self._contexts:
                ctx._global_batch_size = global_batch_size
            if len(self._devices) == 1:
                args, kwargs = per_replica_args[0]
                try:
                    return [_call_in_replica(self._contexts[0], self._devices[0], fn, args, kwargs)]
                except Exception as error:
                    if not self._is_default:
                        _name_replica(error, self, 0)
                    raise
            if self._threads is None:
                self._threads = _ReplicaThreads(self)
            with _unscoped_module_check():
                return self._threads.run(fn, per_replica_args)
        finally:
            self._run_lock.release()

    # ---------------------------------------------------------- collectives

    def _replica_exchange(self, ctx: ReplicaContext, tensors: list, tag: str) -> list:
        return ctx._exchange(tensors, tag)

    def _replica_all_reduce(self, ctx: ReplicaContext, op: ReduceOp, tensors: list) -> list:
        return self._cross_device_ops.all_reduce(self._sync, ctx._local_id, tensors, op, inplace=False)

    def _replica_all_gather(self, ctx: ReplicaContext, tensors: list, axis: int) -> list:
        everyone = ctx._exchange(tensors, "all_gather")
        device = ctx._device
        return [torch.cat([e[i].to(device) for e in everyone], dim=axis) for i in range(len(tensors))]

    # ----------------------------------------------------------- optimizers

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        if closure is not None:
            raise InvalidArgumentError(
                "optimizer.step(closure) is not supported for optimizers created in a strategy's "
                "scope: compute the loss and call loss.backward() before optimizer.step()")
        with self._build_lock:  # replica threads must share one set of twins
            twins = self._placement.twins(optimizer)
        base = optimizer._sg_base
        frame = _context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        if ctx is None or ctx._strategy is not self:
            return self._cross_replica_step(optimizer, twins)
        twin = twins[ctx._local_id]
        params = [p for group in twin.param_groups for p in group["params"]]
        sharded = self._sharded(optimizer)
        if sharded is not None:
            self._reduce_gradients(ctx, params, copy_back=False)
            sharded.step(ctx._local_id)
            ctx._exchange(None, "optimizer.step (parameters updated)")  # no replica reads a half-copied copy
            return None
        if twin is not optimizer:
            _copy_hyperparameters(optimizer, twin)
        self._reduce_gradients(ctx, params)
        return base.step(twin)

    def _sharded(self, optimizer: torch.optim.Optimizer) -> ShardedUpdate | None:
        """The range optimizers of ``optimizer`` when one update can be split between replicas."""
        sharded = optimizer.__dict__.get("_sg_sharded", False)
        if sharded is False:
            with self._build_lock:  # every replica thread asks at the first step: build it once
                sharded = optimizer.__dict__.get("_sg_sharded", False)
                if sharded is False:
                    sharded = None
                    if self._num_workers == 1 and ShardedUpdate.supports(optimizer, self._devices):
                        self._placement.twins(optimizer)  # parameters are mirrored by now
                        sharded = ShardedUpdate(optimizer, self._placement.all_copies, len(self._devices))
                    optimizer._sg_sharded = sharded
        return sharded

    def _reduce_gradients(self, ctx: ReplicaContext, params: list[torch.Tensor], *, copy_back: bool = True) -> None:
        if len(self._devices) > 1:
            grads = [p.grad for p in params]
            tag = f"optimizer.step ({len(params)} parameters)"
            everyone = ctx._exchange(grads, tag)
            if any(any(g is None for g in e) for e in everyone):
                mixed = any(any(e[i] is None for e in everyone) and any(e[i] is not None for e in everyone)
                            for i in range(len(grads)))
                if mixed:
                    for i, p in enumerate(params):
                        if p.grad is None and any(e[i] is not None for e in everyone):
                            p.grad = torch.zeros_like(p)
                    grads = [p.grad for p in params]
                    everyone = ctx._exchange(grads, tag)
                present = [i for i, g in enumerate(grads) if g is not None]
                everyone = [[e[i] for i in present] for e in everyone]
            self._cross_device_ops.reduce_exchanged(self._sync, ctx._local_id, everyone, ReduceOp.SUM,
                                                    copy_back=copy_back)
        self._cross_worker_gradients(ctx, params)

    def _cross_worker_gradients(self, ctx: ReplicaContext, params: list[torch.Tensor]) -> None:
        """Sum gradients over workers (multi-worker strategies override)."""

    def _cross_replica_step(self, optimizer: torch.optim.Optimizer, twins: list) -> Any:
        base = optimizer._sg_base
        if len(twins) > 1:
            per_twin = [[p for g in t.param_groups for p in g["params"]] for t in twins]
            with torch.no_grad():
                for i in range(len(per_twin[0])):
                    grads = [params[i].grad for params in per_twin]
                    if all(g is None for g in grads):
                        continue
                    for params in per_twin:
                        if params[i].grad is None:
                            params[i].grad = torch.zeros_like(params[i])
                    acc = _sum_into(per_twin[0][i].grad, [params[i].grad for params in per_twin[1:]],
                                    ReduceOp.SUM, len(twins))
                    for params in per_twin[1:]:
                        params[i].grad.copy_(acc)
        result = None
        sharded = self._sharded(optimizer)
        if sharded is not None:
            for replica in range(len(twins)):
                sharded.step(replica)
        else:
            for twin in twins:
                if twin is not optimizer:
                    _copy_hyperparameters(optimizer, twin)
                result = base.step(twin)
        self._placement.after_run()
        return result

    def _optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        with self._build_lock:
            twins = self._placement.twins(optimizer)
        base = optimizer._sg_base
        frame = _context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        if ctx is not None and ctx._strategy is self:
            base.zero_grad(twins[ctx._local_id], set_to_none)
        else:
            for twin in twins:
                base.zero_grad(twin, set_to_none)


    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        result = optimizer._sg_base.state_dict(optimizer)  # replica 0's: one logical copy
        sharded = self._sharded(optimizer)
        if sharded is not None:
            result["state"] = sharded.state()
        return result

    def _optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        base = optimizer._sg_base
        sharded = self._sharded(optimizer)
        if sharded is not None:  # hyperparameters here, the state in the range optimizers
            base.load_state_dict(optimizer, {**state_dict, "state": {}})
            sharded.load_state(state_dict["state"])
            return
        base.load_state_dict(optimizer, state_dict)
        for twin in self._placement.twins(optimizer)[1:]:
            base.load_state_dict(twin, state_dict)

    def _optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        if optimizer.__dict__.get("_sg_sharded"):
            raise InvalidArgumentError(
                "add_param_group after the first step is not supported for an optimizer created in a "
                "multi-replica scope; pass every parameter group when creating the optimizer")
        optimizer._sg_sharded = False  # decided again at the next step
        optimizer._sg_base.add_param_group(optimizer, param_group)
        if optimizer.__dict__.get("_sg_twins"):
            optimizer._sg_twins = None
            self._placement.twins(optimizer)

    def _reduce_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        raise TypeError(
            f"a {optimizer._sg_base.__name__} created in the scope of {self!r} cannot be pickled or "
            f"deep-copied; save its state_dict() instead (one logical copy)")


def _copy_hyperparameters(source: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Schedulers change the user's optimizer; its twins follow before every step."""
    for group, twin_group in zip(source.param_groups, twin.param_groups):
        for key, value in group.items():
            if key != "params":
                twin_group[key] = value


def _name_replica(error: BaseException, strategy: LocalStrategy, local_id: int) -> None:
    error.add_note(f"(raised in replica {strategy._first_replica_id + local_id} of {strategy!r}, "
                   f"on device {strategy._devices[local_id]})")


def _call_in_replica(ctx: ReplicaContext, device: Device, fn: Callable, args: tuple, kwargs: dict) -> Any:
    _context.push(ctx._strategy, ctx)
    try:
        if device.is_cuda:
            with torch.cuda.device(device.torch_device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    finally:
        _context.pop()


class _ReplicaThreads:
    """Persistent threads for replicas 1..n-1; replica 0 runs on the caller's thread."""

    def __init__(self, strategy: LocalStrategy):
        self._strategy = strategy
        devices = strategy._devices
        n = len(devices)
        cpu_replicas = sum(1 for d in devices if not d.is_cuda)
        self._threads_per_replica = max(1, torch.get_num_threads() // max(cpu_replicas, 1))
        self._inbox = [queue.SimpleQueue() for _ in range(n)]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        for r in range(1, n):
            thread = threading.Thread(target=self._serve, args=(r,), daemon=True,
                                      name=f"stratagem-replica-{r}")
            thread.start()

    def _serve(self, local_id: int) -> None:
        device = self._strategy._devices[local_id]
        if not device.is_cuda:
            torch.set_num_threads(self._threads_per_replica)
        inbox = self._inbox[local_id]
        while True:
            task = inbox.get()
            if task is None:
                return
            self._outbox.put((local_id, *self._attempt(local_id, *task)))

    def _attempt(self, local_id: int, fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        strategy = self._strategy
        try:
            result = _call_in_replica(strategy._contexts[local_id], strategy._devices[local_id], fn, args, kwargs)
            return True, result
        except BaseException as error:  # noqa: BLE001 - reported by run()
            strategy._sync.abort()
            return False, error
        finally:
            strategy._sync.finish(local_id)

    def run(self, fn: Callable, per_replica_args: list) -> list:
        strategy = self._strategy
        n = len(per_replica_args)
        strategy._sync.reset()
        for r in range(1, n):
            self._inbox[r].put((fn, *per_replica_args[r]))
        outcomes: list[tuple[bool, Any]] = [None] * n  # type: ignore[list-item]
        main_threads = torch.get_num_threads()
        cpu = not strategy._devices[0].is_cuda
        if cpu and main_threads != self._threads_per_replica:
            torch.set_num_threads(self._threads_per_replica)
        try:
            outcomes[0] = self._attempt(0, fn, *per_replica_args[0])
        finally:
            if cpu and main_threads != self._threads_per_replica:
                torch.set_num_threads(main_threads)
            for _ in range(n - 1):
                local_id, ok, value = self._outbox.get()
                outcomes[local_id] = (ok, value)
        failures = [(r, value) for r, (ok, value) in enumerate(outcomes)
                    if not ok and not isinstance(value, ReplicaAborted)]
        if failures:
            replica, error = failures[0]
            _name_replica(error, strategy, replica)
            raise error
        if any(not ok for ok, _ in outcomes):  # pragma: no cover - aborted without a cause
            raise ContextError("a replica was aborted without an error; this is a bug in stratagem")
        return [value for _, value in outcomes]


# ------------------------------------------------ modules used without scope

_check_lock = threading.Lock()
_check_users = [0, None]


def _forbid_unscoped(module: torch.nn.Module, args: Any) -> None:
    frame = _context.current_frame()
    if frame is None or frame.replica_context is None or len(frame.strategy._devices) < 2:
        return
    params = module.__dict__.get("_parameters")
    if params and not isinstance(params, MirroredDict):
        raise ContextError(
            f"module {type(module).__name__} has parameters but was created outside "
            f"strategy.scope(), so every replica of {frame.strategy!r} would share one copy and "
            f"the replicas would silently diverge. Create it inside `with strategy.scope():`")


class _unscoped_module_check:
    """While multi-replica runs are active, refuse modules that are not mirrored."""

    def __enter__(self) -> None:
        with _check_lock:
            if _check_users[0] == 0:
                _check_users[1] = torch.nn.modules.module.register_module_forward_pre_hook(_forbid_unscoped)
            _check_users[0] += 1

    def __exit__(self, *exc: Any) -> None:
        with _check_lock:
            _check_users[0] -= 1
            if _check_users[0] == 0:
                _check_users[1].remove()
