"""A worker's next step starts from the values its push brought back (stratagem/ps/runtime.py,
"Prefetch"): the same training as pulling before every step, one round trip fewer, and never
older than the coordinator's last write."""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stratagem.ps import ParameterServer
from stratagem.ps.runtime import WorkerOptimizer, WorkerRuntime
from stratagem.ps.variables import RemoteVariable, Shard
from stratagem.rpc import RpcServer

pytestmark = pytest.mark.timeout(120)
TOKEN = secrets.token_urlsafe(32)


def _worker(num_ps: int) -> tuple[list[RpcServer], WorkerRuntime, nn.Module, WorkerOptimizer, list[str]]:
    """An MLP whose variables live on ``num_ps`` in-process parameter servers (each split in
    rows over them), and a worker's copies of them."""
    servers = [RpcServer("127.0.0.1:0", ParameterServer(name=f"ps {i}").handlers(), TOKEN, name=f"ps {i}").start()
               for i in range(num_ps)]
    runtime = WorkerRuntime([s.address for s in servers], TOKEN, num_workers=1, worker_index=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    var_ids = []
    for i, module in enumerate(model):
        for name, tensor in list(module._parameters.items()):
            var_id, rows = f"{i}.{name}", tensor.shape[0]
            cut = [0, *([rows // 2] if num_ps > 1 else []), rows]
            shards = tuple(Shard(f"{var_id}/{j}", j, a, b) for j, (a, b) in enumerate(zip(cut, cut[1:])))
            for shard in shards:
                runtime.ps[shard.ps].call("create", var_id=shard.shard_id, value=shard.of(tensor.detach()).clone(),
                                          optimizer_spec=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
            module._parameters[name] = runtime.local_parameter(
                RemoteVariable(var_id, tuple(tensor.shape), tensor.dtype, shards), True)
            var_ids.append(var_id)
    return servers, runtime, model, WorkerOptimizer(runtime, var_ids), var_ids


def _train(num_ps: int, steps: int, writes: int | None) -> tuple[list[float], dict[str, int], list[torch.Tensor]]:
    servers, runtime, model, optimizer, var_ids = _worker(num_ps)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            runtime.pull_dense(var_ids, writes=writes)
            runtime.begin_closure(None)
            x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        pulls = sum(s.stats()["methods"].get("pull", {}).get("calls", 0) for s in servers)
        runtime.pull_dense(var_ids)
        return losses, {"pulls": pulls}, [p.detach().clone() for p in model.parameters()]
    finally:
        for client in runtime.ps:
            client.close()
        for server in servers:
            server.stop()


@pytest.mark.parametrize("num_ps", [1, 2])
def test_prefetched_steps_train_exactly_as_pulled_ones_with_one_pull_in_all(num_ps: int) -> None:
    pulled, counts, final = _train(num_ps, 12, writes=None)
    prefetched, counts_prefetched, final_prefetched = _train(num_ps, 12, writes=0)
    assert prefetched == pulled      # bit for bit: a one-worker run is deterministic
    for a, b in zip(final, final_prefetched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counts["pulls"] == 12 * num_ps and counts_prefetched["pulls"] == num_ps   # the first step's only


def test_a_coordinator_write_since_the_push_makes_the_next_step_pull() -> None:
    servers, runtime, model, optimizer, var_ids = _worker(1)
    try:
        runtime.pull_dense(var_ids, writes=0)
        runtime.begin_closure(None)
        optimizer.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        optimizer.step()                                    # brings back the values after it
        runtime.ps[0].call("assign", values={"2.bias/0": torch.full((3,), 7.0)})   # the coordinator writes
        runtime.pull_dense(var_ids, writes=1)               # ... and says so with the next closure
        assert model[2].bias.tolist() == [7.0, 7.0, 7.0]
        assert servers[0].stats()["methods"]["pull"]["calls"] == 2
    finally:
        runtime.ps[0].close()
        servers[0].stop()
