"""What stratagem keeps on torch objects: one :class:`Record` per object, in one attribute.

A few torch objects carry something of stratagem's: an optimizer created in a strategy's
scope remembers its placement and its own class, a GradScaler created there its replicas'
states, a variable of parameter-server training where it lives. Each such object holds one
``Record`` in its ``__dict__`` under :data:`ATTRIBUTE` (``"_stratagem"``) and nothing else
of ours, so ``vars(obj)`` shows at once what stratagem added, and no name of ours can meet
one of torch's or the user's. Modules carry nothing: the scope's bookkeeping of modules is
kept beside them (:mod:`stratagem.placement.scope.hooks`, the placements' ``MirroredDict``).

Which object holds which fields (the others stay at their defaults):

=====================================  ===================================================
an optimizer created in scope          ``placement``, ``base``; by placement ``twins``,
                                       ``sharded``, ``zero``, ``gathered_state``
a replica's twin of that optimizer     ``placement`` (the twin is the placement's own)
a GradScaler created in scope          ``placement``, ``scaler_states``, ``pinned``
a variable of the parameter servers    ``remote``; a worker's embedding table also
                                       ``runtime``
=====================================  ===================================================

The record goes where the object's ``__dict__`` goes: ``copy.deepcopy`` and pickling of a
tensor copy it as they copy any attribute of a tensor. What must not travel never does: a
scoped optimizer or GradScaler refuses to be pickled or deep-copied; a ``ShardedVariable``
pickles as a plain ``nn.Parameter``; a placed module's variables pickle as their values;
checkpoints hold detached copies of tensors, which have no attributes.

Every object that gets a record has a ``__dict__`` (optimizers, GradScalers, tensors), so no
side table is needed. Reads are one dictionary lookup (``obj.__dict__.get``), which never
reaches ``nn.Module.__getattr__``.

Example::

    import torch
    from stratagem._record import ATTRIBUTE, Record, attach, record_of
    t = torch.zeros(2)
    assert record_of(t) is None                    # stratagem keeps nothing on it
    attach(t, remote="w")
    assert isinstance(vars(t)[ATTRIBUTE], Record) and record_of(t).remote == "w"
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

__all__ = ["ATTRIBUTE", "Record", "attach", "record", "record_of"]

#: the one attribute stratagem sets on a torch object
ATTRIBUTE = "_stratagem"


@dataclasses.dataclass(slots=True, eq=False)
class Record:
    """Everything stratagem keeps on one torch object. The types of the fields that are
    stratagem's own classes are named in their comments: this module is below them all."""

    # --- an optimizer (or GradScaler) created in a strategy's scope
    #: its strategy's placement (``stratagem.placement.scope.base.Placement``): what ``step``,
    #: ``zero_grad``, the state dicts mean. Written by ``placement.scope.hooks.adopt`` (optimizers, and
    #: twins in ``mirrored_update``) and ``grad_scaler.adopt``; read through
    #: ``placement.scope.hooks.placement_of`` and by the scoped classes' methods.
    placement: Any = None
    #: the optimizer's own class under the scope's subclass (``SGD`` under ``MirroredSGD``): the
    #: placements call its ``step``, ``zero_grad`` and state dicts. Written by ``hooks.adopt``;
    #: read through ``hooks.base_of`` and ``learning_rate.plain_class``.
    base: type | None = None
    #: one optimizer per local replica (``twins[0]`` is the optimizer itself), None until built.
    #: Written and read by ``placement/data_axis/mirrored_update.py`` (``MirroredUpdate``) and
    #: ``placement/data_axis/update_rule.py``.
    twins: list | None = None
    #: the update split between threads or workers (``placement.data_axis.sharded_update.ShardedUpdate``);
    #: None once decided that it is not split; False while not decided yet. Written and read by
    #: the update rules (``MirroredUpdate``, ``CentralUpdate``, ``ZeroUpdate``: ``sharded()``).
    sharded: Any = False
    #: ZeRO's ranges of the optimizer's parameters over the workers (``placement.data_axis.zero_ranges.ZeroRanges``).
    #: Written and read by ``placement/data_axis/zero.py`` (``ZeroUpdate``).
    zero: Any = None
    #: ZeRO's state gathered from every worker for the checkpoint being written, read once by
    #: ``state_dict()``. Written and read by ``placement/data_axis/zero.py``.
    gathered_state: dict | None = None

    # --- a GradScaler created in a strategy's scope
    #: per local replica, its scale, growth tracker and iteration state
    #: (``placement.scope.grad_scaler._ReplicaState``). Written and read by ``placement/scope/grad_scaler.py``.
    scaler_states: list | None = None
    #: ``.replica``: the replica whose state a cross-replica ``update()`` moves now. Written and
    #: read by ``placement/scope/grad_scaler.py``.
    pinned: threading.local | None = None

    # --- a variable of parameter-server training
    #: where it lives on the parameter servers (``ps.variables.RemoteVariable``). Written by
    #: ``ps/placement.py`` (the coordinator), ``ps/runtime.py`` (a worker's copy) and
    #: ``ShardedVariable``; read through ``ps.variables.remote_of`` and by ``nn/embedding.py``.
    remote: Any = None
    #: a worker's embedding table: the runtime that pulls the rows a lookup uses
    #: (``ps.runtime.WorkerRuntime``). Written by ``ps/runtime.py``; read by ``nn/embedding.py``.
    runtime: Any = None


def record_of(obj: Any) -> Record | None:
    """``obj``'s record, or None when stratagem keeps nothing on it (or it has no ``__dict__``)."""
    attributes = getattr(obj, "__dict__", None)
    return None if attributes is None else attributes.get(ATTRIBUTE)


def record(obj: Any) -> Record:
    """The record of an object stratagem made its own (a scoped optimizer or GradScaler)."""
    return obj.__dict__[ATTRIBUTE]


def attach(obj: Any, **fields: Any) -> Record:
    """``obj``'s record (made if it has none) with ``fields`` set; returned."""
    found = obj.__dict__.get(ATTRIBUTE)
    if found is None:
        found = obj.__dict__[ATTRIBUTE] = Record()
    for name, value in fields.items():
        setattr(found, name, value)
    return found
