"""What stratagem keeps on torch objects: one declared record each (stratagem._record), in one
attribute, and nothing else; the record stays behind when a scoped model is copied or saved."""

from __future__ import annotations

import copy
import io
import pickle
import re
import secrets
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem._record import ATTRIBUTE, Record, attach, record_of

pytestmark = pytest.mark.timeout(120)
PACKAGE = Path(sg.__file__).parent

STRATEGIES = {
    "mirrored": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "zero_optimizer": lambda: sg.MultiWorkerMirroredStrategy(sharding="optimizer"),
    "zero_gradients": lambda: sg.MultiWorkerMirroredStrategy(sharding="gradients"),
}


def _ours(obj: object) -> list[str]:
    """The attributes of ``obj`` that stratagem set (its record, or any loose one of old)."""
    return [key for key in vars(obj) if key == ATTRIBUTE or key.startswith("_sg_")]


def _trained(kind: str) -> tuple:
    strategy = STRATEGIES[kind]()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu") if kind == "mirrored" else None

    def step(x):
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(model(x).pow(2).sum(1))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    strategy.run(step, args=(torch.randn(8, 3),))
    optimizer.state_dict()
    return strategy, model, optimizer, scaler


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_a_step_leaves_one_typed_record_and_no_loose_attribute(kind: str) -> None:
    strategy, model, optimizer, scaler = _trained(kind)
    mine = vars(optimizer)[ATTRIBUTE]
    assert isinstance(mine, Record) and not hasattr(mine, "__dict__")   # declared fields only (slots)
    assert mine.placement is strategy.placement and mine.base is torch.optim.SGD
    assert type(optimizer).__name__.endswith("SGD") and type(optimizer) is not torch.optim.SGD
    twins = mine.twins or [optimizer]
    assert twins[0] is optimizer and len(twins) == (2 if kind == "mirrored" else 1)
    for twin in twins[1:]:   # a twin has its own record: the placement's, and no twins
        assert type(twin) is torch.optim.SGD and vars(twin)[ATTRIBUTE] is not mine
        assert record_of(twin).placement is strategy.placement and record_of(twin).twins is None
    if kind.startswith("zero"):
        assert mine.sharded is not None and mine.zero is not None and mine.gathered_state is None
    if scaler is not None:
        kept = vars(scaler)[ATTRIBUTE]
        assert kept.placement is strategy.placement and len(kept.scaler_states) == 2
    objects = [*model.modules(), *model.parameters(), *model.buffers(), *twins]
    objects += [] if scaler is None else [scaler]
    for obj in objects:
        assert _ours(obj) in ([], [ATTRIBUTE]), (type(obj).__name__, _ours(obj))
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        assert record_of(obj) is None, type(obj).__name__   # modules and their tensors carry nothing
    sharded = mine.sharded
    for range_optimizer in getattr(sharded, "optimizers", None) or []:   # stratagem's own, never adopted
        assert range_optimizer is None or record_of(range_optimizer) is None


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_a_scoped_model_are_plain(how: str) -> None:
    _, model, _, _ = _trained("mirrored")
    copied = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
              "torch.save": _saved_and_loaded}[how](model)
    for obj in [*copied.modules(), *copied.parameters(), *copied.buffers()]:
        assert _ours(obj) == [], (type(obj).__name__, _ours(obj))
    for tensor in copied.state_dict().values():
        assert _ours(tensor) == []


def test_scoped_optimizers_and_scalers_still_refuse_to_be_copied() -> None:
    _, _, optimizer, scaler = _trained("mirrored")
    for obj in (optimizer, scaler):
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
            copy.deepcopy(obj)
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
            pickle.dumps(obj)


def test_parameter_server_variables_keep_where_they_live_in_the_record() -> None:
    from stratagem.ps.embedding import embedding_lookup
    from stratagem.ps.runtime import WorkerRuntime
    from stratagem.ps.variables import RemoteVariable, Shard, ShardedVariable, remote_of

    remote = RemoteVariable("w", (3, 2), torch.float32, (Shard("w/0", 0, 0, 2), Shard("w/1", 1, 2, 3)))
    sharded = ShardedVariable(torch.arange(6.).reshape(3, 2), remote)
    assert _ours(sharded) == [ATTRIBUTE] and remote_of(sharded) is remote and sharded.num_shards == 2
    plain = pickle.loads(pickle.dumps(sharded))   # pickles as a plain parameter, without the record
    assert type(plain) is nn.Parameter and _ours(plain) == [] and remote_of(plain) is None

    runtime = WorkerRuntime([], secrets.token_urlsafe(32), num_workers=1, worker_index=0)
    table = RemoteVariable("t", (4, 2), torch.float32, (Shard("t/0", 0, 0, 4),), row_sparse=True)
    dense = RemoteVariable("d", (2,), torch.float32, (Shard("d/0", 0, 0, 2),))
    local_table, local_dense = runtime.local_parameter(table, True), runtime.local_parameter(dense, False)
    assert record_of(local_table).remote is table and record_of(local_table).runtime is runtime
    assert record_of(local_dense).remote is dense and record_of(local_dense).runtime is None
    assert _ours(local_table) == [ATTRIBUTE] and _ours(local_dense) == [ATTRIBUTE]
    ids = torch.tensor([1, 0])   # a table without a runtime is an ordinary lookup
    assert torch.equal(embedding_lookup(torch.arange(8.).reshape(4, 2), ids), torch.tensor([[2., 3.], [0., 1.]]))


def test_attach_makes_one_record_and_updates_it() -> None:
    t = torch.zeros(1)
    assert record_of(t) is None and record_of(3) is None   # (an object without __dict__: nothing)
    first = attach(t, remote="a")
    assert attach(t, runtime="b") is first and (first.remote, first.runtime) == ("a", "b")
    assert list(vars(t)) == [ATTRIBUTE]
    with pytest.raises(AttributeError):
        attach(t, not_a_field=1)   # the fields are declared: a typo is an error, not a new attribute


def test_the_package_sets_no_loose_attribute_on_torch_objects() -> None:
    """No ``_sg_*`` name anywhere in the package, and the record's attribute is spelled in
    :mod:`stratagem._record` only (everyone else goes through its functions)."""
    loose, spelled = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
            if re.search(r"\b_sg_\w+", line):
                loose.append(where)
            if re.search(rf"[\"']{ATTRIBUTE}[\"']", line) and path.name != "_record.py":
                spelled.append(where)
    assert not loose, "loose attributes; keep them in stratagem._record.Record:\n" + "\n".join(loose)
    assert not spelled, "the record's attribute spelled outside stratagem/_record.py:\n" + "\n".join(spelled)
