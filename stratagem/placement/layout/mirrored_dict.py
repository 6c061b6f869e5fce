"""``module._parameters`` / ``module._buffers`` of a module mirrored on several replicas.

The dict's own storage holds the primary tensors (local replica 0's); ``copies[r]``
holds replica ``r``'s. A lookup picks the calling thread's replica: the same module
object computes with replica ``r``'s copy on replica ``r``'s thread inside ``run``,
and with the primary everywhere else. (Where the primary lives on no replica's device,
as with central storage on GPUs, replica 0 has a copy too: ``placement.first_copy`` is 0.)

On logical CPU devices the replicas' *parameters* share the primary's memory (one
tensor, several ``Parameter`` objects, each with its own ``.grad``): the update is then
applied once, and the replicas read one copy of the weights (half the cache footprint).
A parameter written in place inside ``run`` on any replica but the first is refused
(the replicas would each apply their write to the one shared memory).

Writes made outside ``run`` (``load_state_dict``, manual init) are noticed through
the tensors' version counters and pushed to every replica before the next ``run``.
Buffers written inside ``run`` (BatchNorm statistics) read, outside ``run``, as the
mean over replicas.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch

from stratagem import _context
from stratagem.errors import ContextError


class MirroredCopies(Protocol):
    """What a :class:`MirroredDict` needs of the placement that made it (``MirroredPlacement``)."""

    strategy: Any
    num_replicas: int
    first_copy: int          # replicas below it compute with the primary itself
    shares_parameters: bool  # the copies of parameters share the primary's memory

    def mirror_entry(self, entries: "MirroredDict", key: str) -> None:
        """Give every replica its copy of ``entries[key]`` (a new or replaced entry)."""


class MirroredDict(dict):
    """``module._parameters`` / ``module._buffers`` with one value per replica.

    The dict's own storage holds the primary (replica 0) tensors; ``copies[r]``
    holds replica ``r``'s. Lookups pick the calling thread's replica.
    """

    def __init__(self, placement: MirroredCopies, is_buffers: bool, items: Iterable = ()):
        super().__init__(items)
        self.placement = placement
        self._is_buffers = is_buffers
        self.copies: list[dict[str, Any]] = [{} for _ in range(placement.num_replicas)]
        self.first = placement.first_copy  # replicas below it compute with the primary itself
        self.versions: dict[str, int] = {}
        self.finalized = False
        self.shared = placement.shares_parameters and not is_buffers  # copies share the primary's memory
        self._copy_versions: list[dict[str, int]] = [{} for _ in range(placement.num_replicas)]
        self._stale = False  # buffers written by replicas, not yet averaged

    # what torch.save / copy.deepcopy see: one plain copy
    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def _replica(self) -> int | None:
        frame = _context.current_frame()
        if frame is None or frame.replica_context is None:
            return None
        if frame.strategy is not self.placement.strategy:
            raise ContextError(
                f"a module created in the scope of {self.placement.strategy!r} was called inside "
                f"run of {frame.strategy!r}; use each module only with the strategy it was created under")
        return frame.replica_context.local_replica_id

    def __getitem__(self, key: str) -> Any:
        replica = self._replica()
        if replica is not None and replica >= self.first:
            return self.copies[replica][key]
        if replica is None and self._stale:
            self._average_buffers()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self):
        return dict.__iter__(self)

    def values(self):
        return [self[k] for k in dict.keys(self)]

    def items(self):
        return [(k, self[k]) for k in dict.keys(self)]

    def copy(self) -> dict:
        return dict(self.items())

    def __setitem__(self, key: str, value: Any) -> None:
        replica = self._replica()
        if replica is not None and replica >= self.first:
            self.copies[replica][key] = value
            return
        dict.__setitem__(self, key, value)
        if self.finalized and replica is None:
            self.placement.mirror_entry(self, key)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        for copies in self.copies:
            copies.pop(key, None)
        self.versions.pop(key, None)

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = dict.__getitem__(self, key)
        del self[key]
        return value

    # ---------------------------------------------------------- synchronisation

    def set_copy(self, replica: int, key: str, tensor: torch.Tensor) -> None:
        """Replica ``replica``'s (new) copy of entry ``key``."""
        self.copies[replica][key] = tensor
        self._copy_versions[replica][key] = tensor._version

    def record_versions(self) -> None:
        for key, tensor in dict.items(self):
            if tensor is not None:
                self.versions[key] = tensor._version
        self._record_copy_versions()

    def _watches_copies(self) -> bool:
        """Whether ``after_run`` looks at writes to the copies: shared parameters, and where no
        replica computes with the primary, parameters (both refused) and buffers (averaged)."""
        return self.shared or self.first == 0

    def _record_copy_versions(self) -> None:
        """What ``after_run`` compares with (writes inside ``run`` only)."""
        if self._watches_copies():
            for copies, versions in zip(self.copies[self.first:], self._copy_versions[self.first:]):
                for key, tensor in copies.items():
                    if tensor is not None:
                        versions[key] = tensor._version

    def _written_copies(self) -> list[str]:
        return [key for copies, versions in zip(self.copies[self.first:], self._copy_versions[self.first:])
                for key, t in copies.items() if t is not None and versions.get(key) != t._version]

    def holds_nothing(self) -> bool:
        """No tensor on any replica and nothing to average: what ``push_modified`` and ``after_run``
        would do is nothing (a container module's dicts; ``run`` skips them)."""
        return not dict.__len__(self) and not self._stale and not any(self.copies)

    def push_modified(self) -> None:
        """Copy primaries written outside ``run`` to every replica."""
        if self._stale:
            self._average_buffers()
        versions = self.versions
        for key, tensor in dict.items(self):
            if tensor is None:
                continue
            if self.shared:  # one memory: only a primary given new memory must be followed
                for copies in self.copies[self.first:]:
                    if copies[key].data_ptr() != tensor.data_ptr():
                        copies[key].data = tensor.data
            elif versions.get(key) != tensor._version:
                with torch.no_grad():
                    for copies in self.copies[self.first:]:
                        copies[key].copy_(tensor)
            versions[key] = tensor._version
        self._record_copy_versions()  # a write outside run, to any replica's copy, is allowed

    def after_run(self) -> list[str]:
        """Note what ``run`` wrote; return the shared parameters a replica wrote in place."""
        written = []
        if self._is_buffers:
            versions = self.versions
            self._stale = self._stale or any(
                t is not None and versions.get(k) != t._version for k, t in dict.items(self)) or (
                self._watches_copies() and bool(self._written_copies()))
        elif self._watches_copies():
            written = self._written_copies()
        self.record_versions()
        return written

    def _average_buffers(self) -> None:
        self._stale = False
        n = len(self.copies)
        with torch.no_grad():
            for key, primary in dict.items(self):
                if primary is None or not primary.is_floating_point():
                    continue
                replicas = [primary] * self.first + [copies[key] for copies in self.copies[self.first:]]
                total = replicas[0].to(primary.device, copy=True)
                for tensor in replicas[1:]:
                    total.add_(tensor.to(total.device))
                total.div_(n)
                primary.copy_(total)
                for copies in self.copies[self.first:]:
                    copies[key].copy_(total)
        self.record_versions()
