"""ParameterServer in-process and over RPC: reads, updates, locking, checkpoints, stats."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures

import pytest
import torch

from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer, ParameterServerClient, call_each
from stratagem.rpc import RemoteError, RpcServer

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_urlsafe(32)


class SlowIncrement(torch.optim.Optimizer):
    """Adds 1 to its parameter by read, sleep, write: concurrent steps would lose updates."""

    def __init__(self, params: object, pause: float = 0.002) -> None:
        super().__init__(params, {"pause": pause})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                value = param.clone()
                time.sleep(group["pause"])
                param.copy_(value + 1)


def _ps_with(var_id: str = "w", value: torch.Tensor | None = None, spec: object = None) -> ParameterServer:
    ps = ParameterServer(name="ps 0")
    ps.create(var_id, torch.zeros(3, 2) if value is None else value, spec)
    return ps


def test_push_applies_the_variable_optimizer_like_torch_optim() -> None:
    torch.manual_seed(0)
    init = torch.randn(5, 3)
    ps = _ps_with("w", init, (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}))
    reference = torch.nn.Parameter(init.clone())
    optimizer = torch.optim.Adam([reference], lr=0.01, weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(5, 3)
        ps.push({"w": grad})
        reference.grad = grad
        optimizer.step()
    torch.testing.assert_close(ps.pull(["w"])["w"], reference.detach(), rtol=0, atol=0)


def test_create_copies_the_value_and_pull_returns_copies() -> None:
    value = torch.zeros(4)
    ps = _ps_with("w", value, (torch.optim.SGD, {"lr": 1.0}))
    value.add_(5)
    pulled = ps.pull(["w"])["w"]
    pulled.add_(7)
    assert torch.equal(ps.pull(["w"])["w"], torch.zeros(4))


def test_pull_rows_assign_and_variables() -> None:
    ps = _ps_with("table", torch.arange(12.).reshape(6, 2))
    assert torch.equal(ps.pull_rows("table", [4, 0, 4]), torch.tensor([[8., 9.], [0., 1.], [8., 9.]]))
    ps.assign({"table": torch.ones(6, 2, dtype=torch.float64)})   # cast to the variable's dtype
    assert ps.pull(["table"])["table"].dtype == torch.float32
    assert ps.variables() == {"table": {"shape": (6, 2), "dtype": "torch.float32",
                                        "optimizer": None, "updates": 0}}


def test_bad_requests_name_the_problem() -> None:
    ps = _ps_with("w", torch.zeros(3, 2), (torch.optim.SGD, {"lr": 0.1}))
    ps.create("frozen", torch.zeros(2))
    cases = [
        (lambda: ps.pull(["nope"]), "has no variable 'nope'; it has 2: 'frozen', 'w'"),
        (lambda: ps.push({"w": torch.zeros(2, 3)}), r"must be a tensor of shape \(3, 2\), got shape \(2, 3\)"),
        (lambda: ps.push({"frozen": torch.zeros(2)}), "has no optimizer"),
        (lambda: ps.create("w", torch.zeros(1)), "already has a variable 'w'"),
        (lambda: ps.create("x", [1.0]), "must be a torch.Tensor"),
        (lambda: ps.create("x", torch.zeros(1), (torch.optim.SGD, {"lr": -1})), "cannot make SGD"),
        (lambda: ps.create("x", torch.zeros(1), torch.optim.SGD), "optimizer_spec must be"),
        (lambda: ps.create("x", torch.zeros(1, dtype=torch.int64), (torch.optim.SGD, {"lr": 1})),
         "only floating-point"),
        (lambda: ps.pull_rows("w", [0, 3]), "row id 3 is out of range for 'w', which has 3 rows"),
        (lambda: ps.pull_rows("w", torch.tensor([[0]])), "1-D integer tensor"),
        (lambda: ps.push_rows("w", [0], torch.zeros(2, 2)), r"row_grads must have shape \(1, 2\)"),
        (lambda: ps.set_hyperparameters(["w"], {"momentun": 0.9}), "no hyperparameter 'momentun'"),
        (lambda: ps.set_state({"w": {"val": 1}}), "must be a dict with 'value'"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            call()
    with pytest.raises(InvalidArgumentError):   # checked before anything is applied
        ps.push({"w": torch.ones(3, 2), "nope": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="row id 5 is out of range"):
        ps.push({"w": torch.ones(3, 2)}, rows=[("w", [0], torch.ones(1, 2)), ("w", [5], torch.ones(1, 2))])
    with pytest.raises(InvalidArgumentError, match="triples"):
        ps.push({"w": torch.ones(3, 2)}, rows=[("w", [0])])
    assert torch.equal(ps.pull(["w"])["w"], torch.zeros(3, 2))
    assert ps.variables()["w"]["updates"] == 0


def test_one_push_carries_dense_and_row_updates_like_separate_calls() -> None:
    spec = (torch.optim.Adagrad, {"lr": 0.1})
    combined, separate = (_ps_with("dense", torch.ones(2, 3), spec) for _ in range(2))
    for ps in (combined, separate):
        ps.create("table", torch.arange(12.0).reshape(6, 2), spec)
    dense_grad, rows, row_grads = torch.full((2, 3), 0.5), torch.tensor([4, 1]), torch.ones(2, 2)
    combined.push({"dense": dense_grad}, rows=[("table", rows, row_grads)])
    separate.push({"dense": dense_grad})
    separate.push_rows("table", rows, row_grads)
    for var_id in ("dense", "table"):
        assert torch.equal(combined.pull([var_id])[var_id], separate.pull([var_id])[var_id])
    assert combined.stats()["ops"]["push_rows"] == separate.stats()["ops"]["push_rows"]
    combined.push(rows=[("table", [0], torch.ones(1, 2))])   # rows alone
    assert combined.variables()["table"]["updates"] == 2


def test_concurrent_pushes_to_one_variable_are_serialised() -> None:
    ps = _ps_with("counter", torch.zeros(()), (SlowIncrement, {}))
    num_threads, pushes = 8, 25
    with futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(lambda _: [ps.push({"counter": torch.zeros(())}) for _ in range(pushes)],
                      range(num_threads)))
    assert ps.pull(["counter"])["counter"].item() == num_threads * pushes   # no update lost
    assert ps.variables()["counter"]["updates"] == num_threads * pushes


def test_concurrent_sgd_pushes_equal_sequential_application() -> None:
    ps = _ps_with("w", torch.zeros(64), (torch.optim.SGD, {"lr": 1.0}))
    grads = [torch.full((64,), float(i % 7)) for i in range(96)]
    with futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda g: ps.push({"w": g}), grads))
    sequential = torch.zeros(64)
    for grad in grads:
        sequential -= grad             # small integers: exact whatever the order
    assert torch.equal(ps.pull(["w"])["w"], sequential)
    assert ps.variables()["w"]["updates"] == 96


def test_different_variables_update_in_parallel() -> None:
    ps = ParameterServer()
    for var_id in ("a", "b"):
        ps.create(var_id, torch.zeros(()), (SlowIncrement, {"pause": 0.5}))
    started = time.monotonic()
    threads = [threading.Thread(target=ps.push, args=({var_id: torch.zeros(())},)) for var_id in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started < 0.9   # two 0.5 s steps overlapped (not 1 s in a row)
    assert ps.pull(["a", "b"]) == {"a": torch.tensor(1.0), "b": torch.tensor(1.0)}


def test_get_state_and_set_state_restore_values_and_optimizer_state() -> None:
    torch.manual_seed(1)
    ps = ParameterServer()
    ps.create("dense", torch.randn(4, 3), (torch.optim.Adam, {"lr": 0.05}))
    ps.create("table", torch.randn(10, 2), (torch.optim.Adagrad, {"lr": 0.1}))
    for _ in range(3):
        ps.push({"dense": torch.randn(4, 3)})
        ps.push_rows("table", torch.tensor([1, 7]), torch.randn(2, 2))
    ps.set_hyperparameters(["dense"], {"lr": 0.01})
    state = ps.get_state()
    fresh = ParameterServer()                       # e.g. a restarted ps
    fresh.set_state(state)
    also = ParameterServer()                        # existing variables are overwritten
    also.create("dense", torch.zeros(4, 3), (torch.optim.Adam, {"lr": 0.5}))
    also.set_state(state)
    assert fresh.get_state()["table"]["optimizer_state"]["state"][0]["row_step"].dtype == torch.int64
    grad, rows = torch.randn(4, 3), torch.randn(2, 2)
    for server in (ps, fresh, also):
        server.push({"dense": grad})
        server.push_rows("table", torch.tensor([7, 3]), rows)
    expected = ps.pull(["dense", "table"])
    for server in (fresh, also):
        got = server.pull(["dense", "table"])
        for var_id in expected:
            torch.testing.assert_close(got[var_id], expected[var_id], rtol=0, atol=0)
        assert server.get_state(["dense"])["dense"]["optimizer_state"]["param_groups"][0]["lr"] == 0.01
    state["dense"]["value"].add_(100)                # get_state returned copies
    assert not torch.equal(ps.pull(["dense"])["dense"], state["dense"]["value"])


def test_set_hyperparameters_changes_the_next_steps() -> None:
    ps = ParameterServer()
    for var_id in ("a", "b"):
        ps.create(var_id, torch.zeros(2), (torch.optim.SGD, {"lr": 1.0}))
    ps.set_hyperparameters(None, {"lr": 0.25})
    ps.push({"a": torch.ones(2), "b": torch.ones(2)})
    for value in ps.pull(["a", "b"]).values():
        assert torch.equal(value, torch.full((2,), -0.25))


def test_stats_count_tensor_bytes_and_embedding_traffic_scales_with_rows() -> None:
    ps = _ps_with("table", torch.zeros(10_000, 16), (torch.optim.SGD, {"lr": 0.1}))
    for rows in (8, 64):
        before = ps.stats()["ops"].get("pull_rows", {"bytes_out": 0})["bytes_out"]
        ids = torch.arange(rows)
        ps.pull_rows("table", ids)
        ps.push_rows("table", ids, torch.ones(rows, 16))
        assert ps.stats()["ops"]["pull_rows"]["bytes_out"] - before == rows * 16 * 4
    stats = ps.stats()
    assert stats["variable_bytes"] == 10_000 * 16 * 4 and stats["num_variables"] == 1
    assert stats["ops"]["push_rows"]["bytes_in"] == (8 + 64) * (16 * 4 + 8)
    assert ps.ping()["num_variables"] == 1


# ------------------------------------------------------------------------- over RPC


@pytest.fixture
def served():
    ps = ParameterServer(name="ps 0")
    with RpcServer("127.0.0.1:0", ps.handlers(), TOKEN, name="ps 0") as server:
        with ParameterServerClient(server.address, TOKEN, task="ps 0") as client:
            yield ps, client


def test_client_methods_reach_the_service(served: tuple[ParameterServer, ParameterServerClient]) -> None:
    ps, client = served
    client.call("create", var_id="w", value=torch.zeros(4, 2), optimizer_spec=(torch.optim.SGD, {"lr": 0.5}))
    client.call("push", grads={"w": torch.ones(4, 2)})
    client.call("push_rows", var_id="w", row_ids=torch.tensor([1, 1]), row_grads=torch.ones(2, 2))
    assert torch.equal(client.call("pull", var_ids=["w"])["w"], torch.tensor([[-.5, -.5], [-1.5, -1.5], [-.5, -.5], [-.5, -.5]]))
    assert torch.equal(client.call("pull_rows", var_id="w", row_ids=torch.tensor([1])), torch.tensor([[-1.5, -1.5]]))
    client.call("assign", values={"w": torch.zeros(4, 2)})
    client.call("set_hyperparameters", var_ids=["w"], values={"lr": 1.0})
    state = client.call("get_state")
    client.call("set_state", state=state)
    assert client.call("variables")["w"]["updates"] == 2
    assert client.call("ping")["name"] == "ps 0"
    assert client.call("stats")["ops"]["push"]["calls"] == 1
    assert client.rpc.call_async("pull", {"var_ids": ["w"]}).result(timeout=10)["w"].shape == (4, 2)
    client.call("delete", var_ids=["w"])
    assert ps.variables() == {}


def test_ps_errors_reach_the_client_as_remote_errors(served: tuple[ParameterServer, ParameterServerClient]) -> None:
    _, client = served
    with pytest.raises(RemoteError, match="ps 0 has no variable 'missing'") as info:
        client.call("pull", var_ids=["missing"])
    assert isinstance(info.value.remote_exception, InvalidArgumentError)
    with pytest.raises(RemoteError, match="dict of its keyword arguments"):
        client.rpc.call("pull", ["w"])


def test_concurrent_pushes_over_rpc_are_serialised(served: tuple[ParameterServer, ParameterServerClient]) -> None:
    ps, client = served
    ps.create("counter", torch.zeros(()), (SlowIncrement, {}))
    pending = [client.rpc.call_async("push", {"grads": {"counter": torch.zeros(())}}) for _ in range(60)]
    for future in pending:
        future.result(timeout=30)
    assert client.call("pull", var_ids=["counter"])["counter"].item() == 60


class SlowElementwise(torch.optim.Optimizer):
    """Adds 1 to one element at a time, pausing in between: a read during a step is torn."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                for index in range(param.numel()):
                    param.view(-1)[index] += 1
                    time.sleep(0.0005)


def test_pulls_over_rpc_are_whole_values_between_updates(
        served: tuple[ParameterServer, ParameterServerClient]) -> None:
    ps, client = served
    for var_id in ("a", "b"):
        ps.create(var_id, torch.zeros(8), (SlowElementwise, {}))
    stop = threading.Event()

    def pushing() -> None:
        while not stop.is_set():
            client.call("push", grads={"a": torch.zeros(8), "b": torch.zeros(8)})

    pushers = [threading.Thread(target=pushing) for _ in range(2)]
    for thread in pushers:
        thread.start()
    try:
        seen = []
        for order in (["a", "b"], ["b", "a"], ["a", "a", "b"]) * 10:   # both lock orders, repeats
            pulled = call_each([(client, "pull", {"var_ids": order})] * 2)
            for values in pulled:
                assert sorted(values) == ["a", "b"]
                for value in values.values():
                    assert torch.all(value == value[0]), f"torn read {value}"
                    seen.append(value[0].item())
    finally:
        stop.set()
        for thread in pushers:
            thread.join(timeout=30)
    assert max(seen) > 0   # the pulls really overlapped updates
    fresh = client.call("pull", var_ids=["a"])["a"]
    fresh.add_(100)   # an ordinary pull's tensors belong to the caller
    assert ps.pull(["a"])["a"].max() < 100


def test_call_each_returns_in_order_and_raises_the_first_error_after_all_finished() -> None:
    servers = [RpcServer("127.0.0.1:0", ParameterServer(name=f"ps {i}").handlers(), TOKEN).start()
               for i in range(3)]
    clients = [ParameterServerClient(s.address, TOKEN, task=f"ps {i}") for i, s in enumerate(servers)]
    try:
        assert call_each([]) == []
        call_each([(c, "create", {"var_id": "v", "value": torch.full((2,), float(i)),
                                  "optimizer_spec": (SlowIncrement, {"pause": 0.2})})
                   for i, c in enumerate(clients)])
        pulled = call_each([(c, "pull", {"var_ids": ["v"]}) for c in reversed(clients)])
        assert [p["v"][0].item() for p in pulled] == [2.0, 1.0, 0.0]
        started = time.monotonic()
        with pytest.raises(RemoteError, match="no variable 'missing'"):
            call_each([(clients[0], "push", {"grads": {"v": torch.zeros(2)}}),
                       (clients[1], "pull", {"var_ids": ["missing"]}),
                       (clients[2], "push", {"grads": {"v": torch.zeros(2)}})])
        assert time.monotonic() - started >= 0.2   # the slow pushes were waited for
        assert [c.call("pull", var_ids=["v"])["v"][0].item() for c in clients] == [1.0, 1.0, 3.0]   # both pushes ran
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()


def test_set_optimizer_attaches_a_fresh_optimizer_keeping_the_values() -> None:
    ps = _ps_with("w", torch.ones(3, 2))
    ps.create("steps", torch.zeros(2, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match="only floating-point"):
        ps.set_optimizer(["w", "steps"], (torch.optim.SGD, {"lr": 0.5}))
    with pytest.raises(InvalidArgumentError, match="no variable 'nope'"):
        ps.set_optimizer(["w", "nope"], (torch.optim.SGD, {"lr": 0.5}))
    assert ps.variables()["w"]["optimizer"] is None   # nothing changed by the refused calls
    ps.set_optimizer(["w"], (torch.optim.SGD, {"lr": 0.5}))
    ps.push({"w": torch.ones(3, 2)})
    assert torch.equal(ps.pull(["w"])["w"], torch.full((3, 2), 0.5))
    assert ps.get_state(["w"])["w"]["optimizer_spec"] == (torch.optim.SGD, {"lr": 0.5})
    ops = ps.stats()["ops"]
    assert ops["create"]["calls"] == 2 and not {"assign", "set_state"} & set(ops)   # values stayed
