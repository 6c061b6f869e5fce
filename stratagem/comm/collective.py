"""The Collective: how bytes move among the replicas of a strategy.

A strategy has one Collective. Its methods come in two kinds:

- **replica context**: called on *every* local replica's thread during ``run``, with
  that replica's ``local_id``; each returns that replica's result. ``exchange`` hands
  every local replica the list of all local replicas' values (one barrier); the
  collectives (``all_reduce``, ``all_gather``, ``broadcast``, ``reduce``,
  ``reduce_scatter``, ``all_to_all``, ``scatter``, ``gather``, ``barrier``) span every
  replica of every worker.
- **process level**: called once per process in cross-replica context
  (``worker_sum(s)``, ``worker_gathers``, ``broadcast_object``, ``all_gather_object``,
  ``agree_on_modules``): identities in one process, torch.distributed across workers.

Implementations: :class:`~stratagem.comm.replicas.ReplicaCollective` (replica
threads of one process; the cross-device op picks how they sum, among them the ring of
:mod:`~stratagem.comm.ring` and a user's ``CrossDeviceOps`` in :mod:`~stratagem.comm.plugin`)
and :class:`~stratagem.comm.workers.WorkerCollective` (several processes, each with one
or more replica threads: the hierarchical combination of both; its tensor calls are in
:mod:`~stratagem.comm.worker_ops`). :mod:`~stratagem.comm.autograd` makes the all-*
collectives and broadcast differentiable on top of any of them.

Shapes and order: replica ``r`` counts over all workers (worker ``w``'s local replica
``i`` is ``w * num_local + i``); gathers concatenate in that order; ``reduce_scatter``
cuts along ``axis`` into contiguous slices, earlier replicas taking one extra row when
the length does not divide (the input splitting rule).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stratagem.data.sharding import split_sizes
from stratagem.devices import Device
from stratagem.errors import InvalidArgumentError
from stratagem.values import ReduceOp


def range_bounds(total: int, parts: int, start: int = 0) -> list[int]:
    """Where ``parts`` contiguous ranges of ``total`` elements (from ``start``) begin and end:
    ``parts + 1`` bounds, later ranges taking the extra elements. The one cut of flat parameters
    and gradients into ranges (threads' shares of a sum or an update, workers' ZeRO ranges)."""
    return [start + total * r // parts for r in range(parts + 1)]


#: What one more piece costs a thread, in elements: the Python and dispatch of its operations (a few
#: microseconds each), about what a thread adds, copies or updates of a piece this long meanwhile.
PIECE_OVERHEAD = 8192


def deal_pieces(sizes: Sequence[int], parts: int, overhead: int = PIECE_OVERHEAD) -> list[int]:
    """Which of ``parts`` threads takes each piece (``sizes``: their elements) so that the threads'
    costs (elements plus ``overhead`` per piece) come out even: the costliest piece first, each to the
    thread with the least so far (ties: the earlier piece, the lower thread). Where a cut into equal
    ranges of elements leaves one thread all the small tensors of a model (every bias and norm
    weight), this spreads them; what each piece computes is the same whichever thread computes it.

    Example::

        from stratagem.comm.collective import deal_pieces
        assert deal_pieces([10, 10, 10, 10], 2) == [0, 1, 0, 1]
        assert deal_pieces([100_000] + [64] * 4, 2) == [0, 1, 1, 1, 1]   # the small ones together
    """
    load = [0] * parts
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = min(range(parts), key=load.__getitem__)
        owners[i] = owner
        load[owner] += sizes[i] + overhead
    return owners


def check_gatherable(shapes: Sequence[Sequence[tuple[int, ...]]], dtypes: Sequence[Sequence[torch.dtype]],
                     axis: int) -> None:
    """Every replica's tensors agree in number, dtype and every dimension but ``axis``."""
    first, first_dtypes = shapes[0], dtypes[0]
    for r, (theirs, their_dtypes) in enumerate(zip(shapes, dtypes)):
        if len(theirs) != len(first):
            raise InvalidArgumentError(
                f"replica {r} passed {len(theirs)} tensors to all_gather but replica 0 passed "
                f"{len(first)}; every replica must gather the same structure")
        for a, b, da, db in zip(first, theirs, first_dtypes, their_dtypes):
            if len(a) != len(b) or not len(a) or not -len(a) <= axis < len(a) or da != db or \
                    any(x != y for d, (x, y) in enumerate(zip(a, b)) if d != axis % len(a)):
                raise InvalidArgumentError(
                    f"all_gather along axis {axis}: replica {r} passed a {db} tensor of shape "
                    f"{list(b)} but replica 0 a {da} tensor of shape {list(a)}; the tensors may "
                    f"differ only in their length along the gathered axis")


def check_axis(tensor: torch.Tensor, axis: int, name: str) -> None:
    """``tensor`` has a dimension ``axis`` to cut along."""
    if tensor.dim() == 0 or not -tensor.dim() <= axis < tensor.dim():
        raise InvalidArgumentError(
            f"{name} cuts along axis {axis}, which a tensor of shape {tuple(tensor.shape)} does not have")


class Collective:
    """Base: the declared operations, the derived collectives built on two primitives.

    Subclasses implement ``exchange``, ``exchange_all``, ``all_reduce`` and
    ``sum_exchanged`` (and the process-level methods when they span processes).
    """

    num_workers = 1
    worker_index = 0

    def __init__(self, devices: Sequence[Device]):
        self.devices = tuple(devices)
        self.num_local = len(self.devices)

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.num_local

    # ------------------------------------------------ run lifecycle (runner)

    def start_run(self) -> None:
        """A ``run`` begins; no replica is inside a collective."""

    def abort(self) -> None:
        """A replica failed: every replica waiting in a collective stops."""

    def finish(self, local_id: int) -> None:
        """Replica ``local_id`` returned from its function."""

    # ------------------------------------------------------- primitives

    def exchange(self, local_id: int, value: Any, tag: str) -> list[Any]:
        """Every *local* replica's ``value``, in local order (one barrier)."""
        raise NotImplementedError

    def exchange_all(self, local_id: int, tensors: list[torch.Tensor], tag: str) -> list[list[torch.Tensor]]:
        """Every replica's tensors over all workers, in replica order."""
        raise NotImplementedError

    def all_reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
        """New tensors holding the element-wise SUM or MEAN over all replicas."""
        raise NotImplementedError

    def sum_exchanged(self, local_id: int, everyone: list[list[torch.Tensor]], op: ReduceOp, *,
                      copy_back: bool = True) -> None:
        """Reduce in place the local tensors every replica deposited with ``exchange``.

        With ``copy_back=False`` only local replica 0's tensors surely hold the result.
        """
        raise NotImplementedError

    # ------------------------------------------- gradients, when backward ends

    def gradient_packs(self, params: list[torch.Tensor]) -> Any:
        """The packs (:class:`~stratagem.comm.gradients.GradientPacks`) that sum ``params``'
        gradients over the workers, or None in one process."""
        return None

    @property
    def overlaps_backward(self) -> bool:
        """Whether packs leave while backward runs (one local replica, several workers)."""
        return self.num_local == 1 and self.num_workers > 1

    def sum_gradients(self, local_id: int, params: list[torch.Tensor]) -> None:
        """On every local replica's thread at the end of its backward: each ``params[i].grad``
        becomes the sum over every replica of every worker, the same values on each (zeros
        stand in where a replica has no gradient; None stays where none has one). The local
        replicas first; then local replica 0's sums over the workers, which the others copy."""
        if self.num_local > 1:
            tag = f"gradient sum at the end of backward ({len(params)} parameters)"
            everyone = self.exchange(local_id, [p.grad for p in params], tag)
            if any(g is None for e in everyone for g in e):
                everyone = _zeros_where_missing(self, local_id, params, everyone, tag)
            self.sum_exchanged(local_id, everyone, ReduceOp.SUM)
        packs = self.gradient_packs(params)
        if packs is None:
            return
        if local_id == 0:
            packs.finish()
        if self.num_local > 1:
            everyone = self.exchange(local_id, params, "gradient sum (across workers)")
            if local_id != 0:
                copy_gradients(everyone[0], params)
            self.exchange(local_id, None, "gradient sum (across workers) done")

    def sum_over_workers(self, params: list[torch.Tensor]) -> None:
        """One thread: ``params``' gradients summed over the workers (the identity in one process)."""
        packs = self.gradient_packs(params)
        if packs is not None:
            packs.finish()

    # ------------------------------------------------ derived collectives

    def barrier(self, local_id: int) -> None:
        self.exchange_all(local_id, [], "barrier")

    def all_gather(self, local_id: int, tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
        return self.all_gather_parts(local_id, tensors, axis)[0]

    def all_gather_parts(self, local_id: int, tensors: list[torch.Tensor],
                         axis: int) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The all-gather, and for each tensor every replica's length along ``axis``."""
        everyone = self.exchange_all(local_id, tensors, "all_gather")
        shapes = [[tuple(t.shape) for t in replica] for replica in everyone]
        check_gatherable(shapes, [[t.dtype for t in replica] for replica in everyone], axis)
        device = self.devices[local_id].torch_device
        results = [torch.cat([e[i].to(device) for e in everyone], dim=axis) for i in range(len(tensors))]
        return results, [[s[i][axis] for s in shapes] for i in range(len(tensors))]

    def broadcast(self, local_id: int, tensors: list[torch.Tensor], source: int) -> list[torch.Tensor]:
        everyone = self.exchange_all(local_id, tensors, "broadcast")
        if any(len(e) != len(everyone[source]) for e in everyone):
            raise InvalidArgumentError(
                f"broadcast from replica {source}: the replicas passed {[len(e) for e in everyone]} tensors; "
                f"every replica must pass the same structure as the source, even though only its values are used")
        device = self.devices[local_id].torch_device
        return [t.to(device, copy=True) for t in everyone[source]]

    def reduce(self, local_id: int, tensors: list[torch.Tensor], op: ReduceOp,
               destination: int) -> list[torch.Tensor] | None:
        reduced = self.all_reduce(local_id, tensors, op)
        return reduced if self.replica_id(local_id) == destination else None

    def reduce_scatter(self, local_id: int, tensor: torch.Tensor, op: ReduceOp, axis: int,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Replica ``r``'s slice (``sizes[r]`` rows along ``axis``) of the reduction over replicas.

        ``sizes=None`` splits as evenly as possible, earlier replicas taking one extra row.
        """
        reduced = self.all_reduce(local_id, [tensor], op)[0]
        sizes = self.scatter_sizes(reduced.shape[axis], sizes)
        return torch.split(reduced, sizes, dim=axis)[self.replica_id(local_id)].clone()

    def scatter_sizes(self, length: int, sizes: Sequence[int] | None) -> list[int]:
        """``sizes`` checked against ``length`` (the even split when None)."""
        if sizes is None:
            return split_sizes(length, self.num_replicas)
        sizes = list(sizes)
        if len(sizes) != self.num_replicas or sum(sizes) != length or min(sizes) < 0:
            raise InvalidArgumentError(
                f"reduce_scatter sizes {sizes} must be {self.num_replicas} non-negative lengths "
                f"adding up to {length}")
        return sizes

    def local_sum(self, components: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new tensor: this process's replicas' ``components`` added in replica order."""
        if len(components) == 1:
            return components[0].clone()
        total = components[0]
        for c in components[1:]:
            total = total + c  # not in place: a later component may promote the dtype
        return total

    def all_to_all(self, local_id: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        everyone = self.exchange_all(local_id, tensors, "all_to_all")
        me, device = self.replica_id(local_id), self.devices[local_id].torch_device
        return [everyone[src][me].to(device, copy=True) for src in range(len(everyone))]

    def scatter(self, local_id: int, tensors: list[torch.Tensor], source: int) -> torch.Tensor:
        everyone = self.exchange_all(local_id, tensors, "scatter")
        me, device = self.replica_id(local_id), self.devices[local_id].torch_device
        return everyone[source][me].to(device, copy=True)

    def gather(self, local_id: int, tensors: list[torch.Tensor], axis: int,
               destination: int) -> list[torch.Tensor] | None:
        gathered = self.all_gather(local_id, tensors, axis)
        return gathered if self.replica_id(local_id) == destination else None

    def replica_id(self, local_id: int) -> int:
        return self.worker_index * self.num_local + local_id

    # ---------------------------------------- process level (one call each)

    def worker_sum(self, tensor: torch.Tensor, what: str = "strategy.reduce") -> torch.Tensor:
        """``tensor`` summed over workers (the identity in one process); ``what`` names the call
        in errors, and every worker must be making the same one."""
        return tensor

    def worker_sums(self, tensors: list[torch.Tensor], what: str = "strategy.reduce",
                    detail: str = "") -> list[torch.Tensor]:
        """Each of ``tensors`` summed over workers, in one exchange (``tensors`` in one process)."""
        return list(tensors)

    def worker_gathers(self, tensors: list[torch.Tensor], axis: int, what: str = "strategy.gather") -> list[torch.Tensor]:
        """Each of ``tensors``, every worker's concatenated along ``axis`` in worker order."""
        return list(tensors)

    def broadcast_object(self, value: Any) -> Any:
        """The chief's picklable ``value`` on every worker."""
        return value

    def all_gather_object(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Every worker's picklable ``value``, in worker order (``what`` names it in errors)."""
        return [value]

    def agree_on_modules(self, modules: list[torch.nn.Module]) -> None:
        """Modules just placed: check every worker built the same ones; take the chief's values."""

    def close(self) -> None:
        """Release processes' resources (idempotent)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[str(d) for d in self.devices]})"


def _zeros_where_missing(collective: Collective, local_id: int, params: list, everyone: list, tag: str) -> list:
    """A parameter with a gradient on some replicas gets zeros on the others (exchanged again);
    returns every replica's gradients of the parameters some replica has one for."""
    grads = [p.grad for p in params]
    mixed = any(any(e[i] is None for e in everyone) and any(e[i] is not None for e in everyone)
                for i in range(len(grads)))
    if mixed:
        for i, p in enumerate(params):
            if p.grad is None and any(e[i] is not None for e in everyone):
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        everyone = collective.exchange(local_id, grads, tag)
    present = [i for i, g in enumerate(grads) if g is not None]
    return [[e[i] for i in present] for e in everyone]


def copy_gradients(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Each target's ``.grad`` becomes a copy of its source's (None where the source has none)."""
    with torch.no_grad():
        for p, p0 in zip(targets, sources):
            if p0.grad is None:
                p.grad = None
            elif p.grad is None:
                p.grad = p0.grad.to(p.device, copy=True)
            else:
                p.grad.copy_(p0.grad)
