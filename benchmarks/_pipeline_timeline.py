"""What a pipeline rank did, and when: stage compute intervals, saved activations, the theory.

- :class:`Timeline` wraps the compute entry points of pipeline stage *objects* (their
  ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``, the calls
  every ``torch.distributed.pipelining`` schedule makes for a stage's forward, backward and, in
  zero-bubble schedules, weight-gradient work) and records each call's start and end. Only the
  given instances are wrapped (attributes set on the objects), never the classes. Sends and
  receives are separate calls of the schedules, so time outside these intervals is the rank
  waiting for a peer (or doing bookkeeping): its bubble.
- :class:`SavedActivations` counts the bytes of the tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), live at once, each memory range counted once
  and parameters left out (a Linear saves its weight too); its peak is a rank's activation memory
  (CPU has no ``torch.cuda.max_memory_allocated``).
- :func:`ascii_timeline` draws one step of every rank as text (no plotting library needed).

Nothing here imports torch at import time.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def theory_bubble(stages: int, microbatches: int, chunks_per_rank: int = 1) -> float:
    """Idle fraction of a synchronous schedule with equal stage costs and free communication:
    (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v*m+p-1) with v chunks per rank (interleaved)."""
    return (stages - 1) / (chunks_per_rank * microbatches + stages - 1)


def in_flight_1f1b(stages: int, microbatches: int, rank: int) -> int:
    """Micro-batches whose activations rank ``rank`` holds at once under 1F1B (GPipe: all m)."""
    return min(microbatches, stages - rank)


class Timeline:
    """Start and end (``time.perf_counter``) of every stage compute call on this rank."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, int, int, float, float]] = []   # kind, stage, micro-batch, t0, t1

    def instrument(self, stage: Any) -> None:
        for name, kind in KINDS.items():
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._timed(method, kind, stage.stage_index))

    def _timed(self, method: Any, kind: str, stage_index: int) -> Any:
        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                self.intervals.append((kind, stage_index, chunk_id, t0, time.perf_counter()))
        return timed

    def clear(self) -> None:
        self.intervals.clear()

    def busy_s(self, start: float, end: float) -> float:
        """Seconds of stage compute inside [start, end]."""
        return sum(max(0.0, min(t1, end) - max(t0, start)) for _, _, _, t0, t1 in self.intervals)

    def relative(self, start: float) -> list[list]:
        """The intervals as ``[kind, stage, micro-batch, ms from start, ms from start]``."""
        return [[k, s, c, 1e3 * (t0 - start), 1e3 * (t1 - start)] for k, s, c, t0, t1 in self.intervals]


class SavedActivations:
    """Context manager: bytes of tensors saved for backward and still alive, and their peak.

    The pack hook counts a tensor's memory range (its first address and its bytes: once,
    however many ops save it, and a micro-batch view counts its rows only) and returns a
    small holder; when autograd frees the holder (after the backward that used it), the count
    drops. Tensors sharing a storage with one of ``exclude`` (the parameters) are not counted.
    ``peak`` is the most held at once since entering, ``live`` what is held now.
    """

    def __init__(self, exclude: Sequence[Any] = ()) -> None:
        self.live = self.peak = 0
        self._refs: dict[tuple[int, int], list[int]] = {}   # (address, bytes) -> [bytes, holders]
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def __enter__(self) -> "SavedActivations":
        import torch

        tracker = self

        class Held:
            __slots__ = ("tensor", "key")

            def __init__(self, tensor: Any) -> None:
                self.tensor = tensor
                nbytes = tensor.numel() * tensor.element_size()
                self.key = (tensor.data_ptr(), nbytes)
                entry = tracker._refs.setdefault(self.key, [nbytes, 0])
                if entry[1] == 0:
                    tracker.live += entry[0]
                    tracker.peak = max(tracker.peak, tracker.live)
                entry[1] += 1

            def __del__(self) -> None:
                entry = tracker._refs.get(self.key)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        tracker.live -= entry[0]
                        del tracker._refs[self.key]

        def pack(tensor: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in tracker._excluded:
                return Held(tensor)
            return tensor

        def unpack(held: Any) -> Any:
            return held.tensor if isinstance(held, Held) else held

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.live


def ascii_timeline(ranks: Sequence[Sequence[Sequence]], width: int = 96) -> list[str]:
    """One line per rank of one step: ``F``/``B``/``W`` (upper case: stage of the rank's first
    chunk, lower case: its second chunk, as in interleaved and V placements) and ``.`` idle.

    ``ranks[r]`` is rank r's ``[kind, stage, micro-batch, t0 ms, t1 ms]`` list (times relative
    to a common start). Micro-batch numbers are not drawn; one column is ``span / width`` ms.
    """
    ends = [iv[4] for r in ranks for iv in r]
    starts = [iv[3] for r in ranks for iv in r]
    if not ends:
        return []
    t_min, span = min(starts), max(max(ends) - min(starts), 1e-9)
    lines = []
    for rank, intervals in enumerate(ranks):
        first = min((iv[1] for iv in intervals), default=0)
        row = ["."] * width
        for kind, stage, _, t0, t1 in intervals:
            a = int((t0 - t_min) / span * width)
            b = max(a + 1, int(round((t1 - t_min) / span * width)))
            for col in range(a, min(b, width)):
                row[col] = kind if stage == first else kind.lower()
        lines.append(f"rank {rank} |{''.join(row)}|")
    lines.append(f"        0 ms{'':>{width - 12}}{span:.0f} ms")
    return lines
