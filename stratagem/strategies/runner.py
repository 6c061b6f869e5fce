"""Replica runners: how a strategy's local replicas execute the function given to ``run``.

- :class:`InlineRunner` — one local replica: the function runs on the caller's thread.
- :class:`ThreadRunner` — several: replica 0 runs on the caller's thread and replica
  ``r`` on a persistent daemon thread (started at the first ``run``). torch's
  intra-op threads are divided between CPU replicas so that they do not
  oversubscribe the cores (``torch.set_num_threads`` is process-wide: the caller's
  count is lowered for the duration of the run and restored after).

Both push the replica's context frame for the call (so ``sg.get_replica_context()``
works inside), run ``fn`` under the caller's per-thread modes (grad mode and autocast: a
replica thread takes the caller's, as in ``torch.nn.DataParallel``), refuse a ``run`` that nests in or overlaps another run of the same
strategy, and re-raise a replica's exception in the caller with the replica named
in a note. With threads, a replica that raises aborts the collective, so replicas
waiting in a collective stop instead of hanging; the first real error is raised.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Sequence

import torch

from stratagem import _context
from stratagem._profiling import label
from stratagem.comm.collective import Collective
from stratagem.comm.sync import ReplicaAborted
from stratagem.errors import ContextError
from stratagem.observe import flight
from stratagem.strategies.replica_context import ReplicaContext


class InlineRunner:
    """Runs the one local replica on the calling thread."""

    def __init__(self, contexts: Sequence[ReplicaContext], *, name_errors: bool = True):
        self._context = contexts[0]
        self._name_errors = name_errors
        self._lock = threading.Lock()

    def run(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        if not self._lock.acquire(blocking=False):
            raise _overlapping(self._context.strategy)
        flight.note_step()   # (the flight recorder's step: one per run)
        ctx = self._context
        ctx.global_batch_size = global_batch_size
        args, kwargs = per_replica_args[0]
        _context.push(ctx.strategy, ctx)
        try:
            with _on_device(ctx), label("stratagem.replica_fn"):
                return [fn(*args, **kwargs)]
        except Exception as error:
            if self._name_errors:
                _name_replica(error, ctx)
            raise
        finally:
            _context.pop()
            self._lock.release()


class ThreadRunner:
    """Replica 0 on the calling thread, replicas 1.. on persistent daemon threads."""

    def __init__(self, contexts: Sequence[ReplicaContext], collective: Collective):
        self._contexts = list(contexts)
        self._collective = collective
        cpu_replicas = sum(1 for c in contexts if not c.device.is_cuda)
        self._cpu = not contexts[0].device.is_cuda
        self._threads_per_replica = max(1, torch.get_num_threads() // max(cpu_replicas, 1))
        self._lock = threading.Lock()
        self._inbox: list[queue.SimpleQueue] | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()

    def _start_threads(self) -> None:
        self._inbox = [queue.SimpleQueue() for _ in self._contexts]
        for ctx in self._contexts[1:]:
            threading.Thread(target=self._serve, args=(ctx,), daemon=True,
                             name=f"stratagem-replica-{ctx.local_replica_id}").start()

    def _serve(self, ctx: ReplicaContext) -> None:
        if not ctx.device.is_cuda:
            torch.set_num_threads(self._threads_per_replica)
        inbox = self._inbox[ctx.local_replica_id]
        while True:
            task = inbox.get()
            if task is None:
                return
            fn, args, kwargs, (grad_enabled, autocast) = task
            _context.push(ctx.strategy, ctx)
            try:  # grad mode and autocast are per thread: the caller's hold for every replica
                with _on_device(ctx), torch.set_grad_enabled(grad_enabled), _autocast(autocast), \
                        label("stratagem.replica_fn"):
                    outcome = (True, fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - reported by run()
                self._collective.abort()
                outcome = (False, error)
            finally:
                _context.pop()
                self._collective.finish(ctx.local_replica_id)
            self._outbox.put((ctx.local_replica_id, *outcome))

    def run(self, fn: Callable, per_replica_args: list, global_batch_size: int | None) -> list:
        if not self._lock.acquire(blocking=False):
            raise _overlapping(self._contexts[0].strategy)
        flight.note_step()
        try:
            if self._inbox is None:
                self._start_threads()
            for ctx in self._contexts:
                ctx.global_batch_size = global_batch_size
            collective, n = self._collective, len(self._contexts)
            collective.start_run()
            # before any replica starts: the thread count is also MKL's process-wide one, and a
            # replica thread starting under the caller's count would oversubscribe the cores
            main_threads = torch.get_num_threads()
            adjust = self._cpu and main_threads != self._threads_per_replica
            if adjust:
                torch.set_num_threads(self._threads_per_replica)
            modes = (torch.is_grad_enabled(), _caller_autocast())
            for r in range(1, n):
                self._inbox[r].put((fn, *per_replica_args[r], modes))
            outcomes: list[tuple[bool, Any]] = [None] * n  # type: ignore[list-item]
            ctx = self._contexts[0]
            args, kwargs = per_replica_args[0]
            _context.push(ctx.strategy, ctx)
            try:
                with _on_device(ctx), label("stratagem.replica_fn"):
                    outcomes[0] = (True, fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - reported below, once
                collective.abort()
                outcomes[0] = (False, error)
            finally:
                _context.pop()
                collective.finish(0)
                if adjust:
                    torch.set_num_threads(main_threads)
                for _ in range(n - 1):
                    local_id, ok, value = self._outbox.get()
                    outcomes[local_id] = (ok, value)
            return _results(outcomes, self._contexts)
        finally:
            self._lock.release()


def _results(outcomes: list[tuple[bool, Any]], contexts: list[ReplicaContext]) -> list:
    failures = [(r, value) for r, (ok, value) in enumerate(outcomes)
                if not ok and not isinstance(value, ReplicaAborted)]
    if failures:
        replica, error = failures[0]
        _name_replica(error, contexts[replica])
        raise error
    if any(not ok for ok, _ in outcomes):  # pragma: no cover - aborted without a cause
        raise ContextError("a replica was aborted without an error; this is a bug in stratagem")
    return [value for _, value in outcomes]


#: the device types whose autocast state a replica thread takes from the caller
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _caller_autocast() -> tuple:
    """The caller's autocast state: ``((device_type, dtype) for each enabled device type,
    cache_enabled)``, or ``()`` when autocast is off everywhere (the usual case: nothing to enter)."""
    enabled = tuple((device_type, torch.get_autocast_dtype(device_type))
                    for device_type in AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device_type))
    return (enabled, torch.is_autocast_cache_enabled()) if enabled else ()


def _autocast(state: tuple) -> contextlib.AbstractContextManager:
    """Enter on a replica thread the autocast state :func:`_caller_autocast` read on the caller's."""
    return _Autocast(*state) if state else contextlib.nullcontext()


class _Autocast(contextlib.ExitStack):
    def __init__(self, enabled: tuple[tuple[str, torch.dtype], ...], cache_enabled: bool):
        super().__init__()
        self._enabled, self._cache_enabled = enabled, cache_enabled

    def __enter__(self) -> "_Autocast":
        super().__enter__()
        for device_type, dtype in self._enabled:
            self.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self._cache_enabled))
        return self


def _on_device(ctx: ReplicaContext) -> contextlib.AbstractContextManager:
    if ctx.device.is_cuda:
        return torch.cuda.device(ctx.device.torch_device)
    return contextlib.nullcontext()


def _name_replica(error: BaseException, ctx: ReplicaContext) -> None:
    error.add_note(f"(raised in replica {ctx.replica_id_in_sync_group} of {ctx.strategy!r}, "
                   f"on device {ctx.device})")


def _overlapping(strategy: Any) -> ContextError:
    return ContextError(
        f"{strategy!r} is already running a step (strategy.run was called from inside a "
        f"replica function, a merge_call, or another thread); runs of one strategy "
        f"cannot nest or overlap")
