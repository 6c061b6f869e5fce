"""What travels with a closure: references pickled on the coordinator, resolved on a worker."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from stratagem._record import attach, record_of
from stratagem.errors import InvalidArgumentError
from stratagem.ps.closures import ClosurePickler, ClosureUnpickler, PerWorkerIterator
from stratagem.ps.placement import _VariableDict
from stratagem.ps.runtime import WorkerRuntime
from stratagem.ps.variables import RemoteVariable, Shard
from stratagem.rpc.codec import decode, encode

pytestmark = pytest.mark.timeout(30)


def _placed(var_id: str, value: torch.Tensor) -> _VariableDict:
    """A module's parameter dict as the coordinator's placement leaves it (no ps needed)."""
    weight = nn.Parameter(value)
    attach(weight, remote=RemoteVariable(var_id, tuple(value.shape), value.dtype,
                                         (Shard(f"{var_id}/part_0", 0, 0, value.shape[0]),)))
    variables = _VariableDict(placement=None)
    dict.__setitem__(variables, "weight", weight)
    dict.__setitem__(variables, "bias", None)
    return variables


def test_references_resolve_against_the_runtime_given_to_the_unpickler() -> None:
    runtime = WorkerRuntime([], secrets.token_urlsafe(32), num_workers=1, worker_index=0)
    runtime.create_dataset("data", lambda: [10, 20])
    message = encode({"params": _placed("0/Linear.weight", torch.ones(2, 3)),
                      "iterator": PerWorkerIterator("data", "it0"), "x": torch.arange(3)},
                     pickler=ClosurePickler)

    unpickler = ClosureUnpickler(message, runtime)
    request = unpickler.load()

    local = runtime.params["0/Linear.weight"]
    assert request["params"] == {"weight": local, "bias": None}
    assert local.shape == (2, 3) and not local.any()      # values come from the ps, not the message
    assert unpickler.var_ids == ["0/Linear.weight"]        # recorded on this unpickler only
    assert next(request["iterator"]) == 10 and next(request["iterator"]) == 20
    assert torch.equal(request["x"], torch.arange(3))


def test_pickled_otherwise_a_placed_dict_is_a_dict_of_its_values() -> None:
    variables = _placed("w", torch.full((2,), 3.0))
    variables._placement = SimpleNamespace(version=-1, loading=False, written_buffers=set())  # values are current
    plain = decode(encode({"v": variables}))["v"]
    assert type(plain) is dict and plain["bias"] is None
    assert torch.equal(plain["weight"], torch.full((2,), 3.0)) and record_of(plain["weight"]) is None


def test_an_embedding_id_out_of_range_raises_on_the_worker() -> None:
    # no shard holds such a row: the lookup used to return the unset memory of its row
    runtime = WorkerRuntime([], secrets.token_urlsafe(32), num_workers=1, worker_index=0)
    remote = RemoteVariable("0/PSEmbedding.weight", (10, 3), torch.float32,
                            (Shard("0/PSEmbedding.weight/part_0", 0, 0, 10),), row_sparse=True)
    for bad in (10, -1):
        with pytest.raises(InvalidArgumentError, match=rf"embedding id {bad} is out of range for "
                           r"PSEmbedding.weight, which has 10 rows: ids must be in \[0, 10\)"):
            runtime.lookup(remote, torch.tensor([[1, bad], [2, 3]]))
    assert runtime.sparse == []
