"""Where ``backward()`` is looked at by the loss-scaling check (:mod:`stratagem.nn.loss_check`).

``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped while a ``run`` of a
strategy with more than one replica in sync is active (the last such run to end restores it),
and while a strategy exists whose process holds one of several replicas in sync (code outside
``run`` then acts as that replica: DistributedDataParallel's shape). A backward is checked:

- on a replica's thread inside such a run, for its replica;
- outside ``run``, in the scope of a strategy whose process holds one of several replicas in
  sync, for that replica (the global batch size unknown);
- outside every scope, for each such strategy whose parameters the loss reaches (a whole walk
  of the graph, made only on the way to an error: a plain model of the process's own, beside
  the strategy's, is its own business).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from stratagem import _context
from stratagem.nn.loss_check import check

__all__ = ["act_outside_run", "reaches", "watching"]


class _Watch:
    """Which strategies' runs are active with several replicas in sync, and which strategies'
    one replica per process is acted as outside ``run``; the wrapper while any is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active: dict[int, int] = {}   # id(strategy) -> runs active
        #: strategies whose process holds one of several replicas in sync: a backward outside run
        #: acts as that replica (checked too)
        self.outside: weakref.WeakSet = weakref.WeakSet()
        self._original: Any = None

    def acquire(self, strategy: Any) -> None:
        with self._lock:
            self.active[id(strategy)] = self.active.get(id(strategy), 0) + 1
            self._install()

    def release(self, strategy: Any) -> None:
        with self._lock:
            left = self.active[id(strategy)] - 1
            if left:
                self.active[id(strategy)] = left
            else:
                del self.active[id(strategy)]
            self._install()

    def act_outside_run(self, strategy: Any) -> None:
        with self._lock:
            self.outside.add(strategy)
            self._install()

    def _install(self) -> None:
        """The wrapper while a run is active or a strategy is acted as outside run (the weak set
        empties when its strategies are collected: the next run's end takes the wrapper off)."""
        wanted = bool(self.active) or len(self.outside) > 0
        if wanted and self._original is None:
            self._original = torch.autograd.backward
            torch.autograd.backward = _make_checked(self._original)
        elif not wanted and self._original is not None:
            torch.autograd.backward, self._original = self._original, None


_watch = _Watch()


def _make_checked(original: Any) -> Any:
    def backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: bool = False,
                 grad_variables: Any = None, inputs: Any = None) -> None:
        if grad_tensors is None and grad_variables is None and _about_parameters(inputs):
            roots = [t.grad_fn for t in ((tensors,) if isinstance(tensors, torch.Tensor) else tensors)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.numel() == 1]
            if roots:
                _check_where_called(roots)
        return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs=inputs)
    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    return backward


def _check_where_called(roots: list[Any]) -> None:
    """The check for a backward on this thread: inside a run, for its replica; outside run in the
    scope of a strategy acted as outside run, for its one replica here; outside every scope, for
    each such strategy whose parameters the loss reaches."""
    frame = _context.current_frame()
    if frame is not None and frame.replica_context is not None:
        if id(frame.strategy) in _watch.active:
            ctx = frame.replica_context
            check(roots, frame.strategy, ctx.num_replicas_in_sync, ctx.global_batch_size)
        return
    if frame is not None and not frame.strategy.is_default:
        if frame.strategy in _watch.outside:
            check(roots, frame.strategy, frame.strategy.num_replicas_in_sync, None,
                  "outside strategy.run, in the scope of")
        return
    for strategy in list(_watch.outside):
        placement = strategy.placement
        check(roots, strategy, strategy.num_replicas_in_sync, None,
              "outside strategy.scope() and strategy.run, over parameters of",
              confirm=lambda roots: reaches(roots, placement))


def reaches(roots: list[Any], placement: Any) -> bool:
    """Whether the autograd graph below ``roots`` accumulates into a parameter ``placement``
    holds (a walk of the whole graph: only on the way to an error)."""
    seen: set[int] = set()
    todo = [node for node in roots if node is not None]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and placement.holds(variable):
            return True
        todo += [n for n, _ in node.next_functions if n is not None]
    return False


def act_outside_run(strategy: Any) -> None:
    """Check ``backward()`` outside ``run`` for ``strategy`` where its process holds one of
    several replicas in sync whose gradients are summed: code outside run acts as that replica."""
    if (strategy.outside_replica_context() is not None and strategy.num_replicas_in_sync > 1
            and strategy.placement.checks_loss_scaling):
        _watch.act_outside_run(strategy)


def _about_parameters(inputs: Any) -> bool:
    """Whether a backward may write parameters' gradients (``inputs=`` naming no parameter: not)."""
    if inputs is None:
        return True
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, dict):
        inputs = inputs.values()
    return any(isinstance(t, torch.nn.Parameter) for t in inputs)


class watching:
    """Around the replicas' calls of one ``strategy.run``: check their ``backward()`` calls
    when the strategy sums gradients over more than one replica in sync."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: Any):
        on = strategy.num_replicas_in_sync > 1 and strategy.placement.checks_loss_scaling
        self._strategy = strategy if on else None

    def __enter__(self) -> None:
        if self._strategy is not None:
            _watch.acquire(self._strategy)

    def __exit__(self, *exc: Any) -> None:
        if self._strategy is not None:
            _watch.release(self._strategy)
