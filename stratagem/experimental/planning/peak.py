"""The measured memory peak of one process during a training step (what the planner's prediction is held to).

On CPU, torch keeps no count of the bytes its allocator holds, so :class:`PeakMeter` adds up,
whenever autograd saves a tensor or uses one, a gradient is accumulated, a stage runs, or a
replay saves again, the bytes of the distinct storages of

- the model's parameters (a DTensor's local shard), their ``.grad``, and what the placement keeps
  of the gradients besides (the data axis's packs of sums, ZeRO-2's range of the sum); under
  ZeRO-3 the parameters FSDP made whole and their gradients (:func:`gathered`);
- under ZeRO-3, FSDP's all-gather buffers that outlive their gather (:func:`gather_buffers`): the
  one a forward gathered a unit into (the parameters are copies out of it), kept until the next
  unit's gather or the end of the stage's forward, and a unit's gather issued ahead of it (the
  backward's prefetch of the unit before), held until that unit's backward takes it;
- the optimizer state (constant during a step after the first);
- the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``: each
  kept while autograd holds it, counted by its storage's current size, so a ZeRO-3 unit's
  gathered parameters count while gathered), and what a recomputed region saves again in its
  backward (while torch's checkpoint keeps it; seen through ``recompute.observing``);
- the pipeline's micro-batches in flight: each stage's inputs and outputs, while the schedule
  holds them.

Its peak is the largest such sum. What it leaves out is what lives inside one operation or
collective: autograd's gradients of the activations between two operations, an optimizer
step's temporaries, a collective's scratch buffers -- ZeRO-3's two buffers side by side while
a forward's gather runs (the next one is filled before the last is freed), the gradients'
reduce-scatter buffer at the schedule's end (on CUDA, ``torch.cuda.max_memory_allocated``
counts those too, and :class:`PeakMeter` reports it there instead).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from stratagem.placement.layout import recompute


def _storage(t: torch.Tensor) -> Any:
    """The storage of ``t`` (a DTensor's local tensor's, a collective's result's), or None where it has none."""
    t = getattr(t, "_local_tensor", t)   # (not to_local(): no autograd operation while sampling)
    t = getattr(t, "elem", t)            # (an AsyncCollectiveTensor's)
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage


class _Saved:
    """One tensor autograd saved: counted while autograd holds it."""

    __slots__ = ("tensor", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: "PeakMeter"):
        self.tensor, self.meter = tensor, meter
        meter.saved[id(self)] = tensor
        meter.sample()

    def __del__(self) -> None:
        self.meter.saved.pop(id(self), None)


class _Replay:
    """Around a recomputed region's replay (in backward): what it saves, as torch's checkpoint keeps it until
    the backward uses it (its recomputation hook's frame), is counted while kept."""

    def __init__(self, meter: "PeakMeter"):
        self.meter = meter
        self.hooks: Any = None

    def __enter__(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)   # the checkpoint's recomputation hook
        if top is None:
            return
        pack, unpack = top
        inner = getattr(pack, "__wrapped__", pack)
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
        if "target_frame_ref" in cells and "gid" in cells:
            self.meter.replays.append((cells["target_frame_ref"].cell_contents, cells["gid"].cell_contents))
        else:   # a torch whose checkpoint keeps them elsewhere: the replay goes uncounted, and the peak says so
            self.meter.parts_unseen = "what a recomputed region's replay saves (not found in torch's checkpoint)"

        def counted(t: torch.Tensor) -> Any:
            packed = pack(t)
            self.meter.sample()
            return packed
        self.hooks = torch.autograd.graph.saved_tensors_hooks(counted, unpack)
        self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(*exc)


def _groups(modules: list[torch.nn.Module]) -> Iterator[Any]:
    """FSDP2's parameter groups below ``modules`` (each unit's)."""
    for module in modules:
        for sub in module.modules():
            state = getattr(sub, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            if group is not None:
                yield group


def gather_buffers(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    """ZeRO-3's all-gather buffers below ``modules`` (FSDP2's) that outlive their gather: the one FSDP keeps after a
    gather in forward (the parameters are copies out of it) until the next gather or the end of the root's
    forward, and a gather issued ahead of its unit (the backward's prefetch of the unit before), held until that
    unit takes it."""
    found = []
    for group in _groups(modules):
        if not hasattr(group, "_all_gather_result") or not hasattr(getattr(group, "comm_ctx", None),
                                                                     "all_gather_state"):
            raise RuntimeError("the memory meter cannot find FSDP's all-gather buffers (_all_gather_result, "
                               "comm_ctx.all_gather_state) in this torch: ZeRO-3's would go uncounted")
        kept = group.comm_ctx.all_gather_state
        for result in (group._all_gather_result, kept.all_gather_result if kept is not None else None):
            if result is not None:
                found.append(result.all_gather_output)
    return found


def gathered(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    """ZeRO-3's parameters made whole below ``modules`` (FSDP2's), and their gradients: counted while they
    hold memory (a resharded one's storage is empty)."""
    found = []
    for group in _groups(modules):
        if not hasattr(group, "fsdp_params"):   # (not silently: the layout's row says so)
            raise RuntimeError("the memory meter cannot find FSDP's parameter group's fsdp_params in this torch: "
                               "ZeRO-3's gathered parameters would go uncounted")
        for param in group.fsdp_params:
            whole = getattr(param, "_unsharded_param", None)   # (made at the first gather)
            if whole is not None:
                found += [whole, whole.grad]
    return found


class PeakMeter:
    """The largest sum of this process's step memory (see the module doc) while it is active.

    Example::

        import torch
        from stratagem.experimental.planning.peak import PeakMeter
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        meter = PeakMeter(list(model.parameters()))
        with meter.active():
            model(torch.randn(4, 8)).sum().backward()
        weights = 4 * (8 * 16 + 16 + 16 + 1)
        assert meter.peak >= 2 * weights   # the parameters, and their gradients once backward ends
    """

    def __init__(self, params: list[torch.Tensor], *, state_bytes: int = 0,
                 buffers: Callable[[], list[torch.Tensor]] = list, stages: list[torch.nn.Module] = (),
                 gathering: Callable[[], list[torch.Tensor]] = list):
        self.params = [p for p in params if not p.is_meta]
        self.state_bytes = state_bytes
        self.buffers = buffers
        self.gathering = gathering   # collective buffers that outlive their collective (:func:`gather_buffers`)
        self.stages = list(stages)
        self.saved: dict[int, torch.Tensor] = {}
        self.held: list[weakref.ref] = []   # stage inputs and outputs
        self.replays: list[tuple[Any, Any]] = []   # (a checkpoint frame's weak reference, its graph's id)
        self.parts_unseen = ""               # what could not be counted (in :attr:`parts` when not empty)
        self.peak = 0
        self.parts: dict[str, Any] = {}   # the peak's bytes by kind
        self.cuda = any(p.is_cuda for p in self.params)

    def sample(self) -> None:
        sizes: dict[int, int] = {}
        parts = {"parameters": self.params, "gradients": [*(p.grad for p in self.params), *self.buffers()],
                 "saved": list(self.saved.values())}
        alive = [t for t in (r() for r in self.held) if t is not None]
        if len(alive) < len(self.held) // 2:
            self.held = [weakref.ref(t) for t in alive]
        parts["in flight"] = alive
        parts["replayed"] = [t for ref, gid in self.replays if ref() is not None for t in ref().recomputed[gid].values()]
        parts["gather buffers"] = self.gathering()
        counts = {}
        for name, tensors in parts.items():
            before = sum(sizes.values())
            for t in tensors:
                storage = None if t is None or t.is_meta else _storage(t)
                if storage is not None:
                    sizes.setdefault(storage.data_ptr(), storage.nbytes())
            counts[name] = sum(sizes.values()) - before
        total = sum(sizes.values()) + self.state_bytes
        if total > self.peak:
            self.peak, self.parts = total, dict(counts, state=self.state_bytes)

    def _keep(self, value: Any) -> None:
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, torch.Tensor):
                self.held.append(weakref.ref(t))
        self.sample()

    @contextlib.contextmanager
    def active(self) -> Iterator["PeakMeter"]:
        """Count while the block runs (on CUDA: ``torch.cuda.max_memory_allocated`` over it instead)."""
        if self.cuda:
            device = self.params[0].device
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield self
            torch.cuda.synchronize(device)
            self.peak = torch.cuda.max_memory_allocated(device)
            return
        handles = []
        for stage in self.stages:
            handles.append(stage.register_forward_pre_hook(lambda m, args: self._keep(args)))
            handles.append(stage.register_forward_hook(lambda m, args, out: self._keep(out)))
        for p in [*self.params, *(t for t in self.buffers() if isinstance(t, torch.nn.Parameter))]:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda q: self.sample()))
        self.sample()
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, self), self._unpack), \
                    recompute.observing(lambda: _Replay(self)):
                yield self
        finally:
            for handle in handles:
                handle.remove()
        self.sample()
        if self.parts_unseen:
            self.parts["not counted"] = self.parts_unseen

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self.sample()
        return saved.tensor
