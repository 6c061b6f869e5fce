"""What each worker says before a collective across workers: one fixed-size message, checked.

Every collective across workers that user code reaches (the replica context's, ``strategy.reduce``
and ``strategy.gather``, the object exchanges behind metrics and checkpoints) begins with one
all-gather of :func:`message_bytes` per worker. The size is the same whatever the call, so a call
never meets another one of a different size (gloo aborts the process on that, and sums the bytes
of one dtype as another of the same size). Each worker's message holds:

- a digest of what must agree: the collective (its public name), its arguments in words (the
  reduction, the axis, the source or destination) and the tensors' dtypes and shapes, as far as
  the collective needs them to agree (:class:`Call`'s ``rule``);
- the shapes that receivers need to size their buffers, when they fit (else they travel
  pickled, one more exchange every worker makes alike);
- for a sum of at most :func:`inline_bytes` (16 KiB shared by the workers, at least 512 bytes
  each), or a small pickled object, the values themselves: then the message is the whole
  collective.

Every worker reads every worker's message, so all of them decide alike. A mismatch raises on
every worker together (:func:`agree`; one more exchange, of the descriptions, names what each
worker passed), and none is left waiting for the others or aborted by gloo.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from stratagem.errors import CollectiveMismatchError, InvalidArgumentError

Shape = tuple[int, ...]
Described = list[list[tuple[Shape, torch.dtype]]]  # per replica, per tensor: (shape, dtype)

HEADER = 64                  # int64s: digest, lengths, a number, the shapes' codes
_FIELDS = 4                  # digest, number of codes, inline bytes, the call's number
_ALIGN = 16                  # inline values start at multiples of this many bytes
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_NUMPY = {dtype: torch.empty(0, dtype=dtype).numpy().dtype for dtype in DTYPES if dtype != torch.bfloat16}


_notes = threading.local()


@contextlib.contextmanager
def noted(words: str) -> Iterator[None]:
    """Collectives this thread calls inside say ``words`` too (part of what must agree)."""
    before = getattr(_notes, "words", "")
    _notes.words = words
    try:
        yield
    finally:
        _notes.words = before


def note() -> str:
    """What :func:`noted` asks this thread's collectives to say ("" outside it)."""
    return getattr(_notes, "words", "")


@dataclass
class Call:
    """One worker's side of a collective.

    ``rule`` says what of ``described`` must agree across workers: ``"same"`` (every dtype and
    shape: reductions), ``"gather"`` (all but the length along ``axis``), ``"count"`` (the number
    of tensors: a broadcast, whose receivers' values are ignored) or ``"none"`` (the call and its
    arguments only).
    """

    what: str                                   # the public call: "ReplicaContext.all_reduce"
    detail: str = ""                            # its arguments in words: "with 'sum'", "along axis 0"
    described: Described = field(default_factory=list)
    rule: str = "same"
    axis: int = 0

    def key(self) -> int:
        if self.rule == "same":
            body: Any = self.described
        elif self.rule == "gather":
            body = [[(dtype, _masked(shape, self.axis)) for shape, dtype in replica] for replica in self.described]
        elif self.rule == "count":
            body = [len(replica) for replica in self.described]
        else:
            body = None
        text = repr((self.what, self.detail, self.rule, body)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass
class Agreed:
    """What every worker said, in worker order."""

    described: list[Described] | None   # the shapes (when asked for)
    numbers: list[int]                  # each worker's number (a pickled object's size)
    values: np.ndarray                  # [workers, inline_bytes] bytes: the values sent in the messages
    lengths: list[int]                  # bytes of values each worker sent (-1: none, they did not fit)

    @property
    def inline(self) -> bool:
        """Whether every worker's values came in the messages."""
        return all(n >= 0 for n in self.lengths)


def describe(tensors: Sequence[torch.Tensor]) -> list[tuple[Shape, torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def inline_bytes(workers: int) -> int:
    """Bytes of values each worker's message carries: 16 KiB over the workers, at least 512 (on
    loopback a message of up to 16 KiB costs what one of 1 KiB does; with many workers the
    all-gather's total stays bounded)."""
    return max(512, (16384 // workers) // _ALIGN * _ALIGN)


def message_bytes(workers: int) -> int:
    """The size of each worker's message: the header and the room for values."""
    return HEADER * 8 + inline_bytes(workers)


def fits(values: Sequence[Any], workers: int) -> bool:
    """Whether ``values`` (tensors of a known dtype, or bytes) ride in the message: small enough."""
    end = 0
    for v in values:
        if isinstance(v, bytes):
            end = _aligned(end) + len(v)
        elif v.dtype in DTYPES:
            end = _aligned(end) + v.numel() * v.element_size()
        else:
            return False
    return end <= inline_bytes(workers)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _masked(shape: Shape, axis: int) -> tuple:
    ax = axis % len(shape) if -len(shape) <= axis < len(shape) else None
    return tuple(-1 if d == ax else n for d, n in enumerate(shape))


def agree(group: Any, call: Call, *, shapes: bool = False, values: Sequence[torch.Tensor] | None = None,
          number: int = 0) -> Agreed:
    """Exchange ``call``'s message with every worker of ``group``; raise on every worker alike
    if what must agree does not. ``shapes``: return every worker's ``described``; ``values``:
    tensors (or bytes) sent in the message when they fit; ``number``: an integer each worker
    tells the others (not checked)."""
    header = [call.key(), -1, -1, number]
    codes = _encode(call.described) if shapes else None
    if codes is not None:
        header[1] = len(codes)
        header += codes
    size = message_bytes(group.world_size) // 8
    message = bytearray(size * 8)  # built in Python: fewer torch calls on the hot path
    if values is not None and fits(values, group.world_size):
        header[2] = _pack(message, values)
    struct.pack_into(f"<{len(header)}q", message, 0, *header)
    everyone = torch.empty(group.world_size * size, dtype=torch.int64, device=group.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch's newer name)
    with group.guard(call.what, len(message)):
        all_gather(everyone, torch.frombuffer(message, dtype=torch.int64).to(group.device), group=group.group)
    rows = everyone.cpu().numpy().reshape(group.world_size, size)  # (numpy: cheaper calls than torch's)
    heads = rows[:, :_FIELDS].tolist()
    if any(head[0] != heads[0][0] for head in heads):
        refuse(group, call)
    described = None
    if shapes:
        if all(head[1] >= 0 for head in heads):
            longest = max(head[1] for head in heads)
            all_codes = rows[:, _FIELDS:_FIELDS + longest].tolist()
            described = [_decode(c[:head[1]]) for c, head in zip(all_codes, heads)]
        else:  # too long, or an unusual dtype somewhere: pickled (every worker sees it alike)
            described = group.all_gather_object(call.described, f"{call.what} (shapes)")
    return Agreed(described, [head[3] for head in heads], rows.view(np.uint8)[:, HEADER * 8:],
                  [head[2] for head in heads])


def _pack(message: bytearray, values: Sequence[Any]) -> int:
    """Writes ``values`` (tensors, or bytes) after the header; returns how many bytes they span."""
    offset = 0
    for value in values:
        offset = _aligned(offset)
        data = value if isinstance(value, bytes) else _raw(value)
        message[HEADER * 8 + offset:HEADER * 8 + offset + len(data)] = data
        offset += len(data)
    return offset


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def summed(values: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``like``'s tensors summed over the workers' inline ``values``, in worker order
    (so every worker computes the same bits), with ``like``'s dtype, shape and device."""
    out, offset = [], 0
    for t in like:
        offset = _aligned(offset)
        size = t.numel() * t.element_size()
        raw = values[:, offset:offset + size]
        if t.dtype == torch.bfloat16:  # (numpy has no bfloat16)
            parts: Any = torch.from_numpy(raw.copy()).view(torch.bfloat16)
        else:
            parts = raw.view(_NUMPY[t.dtype])
        total = parts[0] + parts[1] if len(parts) > 1 else parts[0].copy()
        for part in parts[2:]:
            total = total + part
        total = torch.from_numpy(total.reshape(t.shape)) if isinstance(total, np.ndarray) else total.reshape(t.shape)
        out.append(total if t.device.type == "cpu" else total.to(t.device))
        offset += size
    return out


# ------------------------------------------------ objects: pickled, their sizes in the message

def all_gather_object(group: Any, obj: Any, what: str) -> list[Any]:
    """Every worker's picklable ``obj``, in worker order: the message (the pickle itself when
    every worker's fits), then one all-gather of the pickles padded to the longest."""
    data = pickle.dumps(obj)
    agreed = agree(group, Call(what, rule="none"), values=[data], number=len(data))
    sizes = agreed.numbers
    if agreed.inline:
        blobs = [agreed.values[w, :sizes[w]].tobytes() for w in range(group.world_size)]
    else:
        longest = max(sizes)
        send = torch.zeros(longest, dtype=torch.uint8)
        send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(group.world_size * longest, dtype=torch.uint8, device=group.device)
        with group.guard(what, longest):
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
                everyone, send.to(group.device), group=group.group)
        everyone = everyone.cpu().numpy()
        blobs = [everyone[w * longest:w * longest + sizes[w]].tobytes() for w in range(group.world_size)]
    return [pickle.loads(blob) for blob in blobs]


def broadcast_object(group: Any, obj: Any, what: str, src: int) -> Any:
    """Worker ``src``'s picklable ``obj`` on every worker (it keeps its own): the message (the
    pickle itself when it fits), else one broadcast of the pickle."""
    mine = group.rank == src
    data = pickle.dumps(obj) if mine else b""
    agreed = agree(group, Call(what, f"from {group.names[src]}", rule="none"), values=[data] if mine else None,
                   number=len(data))
    size = agreed.numbers[src]
    if agreed.lengths[src] >= 0:
        return obj if mine else pickle.loads(agreed.values[src, :size].tobytes())
    blob = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine
            else torch.empty(size, dtype=torch.uint8)).to(group.device)
    with group.guard(what, size):
        dist.broadcast(blob, src=group.global_rank(src), group=group.group)
    return obj if mine else pickle.loads(blob.cpu().numpy().tobytes())


# ------------------------------------------------ the shapes: a few integers each

def _encode(described: Described) -> list[int] | None:
    codes = [len(described)]
    for replica in described:
        codes.append(len(replica))
        for shape, dtype in replica:
            if dtype not in DTYPES:
                return None
            codes += [DTYPES.index(dtype), len(shape), *shape]
    return codes if len(codes) <= HEADER - _FIELDS else None


def _decode(codes: list[int]) -> Described:
    it = iter(codes)
    out = []
    for _ in range(next(it)):
        replica = []
        for _ in range(next(it)):
            dtype, ndim = DTYPES[next(it)], next(it)
            replica.append((tuple(next(it) for _ in range(ndim)), dtype))
        out.append(replica)
    return out


# ------------------------------------------------ a mismatch: every worker says what it passed

_VERBS = {  # (one worker, several)
    "ReplicaContext.all_reduce": ("all-reduces", "all-reduce"),
    "ReplicaContext.reduce": ("reduces", "reduce"),
    "ReplicaContext.all_gather": ("all-gathers", "all-gather"),
    "ReplicaContext.gather": ("gathers", "gather"),
    "ReplicaContext.reduce_scatter": ("reduce-scatters", "reduce-scatter"),
    "ReplicaContext.broadcast": ("broadcasts", "broadcast"),
    "ReplicaContext.all_to_all": ("sends all-to-all", "send all-to-all"),
    "ReplicaContext.scatter": ("scatters", "scatter"),
    "strategy.reduce": ("reduces (strategy.reduce)", "reduce (strategy.reduce)"),
    "strategy.gather": ("gathers (strategy.gather)", "gather (strategy.gather)"),
}
_REPORT = "comparing what the workers passed to a collective"


def refuse(group: Any, call: Call) -> None:
    """The workers disagree: every worker learns what each passed, and raises the same error."""
    everyone = group.all_gather_object((call.what, call.detail, call.described, call.rule, call.axis), _REPORT)
    raise mismatch_error(group.names, everyone)


def mismatch_error(names: Sequence[str], everyone: list[tuple]) -> Exception:
    """The error for workers that passed ``everyone`` (each worker's :class:`Call` fields, in order)."""
    variants: list[tuple[tuple, list[str]]] = []
    for name, said in zip(names, everyone):
        key = Call(*said).key()
        for variant, who in variants:
            if Call(*variant).key() == key:
                who.append(name)
                break
        else:
            variants.append((said, [name]))
    first = everyone[0]
    parts, before = [], None
    for said, who in variants:
        what, detail, described, rule = said[:4]
        verbs = _VERBS.get(what, (f"calls {what}", f"call {what}"))
        verb = verbs[0] if len(who) == 1 else verbs[1]
        new_call = before is None or before[0] != what
        words = [verb if new_call else "", _tensors(described, rule)]
        if detail and (new_call or before[1] != detail):
            words.append(detail)
        before = (what, detail)
        parts.append(" ".join([" and ".join(who)] + [w for w in words if w]))
    if len(variants) < 2:  # (cannot happen: the digests differed)
        return CollectiveMismatchError(f"{first[0]} across workers: the workers' calls did not match")
    other = variants[1][0]
    head = f"{first[0]} across workers: {', '.join(parts)}"
    if other[0] != first[0]:
        return CollectiveMismatchError(
            f"{head}: the workers called different collectives at the same point; every worker must "
            f"make the same collective calls in the same order (look for a branch that depends on "
            f"the worker, such as `if strategy.cluster_resolver.task_id == 0:`)")
    if other[1] != first[1]:
        grads = " (inputs that require grad on some workers only: pass such inputs on every worker, or " \
                "detach them on every worker)" if "autograd" in first[1] + other[1] else ""
        return InvalidArgumentError(f"{head}: every worker must call {first[0]} with the same arguments{grads}")
    where = _first_difference(first[2], other[2], names[0], variants[1][1][0], first[3], first[4])
    fixes = {
        "same": "every worker must pass tensors of the same dtypes and shapes, in the same structure "
                "(cast with x.to(dtype) or reshape where they differ)",
        "gather": "every worker must pass the same number of tensors, of the same dtypes, that differ "
                  "in shape only along the gathered axis",
        "count": "every worker must pass the same structure (as many tensors as the source), even "
                 "though only the source's values are used",
    }
    return InvalidArgumentError(f"{head}{where}: {fixes.get(first[3], 'every worker must pass the same')}, "
                                f"and make the same collective calls in the same order")


def _name(shape: Shape, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(n) for n in shape)}]"


def _tensors(described: Described, rule: str) -> str:
    if rule == "none":
        return ""

    def one(replica: list) -> str:
        if len(replica) == 1:
            return _name(*replica[0])
        names = [_name(*t) for t in replica[:6]] + (["..."] if len(replica) > 6 else [])
        return f"{len(replica)} tensors ({', '.join(names)})"
    if all(replica == described[0] for replica in described):  # (several local replicas: each alike)
        return one(described[0]) if described else ""
    return "[" + "; ".join(f"local replica {k}: {one(r)}" for k, r in enumerate(described)) + "]"


def _first_difference(a: Described, b: Described, name_a: str, name_b: str, rule: str, axis: int) -> str:
    """Where two long descriptions first differ ("" when the message shows them whole)."""
    flat_a = [t for replica in a for t in replica]
    flat_b = [t for replica in b for t in replica]
    if rule == "none" or (len(flat_a) <= 6 and len(flat_b) <= 6) or len(flat_a) != len(flat_b):
        return ""
    for i, (x, y) in enumerate(zip(flat_a, flat_b)):
        differs = x[1] != y[1] or (_masked(x[0], axis) != _masked(y[0], axis) if rule == "gather"
                                   else rule == "same" and x[0] != y[0])
        if differs:
            return f" (tensor #{i} is {_name(*x)} on {name_a} but {_name(*y)} on {name_b})"
    return ""
