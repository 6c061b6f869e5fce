"""Buffers that never diverge: a placement's floating buffers averaged over every replica and worker.

Buffers such as BatchNorm's running statistics are written by forwards, each replica with its
own slice of the batch, and no gradient carries them. Within one process the mirrored
placement averages its replicas' copies when they are read outside ``run``
(:mod:`~stratagem.placement.layout.mirrored_dict`: TensorFlow's ``SyncOnRead`` with ``MEAN``). Across workers,
:class:`BufferSync` does the same at points that every worker reaches together -- never at a
read that only the chief might make (``state_dict()`` on the chief alone would wait for the
others forever):

- at the end of every optimizer step of the synchronous placements (:mod:`.step`, and
  ``sharding="parameters"``'s step), inside ``run`` on every replica's thread or outside it;
- when ``sg.Checkpoint.save`` is entered on every worker (the placement's
  ``prepare_checkpoint``), so the file the chief writes holds the combined values.

What is averaged: the floating-point buffers of each module placed in scope that some replica of
some worker wrote since the last average, as the mean over all replicas
(``num_replicas_in_sync``). A module counts as written when the version counter of one of its
buffers moved (BatchNorm's kernel writes the running statistics without moving theirs, but it
counts ``num_batches_tracked`` with ``add_``); integer buffers count alike everywhere and are
left alone. First one small all-reduce of the flags of which modules were written (so every
worker averages the same buffers, whatever it saw itself), then one of their values; a model
without floating buffers exchanges nothing. A forward with no step after it (an
evaluation in training mode, the last forward of a loop) leaves each worker's own values until
the next step or checkpoint.

It also says once, at the first step, that plain BatchNorm normalizes per replica
(:class:`BatchNormWarning`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from stratagem._frames import warn_at_users_line
from stratagem.comm import agreement
from stratagem.values import ReduceOp

_WORDS = "(buffers averaged over the workers at the optimizer step)"


class BatchNormWarning(UserWarning):
    """A plain BatchNorm layer trains under several replicas in sync: it normalizes each replica's
    slice of the batch with that slice's statistics (as TensorFlow's and DistributedDataParallel's do),
    so the model differs from plain PyTorch on the whole batch. The message names the fix,
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``.

    Example::

        import warnings, stratagem as sg
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sg.nn.BatchNormWarning)   # per-replica statistics on purpose
    """


class BufferSync:
    """Averages the floating buffers of ``modules()`` over every replica and worker of ``collective``.

    ``modules`` returns the placed modules whose own buffers count, in an order that is the same
    on every worker (the placing order); ``copies(buffer)``, a placement's method (held weakly: the
    placement owns this object), every local replica's tensor of a buffer (None: the buffer itself
    is the one copy).
    """

    def __init__(self, strategy: Any, collective: Any, modules: Callable[[], Iterable[nn.Module]],
                 copies: Callable[[torch.Tensor], tuple[torch.Tensor, ...] | None] | None = None):
        self._strategy = weakref.ref(strategy)
        self._collective = collective
        self._modules = modules
        self._copies = None if copies is None else weakref.WeakMethod(copies)
        self._warned = False
        #: per local replica: id(tensor) -> (the tensor, its version when last averaged)
        self._seen: list[dict[int, tuple[torch.Tensor, int]]] = [{} for _ in range(collective.num_local)]

    def step(self, replica: int | None) -> None:
        """At the end of an optimizer step: warn once about plain BatchNorm, then average."""
        if not self._warned and replica in (None, 0):   # (one replica thread says it)
            self._warned = True
            self._warn_per_replica_statistics()
        self.average(replica)

    def average(self, replica: int | None) -> None:
        """Average what changed (on replica ``replica``'s thread inside ``run``, for all of this
        process's replicas outside it: None). Every worker calls it together."""
        collective = self._collective
        if collective.num_workers == 1:
            return   # within a process: averaged when read outside run (MirroredDict)
        holders = self._holders()
        if not holders:
            return
        if collective.num_local == 1:
            replica = None   # the process is the replica: the workers' sum, named as this average
        mine = range(collective.num_local) if replica is None else (replica,)
        device = holders[0][0][0][mine[0]].device
        flags = torch.tensor([any(self._changed(r, copies[r]) for copies in watched for r in mine)
                              for watched, _ in holders], dtype=torch.int64, device=device)
        with agreement.noted(_WORDS):
            flags = self._sum(replica, [flags])[0]
            changed = [copies for (_, floating), flag in zip(holders, flags.tolist()) if flag for copies in floating]
            if changed:
                self._average(replica, changed)
        for r in mine:   # (each replica thread its own: only the tensors the modules hold now)
            self._seen[r] = {id(copies[r]): (copies[r], copies[r]._version) for watched, _ in holders
                             for copies in watched}

    def _sum(self, replica: int | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if replica is None:
            return self._collective.worker_sums(tensors, "the buffers' average")
        return self._collective.all_reduce(replica, tensors, ReduceOp.SUM)

    def _average(self, replica: int | None, changed: list[tuple[torch.Tensor, ...]]) -> None:
        collective = self._collective
        if replica is None:   # this process's replicas first, then the workers
            totals = [collective.local_sum([c.to(copies[0].device) for c in copies]) for copies in changed]
            means = [t.div_(collective.num_replicas) for t in self._sum(None, totals)]
        else:
            means = collective.all_reduce(replica, [copies[replica] for copies in changed], ReduceOp.MEAN)
        with torch.no_grad():
            for copies, mean in zip(changed, means):
                for r in (range(len(copies)) if replica is None else (replica,)):
                    copies[r].copy_(mean)

    def _changed(self, replica: int, tensor: torch.Tensor) -> bool:
        seen = self._seen[replica].get(id(tensor))
        return seen is None or seen[0] is not tensor or seen[1] != tensor._version

    def _holders(self) -> list[tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]]:
        """For each placed module with floating buffers, in placing order: every local replica's
        tensor of each of its buffers (watched), and of its floating ones (averaged). A module counts
        as written when any of its buffers' version moved: BatchNorm's kernel writes its running
        statistics without moving theirs, but it counts ``num_batches_tracked`` with ``add_``."""
        found, taken = [], set()
        copies_of = None if self._copies is None else self._copies()
        for module in self._modules():
            buffers = _own_buffers(module)
            floating = [b for b in buffers if b.is_floating_point() and id(b) not in taken]
            if not floating:
                continue
            taken.update(id(b) for b in floating)
            every = [self._local_copies(b, copies_of) for b in buffers]
            found.append((every, [every[i] for i, b in enumerate(buffers) if any(b is f for f in floating)]))
        return found

    def _local_copies(self, buffer: torch.Tensor, copies_of: Any) -> tuple[torch.Tensor, ...]:
        copies = None if copies_of is None else copies_of(buffer)
        return (buffer,) * self._collective.num_local if copies is None else copies

    def _warn_per_replica_statistics(self) -> None:
        if self._collective.num_replicas == 1:
            return
        modules = self._modules()
        converted = {id(b) for m in modules if isinstance(m, nn.SyncBatchNorm) for b in _own_buffers(m)}
        # (a layer that convert_sync_batchnorm replaced was placed too: it shares its buffers with its successor)
        plain = sorted({type(m).__name__ for m in modules
                        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
                        and m.training and not any(id(b) in converted for b in _own_buffers(m))})
        if plain:
            warn_at_users_line(
                f"{', '.join(plain)} in training mode under {self._strategy()!r} normalizes each replica's slice "
                f"of the batch with that slice's statistics ({self._collective.num_replicas} replicas in sync), as "
                f"TensorFlow's and DistributedDataParallel's BatchNorm do, so the model is not plain PyTorch's on "
                f"the whole batch (its running statistics are averaged over the replicas). For the whole batch's "
                f"statistics, convert the model in the scope: "
                f"model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)", BatchNormWarning)


def _own_buffers(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s own buffers, the primaries on any thread."""
    return [b for b in dict.values(module.__dict__["_buffers"]) if b is not None]
