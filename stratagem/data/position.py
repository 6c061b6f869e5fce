"""The position of a distributed dataset: what a checkpoint saves so that input resumes exactly.

A distributed dataset counts its epochs (each ``iter()`` begins one) and the batches it
has handed out in the current epoch. A shuffling ``DataLoader`` draws each epoch's
permutation from torch's random generator (or the loader's own ``generator``) when the
epoch begins, so the position also keeps those generators' states as they were when the
epoch began, and as they are when the position is saved.

Resuming (the next ``iter()`` after ``load_state_dict``):

1. the generators are set to their state at the beginning of the saved epoch, the epoch's
   source is created again and moved past the batches already consumed -- for a
   ``DataLoader`` over a map-style dataset by skipping index batches in its batch sampler
   (no rows are loaded), otherwise by reading and dropping elements;
2. right after the skip, before the next row is loaded, the generators go back to the
   state they had before step 1 -- which, after a restore, is their state at the save.

So the permutation of the interrupted epoch is the same, and so is every later epoch's
(they are drawn from the restored state, as the uninterrupted job drew them): nothing is
skipped and nothing is repeated. Restoring a position therefore also restores torch's
global random state as it was at the save.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from stratagem.errors import CheckpointError
from stratagem.observe import record


def generators_of(dataset: Any) -> list[torch.Generator]:
    """The torch generators a DataLoader's shuffling draws from, besides the global one."""
    found: list[torch.Generator] = []
    candidates = [getattr(dataset, "generator", None), getattr(getattr(dataset, "sampler", None), "generator", None),
                  getattr(getattr(getattr(dataset, "batch_sampler", None), "sampler", None), "generator", None)]
    for generator in candidates:
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def capture(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + [g.get_state() for g in generators]


def apply(states: list[torch.Tensor], generators: list[torch.Generator]) -> None:
    torch.set_rng_state(states[0])
    for generator, state in zip(generators, states[1:]):
        generator.set_state(state)


class SkipFirst:
    """A batch sampler that leaves out the first ``skip`` batches of ``inner`` (indices only)."""

    def __init__(self, inner: Any, skip: int, on_skipped: Callable[[], None]):
        self._inner = inner
        self._skip = skip
        self._on_skipped = on_skipped

    def __len__(self) -> int:
        return max(0, len(self._inner) - self._skip)

    def __iter__(self) -> Iterator[Any]:
        return skip_then(iter(self._inner), self._skip, self._on_skipped)


def skip_then(iterator: Iterator, skip: int, on_skipped: Callable[[], None]) -> Iterator:
    """``iterator`` without its first ``skip`` elements; ``on_skipped()`` runs before the next one is read."""
    for _ in range(skip):
        if next(iterator, _END) is _END:
            break
    on_skipped()
    yield from iterator


_END = object()


def resumed_source(dataset: Iterable, skip: int, on_skipped: Callable[[], None]) -> Iterable:
    """``dataset`` positioned after its first ``skip`` elements (``on_skipped`` as in :func:`skip_then`)."""
    if isinstance(dataset, DataLoader) and not isinstance(dataset.dataset, IterableDataset) \
            and dataset.batch_sampler is not None:
        extra = {}
        if dataset.num_workers > 0:
            extra = {"prefetch_factor": dataset.prefetch_factor, "persistent_workers": dataset.persistent_workers,
                     "multiprocessing_context": dataset.multiprocessing_context}
        return DataLoader(dataset.dataset, batch_sampler=SkipFirst(dataset.batch_sampler, skip, on_skipped),
                          num_workers=dataset.num_workers, collate_fn=dataset.collate_fn,
                          pin_memory=dataset.pin_memory, timeout=dataset.timeout,
                          worker_init_fn=dataset.worker_init_fn, generator=dataset.generator, **extra)
    return _Once(lambda: skip_then(iter(dataset), skip, on_skipped))


class _Once:
    """An iterable whose one iteration is made on demand."""

    def __init__(self, make: Callable[[], Iterator]):
        self._make = make

    def __iter__(self) -> Iterator:
        return self._make()


class Position:
    """Epoch, step in the epoch, and the random states that fix the epoch's order.

    States: no epoch in progress (before the first ``iter()``, after an epoch ended, or
    after a restore of such a position), or epoch ``epoch`` in progress with ``step``
    batches consumed. A restored position waits in ``_resume`` for the next ``begin``.
    """

    def __init__(self, dataset: Iterable, num_steps: Callable[[int], int] = lambda steps: steps):
        self._generators = generators_of(dataset)
        self._elements_per_step = num_steps   # elements of the source consumed by `steps` steps
        self.epoch = 0
        self.step = 0
        self.in_progress = False
        self._epoch_states: list[torch.Tensor] | None = None
        self._resume: dict | None = None
        self._generation = 0

    def begin(self, dataset: Iterable) -> tuple[Iterable, Callable[[], None] | None, int]:
        """A new ``iter()``: the source to read, the function that returns the random states
        (when resuming; see :func:`primed`), and the token of this epoch's iterator."""
        self._generation += 1
        resume, self._resume = self._resume, None
        if resume is None:
            if self.in_progress:   # the previous epoch was left unfinished
                self.epoch += 1
            self.step, self.in_progress = 0, True
            self._epoch_states = capture(self._generators)
            return dataset, None, self._generation
        self.epoch, self.step, self.in_progress = resume["epoch"], resume["step"], True
        self._epoch_states = list(resume["epoch_rng"])
        now = capture(self._generators)
        apply(self._epoch_states, self._generators)
        done = []

        def back_to_now() -> None:
            if not done:
                done.append(True)
                apply(now, self._generators)
        return resumed_source(dataset, self._elements_per_step(self.step), back_to_now), back_to_now, \
            self._generation

    def advanced(self, token: int) -> None:
        if token == self._generation:
            self.step += 1

    def ended(self, token: int) -> None:
        if token == self._generation and self.in_progress:
            self.epoch, self.step, self.in_progress = self.epoch + 1, 0, False

    def state_dict(self) -> dict:
        if self._resume is not None:   # restored, not yet resumed: still the restored position
            return dict(self._resume, rng=capture(self._generators))
        if self.in_progress and self.step == 0:   # begun, nothing read: save it as not begun
            return {"epoch": self.epoch, "step": 0, "in_progress": False, "epoch_rng": [],
                    "rng": list(self._epoch_states)}
        return {"epoch": self.epoch, "step": self.step, "in_progress": self.in_progress,
                "epoch_rng": list(self._epoch_states) if self.in_progress else [],
                "rng": capture(self._generators)}

    def problem(self, state: Any) -> str | None:
        """Why ``state`` is not a position this dataset can resume, or None."""
        try:
            int(state["epoch"]), int(state["step"]), bool(state["in_progress"])
            rng, epoch_rng = list(state["rng"]), list(state["epoch_rng"])
        except (KeyError, TypeError, ValueError) as err:
            return (f"a dataset position needs epoch, step, in_progress, rng and epoch_rng; this one has "
                    f"{sorted(state) if isinstance(state, dict) else type(state).__name__} ({err!r})")
        if len(rng) != 1 + len(self._generators) or len(epoch_rng) not in (0, len(rng)):
            return (f"the saved dataset position holds {len(rng) - 1} DataLoader generator(s), but this dataset "
                    f"has {len(self._generators)}; build the DataLoader as the saved job did (same shuffle and "
                    f"generator arguments)")
        return None

    def load_state_dict(self, state: dict) -> None:
        problem = self.problem(state)
        if problem is not None:
            raise CheckpointError(problem)
        epoch, step, in_progress = int(state["epoch"]), int(state["step"]), bool(state["in_progress"])
        rng, epoch_rng = list(state["rng"]), list(state["epoch_rng"])
        apply(rng, self._generators)
        self._generation += 1   # iterators begun before the restore no longer count
        self.epoch, self.step, self.in_progress = epoch, step, False
        self._resume = {"epoch": epoch, "step": step, "in_progress": True, "epoch_rng": epoch_rng} \
            if in_progress else None


class PositionedDataset:
    """What a distributed dataset offers checkpoints: its epoch, and its position as a state dict.

    ``per_worker_position`` says which saved position a multi-worker restore gives each
    worker: False, the chief's (every worker cuts the same global batches, so the position
    is the same on any number of workers); True, its own (each worker reads its own input
    pipeline) -- on another number of workers or replicas, see :meth:`saved_position`.
    """

    position: Position
    per_worker_position = False
    _strategy: Any

    @property
    def resizable(self) -> bool:
        """Whether a position saved mid-epoch resumes exactly on another number of workers or replicas."""
        return not self.per_worker_position

    def saved_position(self, saved: Any) -> tuple[dict | None, str | None]:
        """This worker's position in what a checkpoint saved (``{"workers": [each worker's
        position], "num_replicas_in_sync": n}``), or why there is none to resume from.

        Per-worker pipelines saved by another number of workers or replicas (a job resumed
        after it lost a node, or given one back) resume from the chief's position at an
        epoch boundary; in the middle of an epoch only when :attr:`resizable` -- which
        elements each new pipeline has left otherwise depends on how ``dataset_fn`` divides
        the data, so the resume is refused rather than skip or repeat samples.
        """
        workers = saved.get("workers") if isinstance(saved, dict) else None
        if not workers:
            return None, "no dataset position in it"
        topology = self.strategy.topology
        replicas = saved.get("num_replicas_in_sync")   # absent in checkpoints of earlier versions
        if not self.per_worker_position:
            return workers[0], None
        if len(workers) == topology.num_workers and replicas in (None, self.strategy.num_replicas_in_sync):
            return workers[topology.worker_index], None
        chief = workers[0]
        if self.resizable or not isinstance(chief, dict) or not any(_mid_epoch(p) for p in workers):
            return chief, None   # (not a position at all: the verification that follows says why)
        saved_by = f"{len(workers)} worker(s)" + (f" with {replicas} replica(s) in sync" if replicas else "")
        return None, (
            f"the dataset position was saved by {saved_by}, each reading its own input pipeline "
            f"(distribute_datasets_from_function), in the middle of epoch {chief.get('epoch')} (step "
            f"{chief.get('step')}); this job has {topology.num_workers} worker(s) and "
            f"{self.strategy.num_replicas_in_sync} replica(s), and which elements its pipelines have left there "
            f"depends on how dataset_fn divides the data, so resuming would skip or repeat samples. Resume on "
            f"{saved_by}, or from a checkpoint saved at the end of an epoch, or read one pipeline of global "
            f"batches with experimental_distribute_dataset (its position resumes on any number of workers); if "
            f"each pipeline reads its slice of every global batch, in one order shared by all, pass "
            f"options=sg.InputOptions(experimental_resizable=True) to distribute_datasets_from_function")

    @property
    def strategy(self) -> Any:
        """The strategy this dataset distributes for."""
        return self._strategy

    @property
    def epoch(self) -> int:
        """The epoch in progress, or the next one to begin (from 0; restored by a checkpoint)."""
        return self.position.epoch

    def state_dict(self) -> dict:
        """This dataset's position (epoch, step in it, random states): ``sg.Checkpoint(data=...)`` saves it."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Move to a saved position: the next ``iter()`` continues the saved epoch where it stopped."""
        self.position.load_state_dict(state)


def _mid_epoch(position: Any) -> bool:
    """Whether a saved position lies inside an epoch (some of its batches consumed)."""
    try:
        return bool(position["in_progress"]) and int(position["step"]) > 0
    except (KeyError, TypeError, ValueError):
        return True   # not a position: the caller's verification says why


class TrackedIterator:
    """The iterator of a distributed dataset: counts the batches it hands out.

    Checkpointing the iterator (``sg.Checkpoint(data=iterator)``) saves its dataset's
    position; restoring it moves this very iterator to the saved position.
    """

    def __init__(self, owner: Any, inner: Iterator, token: int):
        self._owner = owner
        self._inner = inner
        self._token = token

    def __iter__(self) -> "TrackedIterator":
        return self

    def __next__(self) -> Any:
        try:
            with record.span("input", "input"):   # the wait for input, on the timeline
                value = next(self._inner)
        except StopIteration:
            self._owner.position.ended(self._token)
            raise
        self._owner.position.advanced(self._token)
        return value

    def get_next(self) -> Any:
        """TensorFlow's spelling of ``next(iterator)``."""
        return next(self)

    @property
    def per_worker_position(self) -> bool:
        return self._owner.per_worker_position

    def saved_position(self, saved: Any) -> tuple[dict | None, str | None]:
        return self._owner.saved_position(saved)

    @property
    def strategy(self) -> Any:
        return self._owner.strategy

    @property
    def position(self) -> Position:
        return self._owner.position

    def state_dict(self) -> dict:
        return self._owner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._owner.load_state_dict(state)
        fresh = iter(self._owner)
        self._inner, self._token = fresh._inner, fresh._token


def primed(iterator: Iterator, settle: Callable[[], None] | None) -> Iterator:
    """When resuming (``settle`` given), read the first element now: the skip and the return of
    the random states happen inside ``iter()``, not at the first ``next()``."""
    if settle is None:
        return iterator
    first = next(iterator, _END)
    settle()
    return iterator if first is _END else itertools.chain([first], iterator)
