"""A worker's ps traffic (stratagem/ps/traffic.py): the bytes its client sends and receives are what
its variables' sizes predict, counted per closure. No timing is checked, only that time is counted."""

from __future__ import annotations

import secrets

import pytest
import torch
from torch import nn

from stratagem.ps import ParameterServer
from stratagem.ps.runtime import WorkerOptimizer, WorkerRuntime
from stratagem.ps.traffic import PsTraffic, WorkerTraffic, tensor_bytes
from stratagem.ps.variables import RemoteVariable, Shard
from stratagem.rpc import RpcServer

pytestmark = pytest.mark.timeout(120)
TOKEN = secrets.token_urlsafe(32)


def test_tensor_bytes_counts_nested_tensors_only() -> None:
    request = {"grads": {"w": torch.zeros(4, 2)}, "rows": [("e", torch.tensor([1, 2]), torch.zeros(2, 3))],
               "fence": {"index": 0}, "pull": ["w"]}
    assert tensor_bytes(request) == 32 + 16 + 24
    assert tensor_bytes(None) == 0 and tensor_bytes(torch.zeros(3, dtype=torch.float64)) == 24


def test_overlapping_calls_count_their_time_once() -> None:
    traffic = PsTraffic()
    traffic.begin({})
    traffic.begin({})
    traffic.end(None)
    assert traffic.take()["seconds"] == 0   # one call still in flight: its time is not over
    traffic.end(None)
    counts = traffic.take()
    assert counts["calls"] == 0 and counts["seconds"] >= 0


def test_a_workers_steps_pull_and_push_what_its_variables_weigh() -> None:
    """nn.Linear(8, 4) with its weight on ps 0 and its bias on ps 1: 128 + 16 bytes. Each step pushes
    them once; it pulls them once too (the push's reply brings the next step's values), except the
    first step, which pulls before the push brings them."""
    servers = [RpcServer("127.0.0.1:0", ParameterServer(name=f"ps {i}").handlers(), TOKEN, name=f"ps {i}").start()
               for i in range(2)]
    runtime = WorkerRuntime([s.address for s in servers], TOKEN, num_workers=1, worker_index=0)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        var_ids = []
        for ps, (name, tensor) in enumerate(list(model._parameters.items())):
            runtime.ps[ps].call("create", var_id=name, value=tensor.detach().clone(),
                                optimizer_spec=(torch.optim.SGD, {"lr": 0.1}))
            shards = (Shard(name, ps, 0, tensor.shape[0]),)
            model._parameters[name] = runtime.local_parameter(
                RemoteVariable(name, tuple(tensor.shape), tensor.dtype, shards), True)
            var_ids.append(name)
        optimizer = WorkerOptimizer(runtime, var_ids)
        runtime.traffic.take()   # (the variables' creation is not a step)
        totals = WorkerTraffic()
        steps = []
        for _ in range(4):
            runtime.pull_dense(var_ids, writes=0)
            runtime.begin_closure(None)
            optimizer.zero_grad()
            model(torch.ones(2, 8)).pow(2).mean().backward()
            optimizer.step()
            steps.append(runtime.traffic.take())
            totals.add(0, steps[-1])
    finally:
        runtime.traffic.take()
        for server in servers:
            server.stop()
    weight = (8 * 4 + 4) * 4
    assert [(s["pulled"], s["pushed"], s["calls"]) for s in steps] == \
        [(2 * weight, weight, 4)] + [(weight, weight, 2)] * 3
    assert all(s["seconds"] > 0 for s in steps)
    per_step = WorkerTraffic.per_step({}, totals.totals())
    assert list(per_step) == [0]
    assert per_step[0]["ps_pull_bytes"] == 5 * weight / 4 and per_step[0]["ps_push_bytes"] == weight
    assert WorkerTraffic.per_step(totals.totals(), totals.totals()) == {}   # no step since: no scalars
