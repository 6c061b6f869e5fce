"""Unit tests of stratagem.cluster: ClusterSpec, the resolvers and resolve().

No processes are started: every resolver reads an ``environment`` dict (or a monkeypatched
os.environ), so each rule and each error message is checked directly.
"""

from __future__ import annotations

import copy
import json
import pickle
import warnings

import pytest
import torch

from stratagem.cluster import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve,
)
from stratagem.errors import ClusterConfigError, InvalidArgumentError

FULL = {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222", "host3:2222"],
    "ps": ["host4:2222", "host5:2222"],
    "evaluator": ["host6:2222"],
}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


def tf_config(cluster: object, task: object = None, **extra: object) -> dict[str, str]:
    config: dict[str, object] = {"cluster": cluster, **extra}
    if task is not None:
        config["task"] = task
    return {"TF_CONFIG": json.dumps(config)}


def torchrun_env(rank: int = 0, world_size: int = 4, **extra: str) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % 2),
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    env.update(extra)
    return env


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("TF_CONFIG", *TORCHRUN_VARS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --------------------------------------------------------------------------- ClusterSpec


def test_spec_basic_queries() -> None:
    spec = ClusterSpec(FULL)
    assert spec.jobs == ["chief", "evaluator", "ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("chief") == 1
    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_address("worker", 2) == "host3:2222"
    assert spec.job_tasks("worker") == ["host1:2222", "host2:2222", "host3:2222"]
    assert spec.as_dict() == FULL
    assert bool(spec)


def test_spec_from_spec_and_tuples() -> None:
    spec = ClusterSpec({"worker": ("a:1", "b:2")})
    assert ClusterSpec(spec) == spec
    assert spec.as_dict() == {"worker": ["a:1", "b:2"]}


def test_spec_empty() -> None:
    assert not ClusterSpec()
    assert not ClusterSpec({})
    assert ClusterSpec().jobs == []
    assert ClusterSpec().as_dict() == {}
    assert ClusterSpec() == ClusterSpec({})


def test_spec_sparse_index_form() -> None:
    spec = ClusterSpec({"worker": {1: "b:2", 3: "d:4"}, "ps": ["p:1"]})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.job_tasks("worker") == [None, "b:2", None, "d:4"]
    assert spec.task_address("worker", 3) == "d:4"
    assert spec.as_dict() == {"ps": ["p:1"], "worker": {1: "b:2", 3: "d:4"}}


def test_spec_sparse_form_with_string_keys_as_in_json() -> None:
    assert ClusterSpec({"worker": {"1": "b:2"}}) == ClusterSpec({"worker": {1: "b:2"}})


def test_spec_dense_index_dict_is_a_list() -> None:
    spec = ClusterSpec({"worker": {1: "b:2", 0: "a:1"}})
    assert spec == ClusterSpec({"worker": ["a:1", "b:2"]})
    assert spec.as_dict() == {"worker": ["a:1", "b:2"]}


def test_spec_empty_job() -> None:
    spec = ClusterSpec({"ps": [], "worker": ["a:1"]})
    assert spec.num_tasks("ps") == 0
    assert spec.job_tasks("ps") == []
    assert spec.as_dict() == {"ps": [], "worker": ["a:1"]}


def test_spec_equality_and_hash() -> None:
    a = ClusterSpec({"worker": ["a:1", "b:2"], "ps": ["c:3"]})
    b = ClusterSpec({"ps": ["c:3"], "worker": ["a:1", "b:2"]})
    c = ClusterSpec({"worker": ["b:2", "a:1"], "ps": ["c:3"]})
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != {"worker": ["a:1", "b:2"], "ps": ["c:3"]}
    assert len({a, b, c}) == 2


def test_spec_is_immutable() -> None:
    source = {"worker": ["a:1"]}
    spec = ClusterSpec(source)
    source["worker"].append("b:2")
    spec.as_dict()["worker"].append("c:3")  # type: ignore[union-attr]
    assert spec.as_dict() == {"worker": ["a:1"]}
    with pytest.raises(AttributeError, match="immutable"):
        spec._jobs = {}  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        spec.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="immutable"):
        del spec._jobs


def test_spec_pickles_and_copies() -> None:
    spec = ClusterSpec({"worker": {0: "a:1", 2: "c:3"}, "chief": ["z:9"]})
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec
    assert copy.copy(spec) == spec


def test_spec_repr() -> None:
    assert repr(ClusterSpec({"worker": ["a:1"]})) == "ClusterSpec({'worker': ['a:1']})"


@pytest.mark.parametrize("address", [
    "localhost:2222", "10.0.0.2:1", "my-host.example.com:65535", "host_1:80",
    "[::1]:1234", "[2001:db8::1]:8080", "[fe80::1%eth0]:22",
])
def test_spec_accepts_addresses(address: str) -> None:
    assert ClusterSpec({"worker": [address]}).task_address("worker", 0) == address


@pytest.mark.parametrize("address, match", [
    ("localhost", r"'worker' task 0: expected 'host:port', got 'localhost'; add the host"),
    (":2222", r"expected 'host:port', got ':2222'"),
    ("host:", r"port '' in 'host:' is not an integer from 0 to 65535"),
    ("host:abc", r"port 'abc' in 'host:abc' is not an integer from 0 to 65535"),
    ("host:65536", r"port '65536' .* from 0 to 65535"),
    ("host:-1", r"port '-1' .* from 0 to 65535"),
    ("host:1.5", r"port '1.5'"),
    ("10.0.0.2:0", r"'worker' task 0: port 0 in '10.0.0.2:0' is not a real port .* give the port "
                   r"the task listens on"),
    ("[::1]:00", r"port 0 in '\[::1\]:00' is not a real port"),
    ("::1:1234", r"looks like an IPv6 address without brackets; .* '\[::1\]:1234'"),
    ("[::1]", r"expected '\[ipv6\]:port', got '\[::1\]'"),
    ("[::1:1234", r"expected '\[ipv6\]:port'"),
    ("[not-ipv6]:1", r"'not-ipv6' in '\[not-ipv6\]:1' is not an IPv6 address"),
    ("ho st:1", r"host 'ho st' in 'ho st:1' is not a host name"),
    ("grpc://host:1", r"'grpc://host:1' has a scheme; drop 'grpc://' and give just 'host:port'"),
    (1234, r"expected a 'host:port' string, got 1234 \(int\)"),
    (None, r"expected a 'host:port' string, got None"),
])
def test_spec_rejects_addresses(address: object, match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec({"worker": [address]})  # type: ignore[list-item]


def test_spec_rejects_duplicate_addresses() -> None:
    with pytest.raises(ClusterConfigError,
                       match=r"'a:1' is given to both 'chief' task 0 and 'worker' task 1; "
                             r"every task needs its own host:port"):
        ClusterSpec({"chief": ["a:1"], "worker": ["b:1", "a:1"]})
    with pytest.raises(ClusterConfigError, match="is given to both 'worker' task 0 and 'worker'"):
        ClusterSpec({"worker": ["Host:1", "host:1"]})


@pytest.mark.parametrize("first, second", [
    ("localhost:2222", "127.0.0.1:2222"),
    ("localhost:2222", "[::1]:2222"),
    ("127.0.0.1:2222", "[::1]:2222"),
    ("127.0.0.1:2222", "[::ffff:127.0.0.1]:2222"),
    ("[::1]:2222", "[0:0:0:0:0:0:0:1]:2222"),
    ("LocalHost.:2222", "localhost:2222"),
    ("[2001:db8::1]:8080", "[2001:DB8:0:0::1]:8080"),
    ("host:2222", "host:02222"),
])
def test_spec_rejects_one_address_spelled_two_ways(first: str, second: str) -> None:
    with pytest.raises(ClusterConfigError) as info:
        ClusterSpec({"ps": [first], "worker": [second]})
    assert str(info.value) == (
        f"address {second!r} is given to both 'ps' task 0 and 'worker' task 0 (as {first!r} and "
        f"{second!r}: two spellings of one host:port); every task needs its own host:port -- "
        "change the port of one of them.")


def test_spec_keeps_different_loopback_addresses_and_ports_apart() -> None:
    spec = ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.2:2222", "localhost:2223",
                                   "[::1]:2224", "host:2222", "10.0.0.1:2222"]})
    assert spec.num_tasks("worker") == 6


@pytest.mark.parametrize("job, match", [
    (1, r"job name 1 \(int\) is not valid; job names are strings"),
    ("", r"job name '' \(str\) is not valid"),
    ("my job", r"job name 'my job'"),
    ("0worker", r"starting with a letter"),
])
def test_spec_rejects_job_names(job: object, match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec({job: ["a:1"]})  # type: ignore[dict-item]


@pytest.mark.parametrize("tasks, match", [
    ("a:1", r"job 'worker': expected a list .* got 'a:1' \(str\); write \['a:1'\]"),
    (5, r"job 'worker': expected a list .* got 5 \(int\)"),
    ({-1: "a:1"}, r"task index -1 is not a non-negative integer"),
    ({"x": "a:1"}, r"task index 'x' is not a non-negative integer"),
    ({True: "a:1"}, r"task index True is not a non-negative integer"),
    ({1: "a:1", "1": "b:2"}, r"task 1 is given twice"),
])
def test_spec_rejects_task_lists(tasks: object, match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec({"worker": tasks})  # type: ignore[dict-item]


def test_spec_rejects_non_mapping() -> None:
    with pytest.raises(ClusterConfigError, match=r"a cluster must be a dict .* got list"):
        ClusterSpec(["a:1"])  # type: ignore[arg-type]


def test_spec_lookup_errors() -> None:
    spec = ClusterSpec({"worker": ["a:1", "b:2"]})
    with pytest.raises(InvalidArgumentError, match=r"no job 'ps' in this cluster; its jobs are \['worker'\]"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match=r"job 'worker' has no task 2; its task indices are \[0, 1\]"):
        spec.task_address("worker", 2)


def test_cluster_config_error_is_a_value_error() -> None:
    assert issubclass(ClusterConfigError, ValueError)


# ------------------------------------------------------------------ ClusterResolver base


def test_resolver_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        ClusterResolver()  # type: ignore[abstract]


def test_resolver_base_subclass_gets_the_collective_facts() -> None:
    class Fixed(ClusterResolver):
        def cluster_spec(self) -> ClusterSpec:
            return ClusterSpec({"worker": ["a:1", "b:2"]})

    resolver = Fixed(task_type="worker", task_id=1, rpc_layer="grpc")
    assert (resolver.num_workers, resolver.worker_rank, resolver.is_chief) == (2, 1, False)
    assert resolver.master() == "grpc://b:2"
    assert resolver.rpc_layer == "grpc"


# -------------------------------------------------------------- SimpleClusterResolver


def simple(task_type: str | None, task_id: int | None, cluster: object = FULL,
           **kwargs: object) -> SimpleClusterResolver:
    return SimpleClusterResolver(cluster, task_type=task_type, task_id=task_id,  # type: ignore[arg-type]
                                 **kwargs)  # type: ignore[arg-type]


def test_chief_is_rank_zero_and_worker_i_is_rank_i_plus_one() -> None:
    chief = simple("chief", 0)
    assert (chief.is_chief, chief.worker_rank, chief.num_workers) == (True, 0, 4)
    for index in range(3):
        worker = simple("worker", index)
        assert worker.worker_rank == index + 1
        assert not worker.is_chief
        assert worker.num_workers == 4
        assert worker.chief_address == "host0:2222"


def test_ps_and_evaluator_are_not_in_the_collective() -> None:
    for task_type, count in (("ps", 2), ("evaluator", 1)):
        for index in range(count):
            resolver = simple(task_type, index)
            assert resolver.worker_rank is None
            assert resolver.is_chief is False
            assert resolver.num_workers == 4
            assert resolver.chief_address == "host0:2222"


def test_worker_zero_is_chief_without_a_chief_job() -> None:
    cluster = {"worker": ["a:1", "b:2"], "ps": ["p:1"], "evaluator": ["e:1"]}
    first, second = simple("worker", 0, cluster), simple("worker", 1, cluster)
    assert (first.is_chief, first.worker_rank) == (True, 0)
    assert (second.is_chief, second.worker_rank) == (False, 1)
    assert first.num_workers == 2
    assert first.chief_address == second.chief_address == "a:1"


def test_chief_without_worker_job() -> None:
    resolver = simple("chief", 0, {"chief": ["c:1"], "ps": ["p:1"]})
    assert (resolver.is_chief, resolver.worker_rank, resolver.num_workers) == (True, 0, 1)


def test_sparse_workers_rank_in_index_order() -> None:
    cluster = {"worker": {1: "b:2", 3: "d:4"}}
    assert simple("worker", 1, cluster).worker_rank == 0
    assert simple("worker", 1, cluster).is_chief
    assert simple("worker", 3, cluster).worker_rank == 1
    assert simple("worker", 3, cluster).chief_address == "b:2"


def test_lone_local_task() -> None:
    resolver = SimpleClusterResolver(ClusterSpec())
    assert resolver.task_type is None and resolver.task_id is None
    assert (resolver.is_chief, resolver.worker_rank, resolver.num_workers) == (True, 0, 1)
    assert resolver.chief_address is None
    assert resolver.master() == ""
    assert resolver.rpc_layer is None


def test_observer_with_no_task_is_not_in_the_collective() -> None:
    resolver = SimpleClusterResolver(FULL)
    assert resolver.worker_rank is None and not resolver.is_chief
    assert resolver.num_workers == 4
    assert resolver.master() == ""


def test_master() -> None:
    resolver = simple("worker", 1, rpc_layer="grpc")
    assert resolver.master() == "grpc://host2:2222"
    assert resolver.master("ps", 1) == "grpc://host5:2222"
    assert resolver.master("ps", 1, rpc_layer="http") == "http://host5:2222"
    assert simple("worker", 1).master() == "host2:2222"
    with pytest.raises(ClusterConfigError, match=r"master\(\) got task_type='ps' and task_id=None; give both"):
        resolver.master("ps")
    with pytest.raises(ValueError, match="job 'ps' has no task 7"):
        resolver.master("ps", 7)


def test_simple_accepts_a_dict_and_keeps_the_spec() -> None:
    assert simple("worker", 0).cluster_spec() == ClusterSpec(FULL)


def test_simple_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        SimpleClusterResolver(FULL, "worker", 0)  # type: ignore[misc]


def test_num_accelerators_counts_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = simple("worker", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolver.num_accelerators() == {"GPU": 2}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolver.num_accelerators() == {}


def test_num_accelerators_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert simple("worker", 0, num_accelerators={"GPU": 2}).num_accelerators() == {"GPU": 2}
    assert simple("worker", 0, num_accelerators={"GPU": 0}).num_accelerators() == {}
    with pytest.raises(ClusterConfigError, match=r"num_accelerators must map a device kind to a count >= 0"):
        simple("worker", 0, num_accelerators={"GPU": -1})
    with pytest.raises(ClusterConfigError, match="num_accelerators"):
        simple("worker", 0, num_accelerators={"GPU": "2"})


def test_simple_allows_any_job_names() -> None:
    resolver = simple("localhost", 0, {"localhost": ["a:1"]})
    assert resolver.master() == "a:1"
    assert resolver.worker_rank is None and resolver.num_workers == 0


def test_evaluator_need_not_be_listed() -> None:
    resolver = simple("evaluator", 0, {"worker": ["a:1"]})
    assert resolver.worker_rank is None and resolver.num_workers == 1
    assert resolver.master() == ""


@pytest.mark.parametrize("task_type, task_id, cluster, match", [
    ("ps", 0, {"worker": ["a:1"]},
     r"SimpleClusterResolver: this task is a 'ps', but the cluster has no 'ps' job "
     r"\(its jobs are \['worker'\]\); add the 'ps' addresses"),
    ("worker", 2, {"worker": ["a:1", "b:2"]},
     r"task index 2 is out of range: job 'worker' has 2 tasks \(indices 0 to 1\)"),
    ("worker", 0, {"worker": {1: "b:2", 3: "d:4"}},
     r"task index 0 is out of range: job 'worker' has 2 tasks \(indices \[1, 3\]\)"),
    ("chief", 1, {"chief": ["a:1"]}, r"job 'chief' has 1 task \(indices 0 to 0\)"),
    ("worker", None, FULL, r"got task_type='worker' and task_id=None; give both"),
    (None, 0, FULL, r"got task_type=None and task_id=0; give both"),
    ("worker", "0", FULL, r"task index '0' is not a non-negative integer"),
    ("worker", True, FULL, r"task index True is not a non-negative integer"),
    ("worker", -1, FULL, r"task index -1 is not a non-negative integer"),
    (3, 0, FULL, r"task type 3 is not a string"),
    (None, None, {"chief": ["a:1", "b:2"]},
     r"the cluster has 2 chief tasks, but a cluster has at most one chief"),
])
def test_simple_rejects_tasks(task_type: object, task_id: object, cluster: object,
                              match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        simple(task_type, task_id, cluster)  # type: ignore[arg-type]


def test_resolver_repr() -> None:
    assert repr(simple("worker", 1)) == (
        "SimpleClusterResolver(task_type='worker', task_id=1, worker_rank=2, num_workers=4)")


# ------------------------------------------------------------- TFConfigClusterResolver


@pytest.mark.parametrize("task_type, count", [("chief", 1), ("worker", 3), ("ps", 2),
                                              ("evaluator", 1)])
def test_tf_config_every_task(task_type: str, count: int) -> None:
    for index in range(count):
        env = tf_config(FULL, {"type": task_type, "index": index})
        resolver = TFConfigClusterResolver(environment=env)
        assert (resolver.task_type, resolver.task_id) == (task_type, index)
        assert resolver.cluster_spec() == ClusterSpec(FULL)
        assert resolver.master() == FULL[task_type][index]
        assert resolver.num_workers == 4
        assert resolver.rpc_layer is None
        expected_rank = {"chief": 0, "worker": index + 1}.get(task_type)
        assert resolver.worker_rank == expected_rank
        assert resolver.is_chief == (task_type == "chief")


def test_tf_config_worker_zero_is_chief() -> None:
    cluster = {"worker": ["a:1", "b:2"], "ps": ["p:1"]}
    zero = TFConfigClusterResolver(environment=tf_config(cluster, {"type": "worker", "index": 0}))
    one = TFConfigClusterResolver(environment=tf_config(cluster, {"type": "worker", "index": 1}))
    assert zero.is_chief and not one.is_chief
    assert one.chief_address == "a:1"


def test_tf_config_chief_without_workers_is_fine() -> None:
    env = tf_config({"chief": ["c:1"]}, {"type": "chief", "index": 0})
    resolver = TFConfigClusterResolver(environment=env)
    assert resolver.is_chief and resolver.num_workers == 1


def test_tf_config_rpc_layer_and_extra_keys() -> None:
    env = tf_config({"worker": ["a:1"]}, {"type": "worker", "index": 0}, rpc_layer="grpc",
                    environment="cloud", job={"args": []})
    resolver = TFConfigClusterResolver(environment=env)
    assert resolver.rpc_layer == "grpc"
    assert resolver.master() == "grpc://a:1"
    assert TFConfigClusterResolver(environment=env, rpc_layer="http").master() == "http://a:1"


def test_tf_config_constructor_overrides_task() -> None:
    env = tf_config(FULL, {"type": "worker", "index": 0})
    assert TFConfigClusterResolver("ps", 1, environment=env).master() == "host5:2222"
    assert TFConfigClusterResolver(task_id=2, environment=env).master() == "host3:2222"
    assert TFConfigClusterResolver(task_type="chief", environment=env).task_id == 0
    no_task = tf_config(FULL)
    assert TFConfigClusterResolver("worker", 1, environment=no_task).worker_rank == 2


def test_tf_config_sparse_cluster_from_json() -> None:
    env = tf_config({"worker": {"1": "b:2", "0": "a:1"}}, {"type": "worker", "index": 1})
    resolver = TFConfigClusterResolver(environment=env)
    assert resolver.master() == "b:2"
    assert resolver.cluster_spec().as_dict() == {"worker": ["a:1", "b:2"]}


def test_tf_config_ipv6() -> None:
    env = tf_config({"worker": ["[::1]:1234", "[::1]:1235"]}, {"type": "worker", "index": 1})
    assert TFConfigClusterResolver(environment=env).chief_address == "[::1]:1234"


def test_tf_config_standalone_evaluator() -> None:
    env = tf_config({"chief": ["c:1"], "worker": ["a:1"]}, {"type": "evaluator", "index": 0})
    resolver = TFConfigClusterResolver(environment=env)
    assert resolver.worker_rank is None and resolver.num_workers == 2
    assert resolver.master() == ""


@pytest.mark.parametrize("env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "},
                                 {"TF_CONFIG": "{}"}, {"TF_CONFIG": '{"cluster": {}}'}])
def test_tf_config_absent_means_a_lone_local_task(env: dict[str, str]) -> None:
    resolver = TFConfigClusterResolver(environment=env)
    assert resolver.cluster_spec() == ClusterSpec()
    assert resolver.task_type is None and resolver.task_id is None
    assert (resolver.is_chief, resolver.worker_rank, resolver.num_workers) == (True, 0, 1)
    assert resolver.master() == ""


def test_tf_config_reads_os_environ(clean_environ: pytest.MonkeyPatch) -> None:
    clean_environ.setenv("TF_CONFIG", tf_config(FULL, {"type": "ps", "index": 1})["TF_CONFIG"])
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)


def test_tf_config_is_read_once() -> None:
    env = tf_config({"worker": ["a:1"]}, {"type": "worker", "index": 0})
    resolver = TFConfigClusterResolver(environment=env)
    env["TF_CONFIG"] = "not json"
    assert resolver.master() == "a:1"


def test_tf_config_bad_json_names_the_position() -> None:
    text = '{"cluster": {"worker": ["a:1",]}, "task": {"type": "worker", "index": 0}}'
    with pytest.raises(ClusterConfigError,
                       match=r"TF_CONFIG is not valid JSON: Expecting value at line 1, "
                             r"column 31 \(char 30\):\n .*\n +\^\nTF_CONFIG must be a JSON "
                             r"object such as .*no trailing commas") as info:
        TFConfigClusterResolver(environment={"TF_CONFIG": text})
    excerpt, caret = str(info.value).splitlines()[1:3]
    assert excerpt[caret.index("^")] == "]"


def test_tf_config_single_quotes() -> None:
    text = "{'cluster': {'worker': ['a:1']}}"
    with pytest.raises(ClusterConfigError, match=r"(?s)not valid JSON: .*line 1, column 2 .*double quotes"):
        TFConfigClusterResolver(environment={"TF_CONFIG": text})


def test_tf_config_bad_json_on_a_later_line() -> None:
    text = '{\n  "cluster": {"worker": ["a:1"]}\n  "task": {}\n}'
    with pytest.raises(ClusterConfigError, match=r"Expecting ',' delimiter at line 3, column 3"):
        TFConfigClusterResolver(environment={"TF_CONFIG": text})


@pytest.mark.parametrize("config, match", [
    (["a:1"], r"TF_CONFIG must be a JSON object, got a list"),
    ({"task": {"type": "worker", "index": 0}},
     r"TF_CONFIG has no \"cluster\": \['task'\] are its keys; add the addresses"),
    ({"cluster": {"worker": ["a:1"]}},
     r"TF_CONFIG has no \"task\": add \"task\": \{\"type\": \"worker\", \"index\": 0\}"),
    ({"cluster": {"worker": ["a:1"]}, "task": "worker"},
     r"TF_CONFIG: \"task\" must be an object like"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}},
     r"TF_CONFIG: \"task\" has no \"type\""),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}},
     r"TF_CONFIG: \"task\" has no \"index\""),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}},
     r"TF_CONFIG \"task\": unknown task type 'master'; the task types are 'chief', "
     r"'worker', 'ps', 'evaluator'"),
    ({"cluster": {"worker": ["a:1"], "master": ["m:1"]}, "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": unknown job 'master'; the jobs of a training cluster are "
     r"'chief', 'worker', 'ps', 'evaluator'"),
    ({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}},
     r"TF_CONFIG: task index 2 is out of range: job 'worker' has 2 tasks \(indices 0 to 1\)"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}},
     r"TF_CONFIG: this task is a 'ps', but the cluster has no 'ps' job"),
    ({"cluster": {"chief": ["a:1", "b:2"], "worker": ["c:3"]},
      "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG: the cluster has 2 chief tasks, but a cluster has at most one chief"),
    ({"cluster": {"ps": ["p:1"]}, "task": {"type": "ps", "index": 0}},
     r"TF_CONFIG \"cluster\" has no chief or worker \(its jobs are \['ps'\]\); .*add a "
     r"\"worker\" list"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}},
     r"TF_CONFIG: task index '0' is not a non-negative integer; write it like 0"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}},
     r"task index -1 is not a non-negative integer"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "rpc_layer": 1},
     r"TF_CONFIG: \"rpc_layer\" must be a string such as \"grpc\""),
    ({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": 'worker' task 0: expected 'host:port', got 'a'"),
    ({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": address 'a:1' is given to both"),
    ({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": a cluster must be a dict"),
    ({"cluster": {"worker": ["localhost:2222", "127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": address '127.0.0.1:2222' is given to both 'worker' task 0 and "
     r"'worker' task 1 \(as 'localhost:2222' and '127.0.0.1:2222': two spellings of one host:port\)"),
    ({"cluster": {"worker": ["localhost:0"]}, "task": {"type": "worker", "index": 0}},
     r"TF_CONFIG \"cluster\": 'worker' task 0: port 0 in 'localhost:0' is not a real port"),
])
def test_tf_config_errors(config: object, match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        TFConfigClusterResolver(environment={"TF_CONFIG": json.dumps(config)})


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    '{"cluster": {"worker": ' + "[" * 100_000 + "]" * 100_000 + "}}",
    '{"task": ' + '{"a": ' * 100_000 + "0" + "}" * 100_001,
], ids=["list", "cluster", "task"])
def test_tf_config_nested_too_deeply_is_a_config_error(text: str) -> None:
    with pytest.raises(ClusterConfigError, match=r"TF_CONFIG is nested too deeply to parse: .* "
                                                 r"TF_CONFIG is a shallow JSON object such as"):
        TFConfigClusterResolver(environment={"TF_CONFIG": text})


def test_tf_config_constructor_errors() -> None:
    with pytest.raises(ClusterConfigError,
                       match=r"TFConfigClusterResolver\(task_type=...\): unknown task type 'boss'"):
        TFConfigClusterResolver("boss", 0, environment=tf_config(FULL))
    with pytest.raises(ClusterConfigError, match=r"the cluster has no 'worker' job"):
        TFConfigClusterResolver("worker", 0, environment={})
    with pytest.raises(ClusterConfigError, match=r"TF_CONFIG has no \"task\""):
        TFConfigClusterResolver("worker", environment=tf_config(FULL))


# ------------------------------------------------------------- TorchrunClusterResolver


def test_torchrun_reads_the_variables() -> None:
    resolver = TorchrunClusterResolver(environment=torchrun_env(rank=3, world_size=4))
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert (resolver.worker_rank, resolver.num_workers) == (3, 4)
    assert (resolver.local_rank, resolver.local_world_size) == (1, 2)
    assert not resolver.is_chief
    assert resolver.chief_address == "10.0.0.1:29500"
    assert resolver.rpc_layer is None
    assert repr(resolver) == ("TorchrunClusterResolver(task_type='worker', task_id=3, "
                              "worker_rank=3, num_workers=4)")


def test_torchrun_rank_zero_is_chief() -> None:
    resolver = TorchrunClusterResolver(environment=torchrun_env(rank=0))
    assert resolver.is_chief and resolver.worker_rank == 0


def test_torchrun_master() -> None:
    resolver = TorchrunClusterResolver(environment=torchrun_env(rank=2))
    assert resolver.master() == "10.0.0.1:29500"
    assert resolver.master("worker", 0) == "10.0.0.1:29500"
    assert resolver.master(rpc_layer="tcp") == "tcp://10.0.0.1:29500"
    with pytest.raises(ClusterConfigError, match=r"torchrun knows only rank 0's address"):
        resolver.master("worker", 1)


def test_torchrun_has_no_cluster_spec() -> None:
    resolver = TorchrunClusterResolver(environment=torchrun_env(rank=1))
    with pytest.raises(ClusterConfigError,
                       match=r"torchrun does not publish the address of every worker: .*"
                             r"\(10\.0\.0\.1:29500\).*num_workers, worker_rank and "
                             r"chief_address.*TF_CONFIG"):
        resolver.cluster_spec()


def test_torchrun_minimal_single_process() -> None:
    resolver = TorchrunClusterResolver(environment={"RANK": "0", "WORLD_SIZE": "1"})
    assert (resolver.is_chief, resolver.num_workers, resolver.local_rank) == (True, 1, 0)
    assert resolver.local_world_size is None
    assert resolver.chief_address is None
    assert resolver.master() == ""


def test_torchrun_ipv6_master() -> None:
    env = torchrun_env(MASTER_ADDR="::1")
    assert TorchrunClusterResolver(environment=env).chief_address == "[::1]:29500"
    env = torchrun_env(MASTER_ADDR="[fe80::2]")
    assert TorchrunClusterResolver(environment=env).chief_address == "[fe80::2]:29500"


def test_torchrun_one_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = TorchrunClusterResolver(environment=torchrun_env(rank=1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolver.num_accelerators() == {"GPU": 1}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolver.num_accelerators() == {}


def test_torchrun_reads_os_environ(clean_environ: pytest.MonkeyPatch) -> None:
    for name, value in torchrun_env(rank=1, world_size=2).items():
        clean_environ.setenv(name, value)
    assert TorchrunClusterResolver().worker_rank == 1


def test_torchrun_environment_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        TorchrunClusterResolver(torchrun_env())  # type: ignore[misc]


def test_torchrun_pickles() -> None:
    resolver = pickle.loads(pickle.dumps(TorchrunClusterResolver(environment=torchrun_env(1))))
    assert (resolver.worker_rank, resolver.chief_address) == (1, "10.0.0.1:29500")


@pytest.mark.parametrize("changes, match", [
    ({"RANK": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4; ranks go from 0 to 3"),
    ({"RANK": "one"}, r"RANK='one' is not an integer"),
    ({"RANK": "-1"}, r"RANK=-1 must be >= 0"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "4.0"}, r"WORLD_SIZE='4.0' is not an integer"),
    ({"RANK": None}, r"RANK is not set, but WORLD_SIZE is; set both"),
    ({"WORLD_SIZE": None}, r"WORLD_SIZE is not set, but RANK is; set both"),
    ({"MASTER_ADDR": None},
     r"MASTER_ADDR is not set \(WORLD_SIZE=4\); every process needs MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_PORT": None}, r"MASTER_PORT is not set \(WORLD_SIZE=4\)"),
    ({"MASTER_PORT": "http"}, r"port 'http' in '10\.0\.0\.1:http' is not an integer"),
    ({"MASTER_PORT": "70000"}, r"port '70000' .* from 0 to 65535"),
    ({"MASTER_ADDR": "bad host"}, r"host 'bad host'"),
    ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2; local ranks go"),
    ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not an integer"),
    ({"LOCAL_WORLD_SIZE": "8"}, r"LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"),
    ({"LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE=0 must be >= 1"),
    ({"LOCAL_WORLD_SIZE": None, "LOCAL_RANK": "4"},
     r"LOCAL_RANK=4 is out of range for WORLD_SIZE=4"),
])
def test_torchrun_errors(changes: dict[str, str | None], match: str) -> None:
    env = torchrun_env(rank=1, world_size=4)
    for name, value in changes.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    with pytest.raises(ClusterConfigError, match=match):
        TorchrunClusterResolver(environment=env)


def test_torchrun_master_vars_needed_together_even_alone() -> None:
    with pytest.raises(ClusterConfigError, match="MASTER_PORT is not set"):
        TorchrunClusterResolver(environment={"RANK": "0", "WORLD_SIZE": "1",
                                             "MASTER_ADDR": "localhost"})


# ----------------------------------------------------------------------------- resolve()


def test_resolve_prefers_tf_config() -> None:
    env = tf_config({"worker": ["a:1", "b:2"]}, {"type": "worker", "index": 1})
    assert isinstance(resolve(env), TFConfigClusterResolver)
    env.update(torchrun_env(rank=1, world_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # they agree: no warning
        resolver = resolve(env)
    assert isinstance(resolver, TFConfigClusterResolver) and resolver.worker_rank == 1


def test_resolve_warns_when_tf_config_and_torchrun_disagree() -> None:
    env = {**torchrun_env(rank=0, world_size=4),
           **tf_config({"worker": ["a:1", "b:2"]}, {"type": "worker", "index": 1})}
    with pytest.warns(RuntimeWarning,
                      match=r"TF_CONFIG and torchrun's variables disagree: TF_CONFIG makes this "
                            r"task rank 1 of 2 workers, RANK=0 and WORLD_SIZE=4 .* Using TF_CONFIG"):
        resolver = resolve(env)
    assert isinstance(resolver, TFConfigClusterResolver) and resolver.worker_rank == 1


def test_resolve_torchrun() -> None:
    resolver = resolve(torchrun_env(rank=2))
    assert isinstance(resolver, TorchrunClusterResolver) and resolver.worker_rank == 2
    resolver = resolve({"TF_CONFIG": "{}", **torchrun_env(rank=2)})
    assert isinstance(resolver, TorchrunClusterResolver)


def test_resolve_lone_local_task() -> None:
    resolver = resolve({})
    assert isinstance(resolver, SimpleClusterResolver)
    assert resolver.cluster_spec() == ClusterSpec()
    assert (resolver.task_type, resolver.is_chief, resolver.num_workers) == (None, True, 1)


def test_resolve_half_set_torchrun_is_an_error() -> None:
    with pytest.raises(ClusterConfigError, match="WORLD_SIZE is not set, but RANK is"):
        resolve({"RANK": "0"})


def test_resolve_bad_tf_config_is_an_error_even_with_torchrun() -> None:
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not valid JSON"):
        resolve({"TF_CONFIG": "{", **torchrun_env()})


def test_resolve_reads_os_environ(clean_environ: pytest.MonkeyPatch) -> None:
    assert resolve().task_type is None
    for name, value in torchrun_env(rank=3).items():
        clean_environ.setenv(name, value)
    assert isinstance(resolve(), TorchrunClusterResolver)
    clean_environ.setenv("TF_CONFIG", tf_config(FULL, {"type": "chief", "index": 0})["TF_CONFIG"])
    with pytest.warns(RuntimeWarning, match="disagree"):
        assert resolve().task_type == "chief"


def test_resolvers_pickle() -> None:
    env = tf_config(FULL, {"type": "worker", "index": 2})
    resolver = pickle.loads(pickle.dumps(TFConfigClusterResolver(environment=env)))
    assert resolver.cluster_spec() == ClusterSpec(FULL) and resolver.worker_rank == 3
    simple_resolver = pickle.loads(pickle.dumps(simple("ps", 1)))
    assert simple_resolver.master() == "host5:2222"
