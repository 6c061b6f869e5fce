"""Tensor collectives between workers, as run by each worker's local replica 0.

Each function gets this worker's part (its local replicas' tensors) and the shapes of
every replica's tensors (exchanged beforehand in the message of :mod:`~stratagem.comm.agreement`,
which also checked them: receivers must know what arrives), and makes one ``torch.distributed``
call of the matching kind. Uneven parts are padded to
the longest and trimmed after; the common even case along the first dimension moves
no byte more than torch's own call (the result *is* the receive buffer).

``L`` is the number of local replicas per worker, ``W`` the number of workers; global
replica ``v * L + k`` is worker ``v``'s local replica ``k``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Shape = tuple[int, ...]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    if flat.numel() == length:
        return flat
    out = flat.new_zeros(length)
    out[:flat.numel()].copy_(flat)
    return out


def _carrier(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return tensor if tensor.device == group.device else tensor.to(group.device)


def all_reduce(group: Any, tensors: list[torch.Tensor], what: str, destination_worker: int | None = None
               ) -> list[torch.Tensor]:
    """New tensors: ``tensors`` summed over the workers (``dist.reduce`` to ``destination_worker``
    when given: only its results hold the sum).

    One dtype: one flat buffer, the results are views of it. A large single tensor is copied in a
    few chunks, each sent on while the next is copied.
    """
    results: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)

    def launch(buffer: torch.Tensor, async_op: bool) -> Any:
        if destination_worker is None:
            return dist.all_reduce(buffer, group=group.group, async_op=async_op)
        return dist.reduce(buffer, dst=group.global_rank(destination_worker), group=group.group, async_op=async_op)

    with group.guard(what, sum(t.numel() * t.element_size() for t in tensors)):
        for indices in by_dtype.values():
            parts = [tensors[i].reshape(-1) for i in indices]
            flat = parts[0].new_empty(sum(p.numel() for p in parts), device=group.device)
            pieces = 4 if flat.numel() * flat.element_size() >= (4 << 20) and len(parts) == 1 else 1
            works, offset = [], 0
            for part in parts:
                for chunk in torch.tensor_split(part, pieces):
                    target = flat[offset:offset + chunk.numel()]
                    target.copy_(chunk)
                    offset += chunk.numel()
                    if pieces > 1:
                        works.append(launch(target, True))
            if pieces == 1:
                launch(flat, False)
            for work in works:
                work.wait()
            flat = flat.to(tensors[indices[0]].device)
            offset = 0
            for i in indices:
                results[i] = flat[offset:offset + tensors[i].numel()].view(tensors[i].shape)
                offset += tensors[i].numel()
    return results


def gather(group: Any, pieces: list[torch.Tensor], shapes: list[Shape], axis: int, num_local: int,
           destination_worker: int | None = None) -> torch.Tensor | None:
    """Every replica's tensor concatenated along ``axis``: ``pieces`` are this worker's, ``shapes`` everyone's.

    With ``destination_worker`` only that worker receives it (``dist.gather``; None elsewhere),
    else every worker does (``dist.all_gather_single``).
    """
    ax = axis % len(shapes[0])
    mine = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=ax)
    moved = mine.movedim(ax, 0).contiguous()
    workers = len(shapes) // num_local
    rows = [sum(s[ax] for s in shapes[v * num_local:(v + 1) * num_local]) for v in range(workers)]
    rest = tuple(moved.shape[1:])
    numels = [r * _numel(rest) for r in rows]
    longest = max(numels)
    send = _carrier(_padded(moved.reshape(-1), longest), group)
    receives = destination_worker is None or destination_worker == group.rank
    buffer = moved.new_empty(workers * longest, device=group.device) if receives else None
    with group.guard("ReplicaContext.all_gather" if destination_worker is None else "ReplicaContext.gather",
                     send.nbytes):
        if destination_worker is None:
            _all_gather_single(buffer, send, group=group.group)
        else:
            dist.gather(send, list(buffer.chunk(workers)) if receives else None,
                        dst=group.global_rank(destination_worker), group=group.group)
    if buffer is None:
        return None
    buffer = buffer.to(mine.device)
    if ax == 0 and len(set(numels)) == 1:
        return buffer.view(sum(rows), *rest)  # the receive buffer is the concatenation
    parts = [buffer[v * longest:v * longest + numels[v]].view(rows[v], *rest).movedim(0, ax)
             for v in range(workers)]
    return torch.cat(parts, dim=ax)


def reduce_scatter(group: Any, total: torch.Tensor, sizes: list[int], axis: int, worker: int,
                   num_local: int) -> list[torch.Tensor]:
    """This worker's local replicas' slices (``sizes`` rows each along ``axis``) of ``total`` summed over workers."""
    ax = axis % total.dim()
    moved = total.movedim(ax, 0)
    rest = tuple(moved.shape[1:])
    workers = len(sizes) // num_local
    rows = [sum(sizes[v * num_local:(v + 1) * num_local]) for v in range(workers)]
    numels = [r * _numel(rest) for r in rows]
    longest = max(numels)
    if ax == 0 and len(set(numels)) == 1 and total.is_contiguous():
        send = total.reshape(-1)  # already the workers' chunks in order
    else:
        send = total.new_zeros(workers * longest)
        flat = moved.contiguous().reshape(-1)
        offset = 0
        for v in range(workers):
            send[v * longest:v * longest + numels[v]].copy_(flat[offset:offset + numels[v]])
            offset += numels[v]
    out = total.new_empty(longest, device=group.device)
    with group.guard("ReplicaContext.reduce_scatter", send.nbytes):
        dist.reduce_scatter_tensor(out, _carrier(send, group), group=group.group)
    mine = out[:numels[worker]].to(total.device).view(rows[worker], *rest)
    local = sizes[worker * num_local:(worker + 1) * num_local]
    return [piece.movedim(0, ax) for piece in torch.split(mine, local, dim=0)]


def broadcast(group: Any, tensors: list[torch.Tensor] | None, shapes: list[tuple[Shape, torch.dtype]],
              source_worker: int, device: torch.device) -> list[torch.Tensor]:
    """The source worker's ``tensors`` on every worker (``tensors`` is None elsewhere)."""
    out = []
    with group.guard("ReplicaContext.broadcast"):
        for i, (shape, dtype) in enumerate(shapes):
            if tensors is not None:
                buffer = _carrier(tensors[i].contiguous(), group)
                work = dist.broadcast(buffer, src=group.global_rank(source_worker), group=group.group, async_op=True)
                mine = tensors[i].to(device, copy=True)  # copied while the bytes travel
                work.wait()
            else:
                buffer = torch.empty(shape, dtype=dtype, device=group.device)
                dist.broadcast(buffer, src=group.global_rank(source_worker), group=group.group)
                mine = buffer.to(device)
            out.append(mine)
    return out


def all_to_all(group: Any, local: list[list[torch.Tensor]], shapes: list[list[Shape]], worker: int,
               num_local: int) -> list[list[torch.Tensor]]:
    """``local[k][j]`` goes to replica ``j``; returns, per local replica, what each replica sent it.

    ``shapes[s][j]`` is the shape replica ``s`` sends to replica ``j``. One dtype for all.
    """
    workers = len(shapes) // num_local
    me = range(worker * num_local, (worker + 1) * num_local)
    order = [local[k][v * num_local + j] for v in range(workers) for k in range(num_local) for j in range(num_local)]
    send = _flat(order)
    send_sizes = [sum(_numel(shapes[s][v * num_local + j]) for s in me for j in range(num_local))
                  for v in range(workers)]
    receive = [(s, j) for v in range(workers) for s in range(v * num_local, (v + 1) * num_local) for j in me]
    receive_sizes = [sum(_numel(shapes[s][j]) for s in range(v * num_local, (v + 1) * num_local) for j in me)
                     for v in range(workers)]
    out = send.new_empty(sum(receive_sizes), device=group.device)
    with group.guard("ReplicaContext.all_to_all", send.nbytes):
        dist.all_to_all_single(out, _carrier(send, group), receive_sizes, send_sizes, group=group.group)
    out = out.to(send.device)
    results: list[list[Any]] = [[None] * len(shapes) for _ in range(num_local)]
    offset = 0
    for s, j in receive:
        count = _numel(shapes[s][j])
        results[j - worker * num_local][s] = out[offset:offset + count].view(shapes[s][j])
        offset += count
    return results


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one flat tensor: a view when there is one, else a concatenation."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    run = _contiguous_run(tensors)
    return run if run is not None else torch.cat([t.reshape(-1) for t in tensors])


def _contiguous_run(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` when they already lie back to back in one storage (``x.chunk(n)``)."""
    if not tensors or not all(t.is_contiguous() for t in tensors):
        return None
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or t.data_ptr() != end or \
                t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


def scatter(group: Any, pieces: list[torch.Tensor] | None, shapes: list[Shape], dtype: torch.dtype,
            source_worker: int, worker: int, num_local: int, device: torch.device) -> list[torch.Tensor]:
    """Replica ``j``'s piece of the source's ``pieces`` (given on the source worker only)."""
    workers = len(shapes) // num_local
    numels = [sum(_numel(s) for s in shapes[v * num_local:(v + 1) * num_local]) for v in range(workers)]
    longest = max(numels)
    chunks = None
    if pieces is not None:  # one chunk per worker: its replicas' pieces, flat, padded to the longest
        chunks = [_carrier(_padded(_flat(pieces[v * num_local:(v + 1) * num_local]), longest), group)
                  for v in range(workers)]
    out = torch.empty(longest, dtype=dtype, device=group.device)
    with group.guard("ReplicaContext.scatter", out.nbytes):
        dist.scatter(out, chunks, src=group.global_rank(source_worker), group=group.group)
    out = out.to(device)
    results, offset = [], 0
    for s in shapes[worker * num_local:(worker + 1) * num_local]:
        results.append(out[offset:offset + _numel(s)].view(s))
        offset += _numel(s)
    return results
