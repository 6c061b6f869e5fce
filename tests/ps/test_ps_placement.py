"""ParameterServerStrategy's argument check and the placement's optimizer restore, in one
process: the parameter servers are RpcServers in this process, and no worker is needed."""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer
from stratagem.rpc import RemoteError, RpcServer

pytestmark = pytest.mark.timeout(60)

TOKEN = secrets.token_hex(16)


@pytest.mark.parametrize("resolver", ["worker:2222", sg.cluster.ClusterSpec({"worker": ["a:1"]})])
def test_strategy_needs_a_cluster_resolver(resolver: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        sg.ParameterServerStrategy(resolver)
    message = str(info.value)
    assert message.startswith("ParameterServerStrategy needs a cluster resolver (an object with a "
                              f"cluster_spec() method), got {resolver!r}; pass "
                              "sg.cluster.TFConfigClusterResolver()")


def test_strategy_without_a_resolver_reads_the_environments_cluster(monkeypatch) -> None:
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX", "SLURM_STEP_ID",
                 "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgumentError, match="needs 'ps' tasks in the cluster, but it has none"):
        sg.ParameterServerStrategy()   # no cluster described: sg.cluster.resolve() finds a lone task


class _Cluster:
    """Two in-process ps tasks whose ``pull`` can be made to fail (``broken_pull``)."""

    def __init__(self) -> None:
        self.broken_pull = False
        self.services = [ParameterServer(name=f"ps {i}") for i in range(2)]
        self.servers = [RpcServer("127.0.0.1:0", self._handlers(ps), TOKEN, name=ps.name).start()
                        for ps in self.services]

    def _handlers(self, ps: ParameterServer) -> dict:
        handlers = ps.handlers()
        pull = handlers["pull"]

        def maybe_broken_pull(request: object) -> object:
            if self.broken_pull:
                raise OSError(f"{ps.name} cannot read its variables")
            return pull(request)

        return {**handlers, "pull": maybe_broken_pull}

    def strategy(self) -> sg.ParameterServerStrategy:
        spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                "ps": [server.address for server in self.servers]}
        return sg.ParameterServerStrategy(sg.cluster.SimpleClusterResolver(spec))


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Cluster]:
    monkeypatch.setenv("STRATAGEM_CLUSTER_TOKEN", TOKEN)
    made = _Cluster()
    try:
        yield made
    finally:
        for server in made.servers:
            server.stop()


def _model_and_optimizer(strategy: sg.ParameterServerStrategy) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def test_optimizer_restore_onto_fresh_ps_keeps_the_coordinator_values(cluster: _Cluster) -> None:
    model, optimizer = _model_and_optimizer(cluster.strategy())
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    state = optimizer.state_dict()
    for ps in cluster.services:   # as if the ps tasks had restarted: nothing on them
        ps.delete(list(ps.variables()))
    optimizer.load_state_dict(state)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name])
    assert sum(len(ps.variables()) for ps in cluster.services) == 2   # written back


def test_optimizer_restore_pulls_what_the_ps_holds(cluster: _Cluster) -> None:
    model, optimizer = _model_and_optimizer(cluster.strategy())
    state = optimizer.state_dict()
    holder = next(ps for ps in cluster.services if any("weight" in v for v in ps.variables()))
    weight_id = next(v for v in holder.variables() if "weight" in v)
    holder.assign({weight_id: torch.full((2, 3), 7.0)})   # the ps moved on (workers' steps)
    optimizer.load_state_dict(state)
    torch.testing.assert_close(model.weight.detach(), torch.full((2, 3), 7.0))


def test_optimizer_restore_raises_when_the_pull_fails(cluster: _Cluster) -> None:
    _, optimizer = _model_and_optimizer(cluster.strategy())
    state = optimizer.state_dict()
    cluster.broken_pull = True   # the variables are there, but reading them fails
    with pytest.raises(RemoteError, match=r"'pull' on ps \d raised builtins.OSError: ps \d cannot read"):
        optimizer.load_state_dict(state)


def test_an_embedding_optimizer_without_a_row_rule_warns_once_at_the_users_line(cluster: _Cluster) -> None:
    strategy = cluster.strategy()
    with pytest.warns(UserWarning) as caught:
        with strategy.scope():
            model = nn.Sequential(nn.Embedding(20, 4), nn.Linear(4, 1))
            optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01)
        optimizer.add_param_group({"params": [], "lr": 0.1})   # attached again: no second warning
    [warning] = [w for w in caught if "row-sparse" in str(w.message)]
    assert str(warning.message).startswith(
        "RMSprop has no row-sparse update, so each step that looks up rows of the embedding table "
        "PSEmbedding.weight (shape (20, 4)) applies a dense RMSprop step to the whole table")
    assert warning.filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with strategy.scope():   # row rules: nothing to say
            other = nn.Embedding(20, 4)
            torch.optim.Adam(other.parameters(), lr=0.01)
            torch.optim.SparseAdam(nn.Embedding(5, 2).parameters())
        strategy.placement.finalize()
    optimizers = {v["optimizer"] for ps in cluster.services for v in ps.variables().values()}
    assert optimizers == {"RMSprop", "Adam", "SparseAdam"}


def test_a_checkpoint_restores_in_place_on_each_ps_even_a_fresh_one(cluster: _Cluster, tmp_path) -> None:
    """Same layout: every ps verifies, then loads its own files (a ps that lost its variables
    gets them back, with their optimizers); a corrupt shard file changes nothing anywhere."""
    strategy = cluster.strategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=1)

    def step() -> None:   # on the coordinator: the gradients go to the ps
        optimizer.zero_grad()
        model(torch.ones(2, 3)).pow(2).sum().backward()
        optimizer.step()

    step()
    path = ckpt.save(tmp_path / "c")
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_state = optimizer.state_dict()["state"]
    step()
    for ps in cluster.services:   # as if every ps had restarted
        ps.delete(list(ps.variables()))
    ckpt.restore(path)
    assert [ps.stats()["ops"]["load_shards"]["calls"] for ps in cluster.services] == [2, 2]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved_model[name], rtol=0, atol=0)
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(value, saved_state[index][key], rtol=0, atol=0)
    step()   # the optimizers are back on the ps: steps go on

    moved_on = {k: v.clone() for k, v in model.state_dict().items()}
    shard_file = tmp_path / "c" / "optimizer.ps1.pt"
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard_file.write_bytes(bytes(data))
    with pytest.raises(sg.errors.CheckpointError, match=r"c: optimizer\.ps1\.pt: its CRC-32 does not match"):
        ckpt.restore(path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, moved_on[name], rtol=0, atol=0)
