"""Who may change a parameter server, in process: claims, takeovers, fenced requests (the
real-process scenarios are in tests/ps/test_coordinator_takeover.py and
tests/ps/test_ps_takeover.py)."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer
from stratagem.ps.fencing import Fence
from stratagem.ps.ownership import CoordinatorConflictError, CoordinatorIdentity, FencedError
from stratagem.rpc import RemoteError, RpcServer

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_hex(16)


def identity(name: str, **fields: object) -> dict:
    return {**CoordinatorIdentity.current().as_dict(), "id": name, **fields}


@pytest.fixture
def ps() -> ParameterServer:
    return ParameterServer(name="ps 0")


def test_a_free_ps_takes_any_request_and_a_claimed_one_only_its_owners(ps) -> None:
    handlers = ps.handlers()
    handlers["create"]({"var_id": "w", "value": torch.zeros(2)})            # free: as in process
    assert handlers["claim"]({"identity": identity("a"), "lease_s": 10.0})["previous"] is None
    assert "w" in ps.variables()                                            # a fresh claim drops nothing
    handlers["set_optimizer"]({"var_ids": ["w"], "optimizer_spec": (torch.optim.SGD, {"lr": 1.0}),
                               "coordinator": "a"})
    handlers["push"]({"grads": {"w": -torch.ones(2)}, "coordinator": "a"})
    with pytest.raises(FencedError, match=r"ps 0 refused 'assign': it belongs to the coordinator of pid "
                                          r"\d+ .* \(this request names no coordinator\)"):
        handlers["assign"]({"values": {"w": torch.zeros(2)}})
    assert ps.pull(["w"])["w"].tolist() == [1.0, 1.0]
    assert ps.stats()["ops"]["assign_fenced"]["calls"] == 1
    assert ps.stats()["owner"]["owner"]["id"] == "a" and ps.stats()["owner"]["live"]


def test_a_takeover_drops_the_old_variables_and_fences_the_old_coordinator_out(ps) -> None:
    handlers = ps.handlers()
    handlers["claim"]({"identity": identity("a", pid=111, host="h1"), "lease_s": 10.0})
    handlers["create"]({"var_id": "0/w", "value": torch.zeros(2),
                        "optimizer_spec": (torch.optim.SGD, {"lr": 1.0}), "coordinator": "a"})
    handlers["renew_lease"]({"coordinator": "a", "lease_s": 10.0, "sent_at": time.time()})
    old_fence = Fence("a", closure=3, attempt=1, index=0, floor=3).as_dict()

    # a live owner is not taken over unless the claimant names it as gone
    with pytest.raises(CoordinatorConflictError, match="held by the coordinator of pid 111 on h1"):
        handlers["claim"]({"identity": identity("b"), "lease_s": 10.0})
    answer = handlers["claim"]({"identity": identity("b"), "lease_s": 10.0, "replaces": "a"})
    assert answer["previous"]["id"] == "a" and answer["dropped"] == 1 and ps.variables() == {}

    # the new one creates the same ids afresh; the old one's late push and renewals are refused
    handlers["create"]({"var_id": "0/w", "value": torch.zeros(2),
                        "optimizer_spec": (torch.optim.SGD, {"lr": 1.0}), "coordinator": "b"})
    with pytest.raises(FencedError, match=r"refused 'push' from an earlier coordinator, the coordinator of "
                                          r"pid 111 on h1 .*has taken the parameter servers over since"):
        handlers["push"]({"grads": {"0/w": -torch.ones(2)}, "fence": old_fence})
    with pytest.raises(FencedError):
        handlers["renew_lease"]({"coordinator": "a", "lease_s": 10.0, "sent_at": time.time()})
    with pytest.raises(FencedError, match="refused 'hold'"):
        handlers["hold"]({"identity": identity("a"), "lease_s": 10.0})
    assert ps.pull(["0/w"])["0/w"].tolist() == [0.0, 0.0]
    assert ps.stats()["ops"]["push_fenced"]["calls"] == 1 and "a" not in ps.fences.stats()


def test_a_released_or_expired_owner_is_taken_over_without_naming_it(ps) -> None:
    handlers = ps.handlers()
    handlers["claim"]({"identity": identity("a"), "lease_s": 10.0})
    handlers["release"]({"coordinator": "a"})
    assert handlers["claim"]({"identity": identity("b"), "lease_s": 0.2})["why"] == "it released it"
    time.sleep(0.3)   # b's lease runs out (it stopped renewing)
    assert handlers["claim"]({"identity": identity("c"), "lease_s": 10.0})["why"].startswith("its lease ran out")
    handlers["hold"]({"identity": identity("c"), "lease_s": 10.0})   # the owner's heartbeat
    assert handlers["owner"](None)["renewals"] == 2


def test_a_takeover_waits_for_a_request_in_flight_and_none_starts_during_it(ps) -> None:
    # a request checks the owner and applies under the gate's shared side: the old owner's
    # push in flight lands on its own variables, never on the new owner's of the same id
    handlers = ps.handlers()
    handlers["claim"]({"identity": identity("a"), "lease_s": 10.0})
    order = []
    with ps.ownership.shared():   # as a push of "a" being applied
        claimer = threading.Thread(target=lambda: order.append(
            handlers["claim"]({"identity": identity("b"), "lease_s": 10.0, "replaces": "a"})["ps"]))
        claimer.start()
        time.sleep(0.2)
        order.append("push applied")
    claimer.join(5)
    assert order == ["push applied", "ps 0"]


def test_malformed_claims_are_refused(ps) -> None:
    handlers = ps.handlers()
    with pytest.raises(InvalidArgumentError, match="a coordinator identity is a dict with an 'id'"):
        handlers["claim"]({"identity": {"pid": 1}, "lease_s": 10.0})
    with pytest.raises(InvalidArgumentError, match=r"an owner's lease is a number of seconds in \(0, 3600\]"):
        handlers["claim"]({"identity": identity("a"), "lease_s": 0})


@pytest.mark.multiprocess
def test_a_coordinator_on_this_host_is_gone_when_its_process_is() -> None:
    child = subprocess.Popen([sys.executable, "-c",
                              "import json; from stratagem.ps.ownership import CoordinatorIdentity as C; "
                              "print(json.dumps(C.current().as_dict()), flush=True); input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = CoordinatorIdentity.from_dict(__import__("json").loads(child.stdout.readline()))
    assert other.gone_here() is None                       # it runs
    child.stdin.close()
    child.wait(30)
    assert other.gone_here() == f"its process (pid {other.pid}) no longer exists"
    assert CoordinatorIdentity.current().gone_here() == (
        "it is an earlier ParameterServerStrategy of this same program")
    elsewhere = CoordinatorIdentity.from_dict({**other.as_dict(), "boot": "another-host"})
    assert elsewhere.gone_here() is None                   # only its lease can tell


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RpcServer]]:
    monkeypatch.setenv("STRATAGEM_CLUSTER_TOKEN", TOKEN)
    made = [RpcServer("127.0.0.1:0", ParameterServer(name=f"ps {i}").handlers(), TOKEN, name=f"ps {i}").start()
            for i in range(2)]
    yield made
    for server in made:
        server.stop()


def test_a_second_strategy_of_the_same_program_takes_over_at_once(servers) -> None:
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [s.address for s in servers]}
    first = sg.ParameterServerStrategy(sg.cluster.SimpleClusterResolver(spec))
    with first.scope():
        old = nn.Linear(2, 1)
        old_optimizer = torch.optim.SGD(old.parameters(), lr=0.1)
    started = time.monotonic()
    second = sg.ParameterServerStrategy(sg.cluster.SimpleClusterResolver(spec))   # a re-run cell
    assert time.monotonic() - started < 5
    assert all("an earlier ParameterServerStrategy of this same program" in line
               for line in second.cluster.tenure.took_over) and len(second.cluster.tenure.took_over) == 2
    with second.scope():
        new = nn.Linear(2, 1)   # the same variable ids as the old model's
    old(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RemoteError, match="refused 'push' from an earlier coordinator") as info:
        old_optimizer.step()   # the first strategy's requests are fenced out
    assert isinstance(info.value.remote_exception, FencedError)
    assert new.weight.shape == (1, 2)
    deadline = time.monotonic() + 10   # its next renewal is refused: its tenure fails, naming the second
    while first.cluster.tenure.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"id {second.cluster.tenure.id})" in str(first.cluster.tenure.failure)
    second.cluster.tenure.release()
    first.cluster.tenure.release()
