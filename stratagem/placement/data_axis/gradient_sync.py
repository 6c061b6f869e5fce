"""The gradient contract: when ``backward()`` returns, ``.grad`` is the whole global batch's.

DistributedDataParallel's promise, kept for every synchronous placement (mirrored, central
storage, ZeRO stage 1, and the data axis of the mesh strategies: tensor parallel, pipeline, with
:class:`~stratagem.placement.data_axis.axis.AxisCollective` as the collective): code between
``loss.backward()`` (or a pipeline's ``forward_backward``) and ``optimizer.step()`` --
``clip_grad_norm_``, gradient logging, ``GradScaler.unscale_`` and its inf check -- sees on
every replica the gradient plain single-device PyTorch would hold.

How: every replica's tensor of every placed parameter carries one or two autograd hooks.

- a pre-hook on its ``AccumulateGrad`` node (it fires only when backward is about to
  accumulate into ``.grad``, never for ``torch.autograd.grad``) sets aside a gradient that is
  already global (from an earlier backward of the same step) so that this backward
  accumulates this replica's *new* contribution alone;
- where packs of gradients leave while backward runs (across workers with one local replica),
  a post-accumulate hook notes that the parameter's contribution is final, so that its pack can
  start its all-reduce; elsewhere the pre-hook notes the accumulation itself (one Python call
  per parameter and backward, not two). The first hook of a backward queues a callback for its
  end (``queue_callback``: it runs when the whole backward pass has finished).

At the end of the backward the collective sums the new contributions over every replica and
worker (``Collective.sum_gradients``), and each parameter's ``.grad`` becomes the set-aside
global part plus that sum -- the order plain PyTorch accumulates in. Several ``backward()``
calls before one ``step()`` thus accumulate exactly.

``strategy.no_sync()`` (or ``model.require_backward_grad_sync = False``, DDP's attribute)
skips the exchange: ``.grad`` then holds this replica's own accumulation, and the next
backward outside it sums everything accumulated since (k micro-steps, one exchange).

A backward pass inside ``run`` touches one replica's tensors and runs on that replica's
thread: the replicas meet in the collective at its end. A backward outside ``run`` (through
``strategy.reduce`` of the replicas' losses) reaches every replica's tensors in one pass: its
end sums them on the calling thread. Where a process holds one replica, every backward is that
replica's, inside ``run`` or not (DistributedDataParallel's shape: ``backward()`` at top level),
so its packs leave while it runs in both cases, as DDP's buckets do.

A pipeline schedule runs a backward pass per micro-batch, and torch's zero-bubble schedules
accumulate weight gradients into ``.grad`` by hand, where no hook sees them: the pipeline
places no hooks and runs its schedule in :meth:`GradientSync.accumulating` instead, which
sets the global parts aside first and sums the new contributions once, when the schedule
ends (its micro-batches accumulate as under ``no_sync``; one exchange per step).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
from torch.autograd import Variable

from stratagem._profiling import label
from stratagem.comm.collective import copy_gradients
from stratagem.values import is_dtensor

# The hooks below run inside backward. When backward is called from a compiled function (a
# graph break), dynamo would try to compile each hook as it fires -- once per parameter and
# replica, until its recompile limit -- and trace into the replicas' exchange: they run eagerly.
def _hook_eager(hook: Any) -> Any:
    """``hook``, which torch's autograd engine calls (never traced into), run eagerly at no cost
    per call: dynamo is told to leave its code, and every frame it calls, alone (torch's frame
    strategy). One or two such hooks fire per parameter and backward, where ``torch.compiler.disable``'s
    wrapper cost several percent of a small model's step; it stays the fallback where this torch
    has no frame strategies (imported lazily: it loads dynamo)."""
    if _SKIP_RECURSIVELY is None:
        return torch._disable_dynamo(hook)
    set_code_exec_strategy(hook.__code__, _SKIP_RECURSIVELY)
    return hook


try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    _SKIP_RECURSIVELY: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except ImportError:   # (a torch without per-code frame strategies)
    _SKIP_RECURSIVELY = None


class _Backward:
    """What one backward pass (one autograd graph task) did to this placement's tensors."""

    __slots__ = ("replicas", "accumulated", "sync", "packs")

    def __init__(self, sync: bool):
        self.replicas: set[int] = set()
        self.accumulated: set[tuple[int, int]] = set()   # (replica, parameter index)
        self.sync = sync
        self.packs: Any = None   # where packs leave during backward: looked up once per pass

    def note(self, replica: int, index: int) -> None:
        """Replica ``replica`` accumulates (or has accumulated) into parameter ``index`` in this pass."""
        self.replicas.add(replica)
        self.accumulated.add((replica, index))


class GradientSync:
    """Sums the gradients of one placement's parameters over all replicas when backward ends."""

    def __init__(self, axis: Any, collective: Any):
        self._axis = axis   # the data axis (:mod:`.axis`): its requires_sync(), DDP's attribute on the models
        self._collective = collective
        self._version = -1
        #: per local replica, the tensors it computes with (one per logical parameter, in order)
        self._replicas: list[list[torch.Tensor]] = []
        self._where: dict[int, tuple[int, int]] = {}   # id(tensor) -> (replica, index)
        self._handles: list[Any] = []
        self._accumulators: list[Any] = []   # AccumulateGrad nodes: kept alive with the hooks
        self._set_aside: list[dict[int, torch.Tensor]] = []   # global parts, per replica
        self._local: list[dict[int, torch.Tensor]] = []   # .grad holding an unsynced accumulation
        self._tasks: dict[int, _Backward] = {}
        self._lock = threading.Lock()
        self._no_sync: set[int] = set()   # local replicas inside strategy.no_sync(); -1: all
        self.in_run = False

    # ------------------------------------------------------------ the tensors

    def update(self, version: Any, replicas: list[list[torch.Tensor]], *, hooked: bool = True) -> None:
        """The placement's parameters changed (``version``): hook the tensors of ``replicas``
        (``hooked=False``: only know them, for :meth:`accumulating`)."""
        if version == self._version:
            return
        self.close()
        self._version = version
        self._replicas = replicas
        self._set_aside = [{} for _ in replicas]
        self._local = [{} for _ in replicas]
        overlaps = self._collective.overlaps_backward   # packs leave during backward: a post-accumulate hook
        for r, tensors in enumerate(replicas):
            for i, p in enumerate(tensors):
                self._where[id(p)] = (r, i)
                if not hooked or not p.requires_grad:
                    continue
                with torch.inference_mode(False), torch.enable_grad():   # placed under no_grad (inference) too
                    accumulator = p.view_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(accumulator)
                self._handles.append(accumulator.register_prehook(self._prehook(r, i, p, notes=not overlaps)))
                if overlaps:   # (else the pre-hook notes the accumulation)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def buffers(self) -> list[torch.Tensor]:
        """What the collective keeps of the gradients between steps (one replica's packs), for memory counts."""
        packs = self._collective.gradient_packs(self._replicas[0]) if len(self._replicas) == 1 else None
        return [] if packs is None else packs.buffers()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._accumulators, self._where = [], [], {}

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """``zero_grad``: nothing set aside or accumulated before it counts any more."""
        for p in tensors:
            where = self._where.get(id(p))
            if where is not None:
                r, i = where
                self._set_aside[r].pop(i, None)
                self._local[r].pop(i, None)

    # ---------------------------------------------------------------- no_sync

    def syncing(self, replica: int) -> bool:
        if -1 in self._no_sync or replica in self._no_sync:
            return False
        return self._axis.requires_sync()

    @contextlib.contextmanager
    def no_sync(self, replica: int | None) -> Iterator[None]:
        key = -1 if replica is None else replica
        if key in self._no_sync:   # nested: the outer one restores
            yield
            return
        self._no_sync.add(key)
        try:
            yield
        finally:
            self._no_sync.discard(key)

    # ------------------------------------------------------------ the hooks

    def _task(self, replica: int) -> _Backward:
        key = torch._C._current_graph_task_id()
        task = self._tasks.get(key)
        if task is None:
            with self._lock:
                task = self._tasks.get(key)
                if task is None:
                    task = self._tasks[key] = _Backward(self.syncing(replica))
                    Variable._execution_engine.queue_callback(functools.partial(self._backward_done, key))
        return task

    def _prehook(self, replica: int, index: int, p: torch.Tensor, *, notes: bool) -> Any:
        """``notes``: no post-accumulate hook on ``p`` (no pack leaves during backward): this one notes
        the accumulation."""
        @_hook_eager
        def set_aside(grad_outputs: Any) -> None:
            task = self._task(replica)
            if notes:
                task.note(replica, index)
            grad = p.grad
            if grad is None or grad is self._local[replica].get(index):
                return None   # nothing, or this replica's unsynced accumulation: keep adding to it
            if _views_a_pack(grad):   # which this backward refills
                grad = grad.clone()
            self._set_aside[replica][index] = grad   # global: this backward adds its own part alone
            self._local[replica].pop(index, None)
            p.grad = None
            return None
        return set_aside

    @_hook_eager
    def _accumulated(self, p: torch.Tensor) -> None:
        replica, index = self._where[id(p)]
        task = self._task(replica)
        task.note(replica, index)
        if task.sync:   # (hooked only where packs overlap backward) its pack may leave now
            if task.packs is None:
                task.packs = self._collective.gradient_packs(self._replicas[replica])
            task.packs.ready(p)

    # --------------------------------------------------------- end of backward

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Around code that accumulates into the ``.grad`` of the (one replica's) tensors where no
        hook sees it (a pipeline schedule): it acts as one backward pass. On entry each global part
        (a sum from an earlier pass of the step) is set aside; when the code returns, what was
        accumulated since the last sum is summed, once (kept as this process's own under
        ``no_sync``), and the global parts are added back. Every process of the axis calls it."""
        (params,) = self._replicas
        local, aside = self._local[0], self._set_aside[0]
        for i, p in enumerate(params):
            grad = p.grad
            if grad is not None and grad is not local.get(i):
                aside[i] = grad.clone() if _views_a_pack(grad) else grad   # (refilled)
                p.grad = None
        try:
            yield
        except BaseException:
            for i in list(aside):   # (what a failed schedule accumulated is dropped)
                params[i].grad = aside.pop(i)
            raise
        task = _Backward(self.syncing(0))
        task.replicas.add(0)
        for i, p in enumerate(params):
            if p.grad is not None:
                task.accumulated.add((0, i))
            elif i in aside:   # no new contribution: its global part stays as it was
                p.grad = aside.pop(i)
        self._backward_done(None, task)

    @_hook_eager
    def _backward_done(self, key: int | None, task: _Backward | None = None) -> None:
        """A backward pass ended (``key``: its task; or ``task``, the one :meth:`accumulating`
        made): sum what it accumulated (one frame between the hook and the collective)."""
        task = self._tasks.pop(key) if task is None else task
        if not task.accumulated:
            return
        with label("stratagem.gradients.sync"):
            if not task.sync:
                for replica, index in task.accumulated:
                    self._local[replica][index] = self._replicas[replica][index].grad
                return
            if len(task.replicas) > 1 or (not self.in_run and len(self._replicas) > 1):
                self._sum_all(task)   # one pass through every replica's graph, or one that could be
                return
            (replica,) = task.replicas
            params = self._replicas[replica]
            parts = self._parts(replica, task)
            for p, (new, _) in zip(params, parts):
                p.grad = new
            self._collective.sum_gradients(replica, params)
            _add_global_parts(params, parts)

    def _parts(self, replica: int, task: _Backward) -> list[Any]:
        """This replica's unsynced contribution per parameter (None: none), and its global part."""
        local, aside = self._local[replica], self._set_aside[replica]
        parts = []
        for i, p in enumerate(self._replicas[replica]):
            grad = p.grad
            if (replica, i) in task.accumulated or (grad is not None and grad is local.get(i)):
                parts.append((grad, aside.pop(i, None)))
            else:
                if grad is not None and _views_a_pack(grad):
                    # a global part that this backward did not touch (a second backward reaching
                    # only some parameters; a reentrant checkpoint's nested backward) but still a
                    # view of a pack of gradients, which this sum refills
                    grad = grad.clone()
                parts.append((None, grad))
            local.pop(i, None)
            aside.pop(i, None)
        return parts

    def _sum_all(self, task: _Backward) -> None:
        replicas = range(len(self._replicas))
        parts = [self._parts(r, task) for r in replicas]
        for r in replicas:   # .grad: the new contributions only (the global parts are added last)
            for p, (new, _) in zip(self._replicas[r], parts[r]):
                p.grad = new
        with torch.no_grad():
            for i in range(len(self._replicas[0])):
                news = [parts[r][i][0] for r in replicas]
                present = [g for g in news if g is not None]
                if not present:
                    continue
                total = present[0].clone()
                for g in present[1:]:
                    total.add_(g.to(total.device))
                for r in replicas:
                    self._replicas[r][i].grad = total if r == 0 else total.to(self._replicas[r][i].device, copy=True)
        if self._collective.num_workers > 1:
            first = self._replicas[0]
            self._collective.sum_over_workers(first)
            for tensors in self._replicas[1:]:
                copy_gradients(first, tensors)
        for r in replicas:
            _add_global_parts(self._replicas[r], parts[r])


def _views_a_pack(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a view (a DTensor: over a local tensor that is one) of a pack of sums."""
    local = grad._local_tensor if is_dtensor(grad) else grad
    return local._base is not None


def _add_global_parts(params: list[torch.Tensor], parts: list[Any]) -> None:
    """``.grad`` = the part set aside + the new sum (plain PyTorch's accumulation order)."""
    with torch.no_grad():
        for p, (_, aside) in zip(params, parts):
            if aside is None:
                continue
            if p.grad is None:
                p.grad = aside
            else:
                p.grad = aside.add_(p.grad.to(aside.device))
