"""Distributed values and the nested-structure helpers every strategy uses.

A :class:`PerReplica` holds one component per local replica. Structures (tuples,
lists, dicts, namedtuples) nest freely: a distributed batch ``(x, y)`` is a tuple
of two PerReplica values, and ``strategy.run`` unwraps them at any depth.
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Callable, Sequence

import torch

from stratagem.errors import InvalidArgumentError


class ReduceOp(enum.Enum):
    """How values are combined across replicas: ``SUM`` or ``MEAN``.

    The strings ``"sum"`` and ``"mean"`` (any case) are accepted wherever a
    ReduceOp is.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise InvalidArgumentError(
            f"unsupported reduce op {op!r}: use sg.ReduceOp.SUM, sg.ReduceOp.MEAN, "
            f"or the strings 'sum' / 'mean' (other reductions such as max are not "
            f"defined across replicas)"
        )


class DistributedValues:
    """Base of values that have one component per local replica."""

    __slots__ = ("_values", "_strategy", "_global_batch_size")

    def __init__(self, values: Sequence[Any], strategy: Any = None,
                 global_batch_size: int | None = None):
        self._values = tuple(values)
        self._strategy = strategy
        self._global_batch_size = global_batch_size

    @property
    def strategy(self) -> Any:
        """The strategy that made this value (None for one made by hand)."""
        return self._strategy

    @property
    def global_batch_size(self) -> int | None:
        """For a distributed batch: the rows of the global batch it was cut from."""
        return self._global_batch_size

    @property
    def values(self) -> tuple[Any, ...]:
        """The local components, in replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        name = type(self).__name__
        body = ",\n  ".join(f"{i}: {_short_repr(v)}" for i, v in enumerate(self._values))
        return f"{name}:{{\n  {body}\n}}"


class PerReplica(DistributedValues):
    """One value per local replica, as returned by ``strategy.run``.

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        v = s.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
        print(v)                                  # PerReplica:{ 0: tensor(0.), 1: tensor(1.) }
        print(s.reduce("sum", v, axis=None))      # tensor(1.)
    """

    __slots__ = ()


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a torch ``DTensor``, without loading DTensor's module (seconds, sympy
    with it) where nothing has: until something has (tensor parallelism, FSDP), no value is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, getattr(module, "DTensor", ()))


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------- nest

def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(structure: Any) -> list[Any]:
    """The leaves of a nested tuple/list/dict/namedtuple structure, depth first.

    Dicts are walked in sorted key order so that every replica and every worker
    sees the same order. DistributedValues are leaves.
    """
    leaves: list[Any] = []
    _flatten_into(structure, leaves)
    return leaves


def _flatten_into(x: Any, out: list[Any]) -> None:
    if isinstance(x, dict):
        for key in _sorted_keys(x):
            _flatten_into(x[key], out)
    elif isinstance(x, (list, tuple)):
        for item in x:
            _flatten_into(item, out)
    else:
        out.append(x)


def _sorted_keys(d: dict) -> list:
    try:
        return sorted(d)
    except TypeError:  # keys of mixed types: insertion order is all we have
        return list(d)


def pack_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild ``structure`` with its leaves replaced by ``leaves`` (in flatten order)."""
    it = iter(leaves)
    result = _pack(structure, it)
    return result


def _pack(x: Any, it) -> Any:
    if isinstance(x, dict):
        packed = {key: _pack(x[key], it) for key in _sorted_keys(x)}
        result = {key: packed[key] for key in x}  # the caller's key order
        if type(x) is dict:
            return result
        try:
            return type(x)(result)
        except TypeError:  # e.g. defaultdict needs a factory
            return result
    if _is_namedtuple(x):
        return type(x)(*[_pack(item, it) for item in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_pack(item, it) for item in x)
    return next(it)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping the structure."""
    return pack_as(structure, [fn(leaf) for leaf in flatten(structure)])


def select_replica(replica_id: int, structure: Any) -> Any:
    """Replace every DistributedValues leaf with its ``replica_id`` component."""
    def pick(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return leaf._values[replica_id]
        return leaf
    return map_structure(pick, structure)


def regroup(per_replica_results: Sequence[Any], strategy: Any = None) -> Any:
    """Turn a list of per-replica structures into one structure of PerReplica leaves.

    ``[(a0, b0), (a1, b1)]`` becomes ``(PerReplica(a0, a1), PerReplica(b0, b1))``.
    A leaf that is the very same object on every replica stays as it is (None, a
    constant). Replicas returning differently shaped structures is an error.
    """
    first = per_replica_results[0]
    flat = [flatten(r) for r in per_replica_results]
    for replica_id, leaves in enumerate(flat[1:], start=1):
        if len(leaves) != len(flat[0]):
            raise InvalidArgumentError(
                f"replica {replica_id} returned a structure with {len(leaves)} leaves but "
                f"replica 0 returned {len(flat[0])}; every replica's function must return "
                f"the same structure")
    grouped = []
    for i in range(len(flat[0])):
        components = [leaves[i] for leaves in flat]
        if all(c is components[0] for c in components):
            grouped.append(components[0])
        else:
            grouped.append(PerReplica(components, strategy))
    return pack_as(first, grouped)


def check_owned(strategy: Any, num_local_replicas: int, structure: Any, method: str) -> None:
    """Refuse distributed values in ``structure`` that ``strategy.<method>()`` cannot take: made by
    another strategy, or with another number of components than its local replicas."""
    for leaf in flatten(structure):
        if isinstance(leaf, DistributedValues):
            if leaf.strategy is not None and leaf.strategy is not strategy:
                raise InvalidArgumentError(
                    f"strategy.{method}() got a {type(leaf).__name__} produced by another "
                    f"strategy ({leaf.strategy!r}); distributed values can only be used with "
                    f"the strategy that made them")
            if len(leaf.values) != num_local_replicas:
                raise InvalidArgumentError(
                    f"strategy.{method}() got a {type(leaf).__name__} with {len(leaf.values)} "
                    f"components, but this strategy has {num_local_replicas} local replicas")


def global_batch_size_of(structure: Any) -> int | None:
    """The global batch size a distributed batch in ``structure`` was cut from, else None."""
    for leaf in flatten(structure):
        if isinstance(leaf, DistributedValues) and leaf.global_batch_size is not None:
            return leaf.global_batch_size
    return None
