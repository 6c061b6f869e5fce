"""Fences and leases on one ParameterServer, in process (the real-process scenarios are in
tests/ps/test_at_most_once.py)."""

from __future__ import annotations

import time

import pytest
import torch

from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer
from stratagem.ps.fencing import Fence, Fences, LeaseExpiredError, SupersededError


def fence(closure: int, attempt: int, index: int = 0, floor: int = 0, coordinator: str = "c") -> dict:
    return Fence(coordinator, closure, attempt, index, floor).as_dict()


@pytest.fixture
def ps() -> ParameterServer:
    server = ParameterServer(name="ps 0")
    server.create("w", torch.zeros(2), optimizer_spec=(torch.optim.SGD, {"lr": 1.0}))
    server.create("table", torch.zeros(4, 2), optimizer_spec=(torch.optim.SGD, {"lr": 1.0}))
    server.renew_lease("c", lease_s=30.0, sent_at=time.time())
    return server


def weight(ps: ParameterServer) -> list[float]:
    return ps.pull(["w"])["w"].tolist()


def test_a_second_attempt_skips_what_the_first_applied_and_applies_the_rest(ps) -> None:
    grad = {"w": -torch.ones(2)}
    ps.push(grad, rows=[("table", [1], -torch.ones(1, 2))], fence=fence(0, attempt=1))
    ps.push(grad, rows=[("table", [1], -torch.ones(1, 2))], fence=fence(0, attempt=2))
    assert weight(ps) == [1.0, 1.0]
    assert ps.pull(["table"])["table"][1].tolist() == [1.0, 1.0]
    # the second push of the same execution (a step that calls optimizer.step() twice) applies
    ps.push(grad, fence=fence(0, attempt=2, index=1))
    assert weight(ps) == [2.0, 2.0]
    # ... and the first attempt, resuming, is refused: a newer one has pushed
    with pytest.raises(SupersededError, match="superseded by attempt 2"):
        ps.push(grad, fence=fence(0, attempt=1, index=1))
    assert weight(ps) == [2.0, 2.0]
    assert ps.stats()["ops"]["push_refused"]["calls"] == 1
    assert ps.stats()["ops"]["push_skipped"]["calls"] == 1


def test_pushes_of_finished_closures_are_refused_and_their_records_dropped(ps) -> None:
    for closure in range(5):
        ps.push({"w": -torch.ones(2)}, fence=fence(closure, attempt=1, floor=0))
    assert ps.fences.stats()["c"]["closures"] == 5
    ps.push({"w": -torch.ones(2)}, fence=fence(9, attempt=1, floor=4))    # 0..3 have finished
    assert ps.fences.stats()["c"]["closures"] == 2
    with pytest.raises(SupersededError, match="has finished"):
        ps.push({"w": -torch.ones(2)}, fence=fence(2, attempt=2, floor=2))
    assert weight(ps) == [6.0, 6.0]


def test_unfenced_pushes_apply_without_a_lease() -> None:
    ps = ParameterServer()
    ps.create("w", torch.zeros(1), optimizer_spec=(torch.optim.SGD, {"lr": 1.0}))
    ps.push({"w": -torch.ones(1)})
    with pytest.raises(LeaseExpiredError, match="not renewed its lease"):
        ps.push({"w": -torch.ones(1)}, fence=fence(0, attempt=1))
    assert ps.pull(["w"])["w"].tolist() == [1.0]


def test_an_expired_or_ended_lease_refuses_fenced_pushes(ps) -> None:
    ps.renew_lease("d", lease_s=0.2, sent_at=time.time())
    ps.push({"w": -torch.ones(2)}, fence=fence(0, attempt=1, coordinator="d"))
    time.sleep(0.3)
    with pytest.raises(LeaseExpiredError, match="lease ran out"):
        ps.push({"w": -torch.ones(2)}, fence=fence(1, attempt=1, coordinator="d"))
    ps.expire_lease("c")
    with pytest.raises(LeaseExpiredError):
        ps.push({"w": -torch.ones(2)}, fence=fence(1, attempt=1))
    assert weight(ps) == [1.0, 1.0]


def test_a_renewal_that_arrives_late_does_not_extend_the_lease() -> None:
    fences = Fences()
    now = time.time()
    assert fences.renew("c", lease_s=4.0, sent_at=now)
    assert fences.renew("c", lease_s=4.0, sent_at=now + 0.001)
    # sent 5 s before it is processed (it waited in a socket while the ps was stopped)
    assert not fences.renew("c", lease_s=4.0, sent_at=time.time() - 5.0)
    assert 3.0 < fences.stats()["c"]["lease_left_s"] <= 4.0
    # a clock offset between the hosts is not lateness: only the change in delay counts
    other = Fences()
    assert other.renew("d", lease_s=4.0, sent_at=time.time() + 100.0)
    assert other.renew("d", lease_s=4.0, sent_at=time.time() + 100.0)
    assert other.stats()["d"]["lease_left_s"] > 3.9


def test_malformed_fences_are_refused_before_anything_applies(ps) -> None:
    for bad in ({"coordinator": "c"}, {**fence(0, 1), "attempt": 0}, {**fence(0, 1), "floor": 5}, "x"):
        with pytest.raises(InvalidArgumentError):
            ps.push({"w": -torch.ones(2)}, fence=bad)
    assert weight(ps) == [0.0, 0.0]
