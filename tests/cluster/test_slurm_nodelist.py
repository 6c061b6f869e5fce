"""Slurm's compact forms as pure functions, and SlurmClusterResolver on Slurm's variables.

No Slurm and no processes: node lists, tasks per node and task placement are checked on the
forms Slurm documents; the resolver, resolve() and the strategies read ``environment`` dicts
(or a monkeypatched os.environ) exactly as srun sets them. test_slurm_real.py runs a real Slurm.
"""

from __future__ import annotations

import json
import warnings

import pytest

import stratagem as sg
from stratagem.cluster import SlurmClusterResolver, resolve
from stratagem.cluster.nodelist import expand_nodelist, expand_tasks_per_node, place_tasks
from stratagem.cluster.slurm import in_slurm_step, parse_jobs
from stratagem.errors import ClusterConfigError


def step_env(procid: int, nodelist: str = "node[01-02]", tasks_per_node: str = "2(x2)",
             num_tasks: int | None = None, **extra: str) -> dict[str, str]:
    """The variables srun gives task ``procid`` of a step (SLURMD_NODENAME/LOCALID left out)."""
    total = sum(expand_tasks_per_node(tasks_per_node)) if num_tasks is None else num_tasks
    env = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
           "SLURM_STEP_NUM_TASKS": str(total), "SLURM_NTASKS": str(total),
           "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_TASKS_PER_NODE": tasks_per_node}
    env.update(extra)
    return env


# --------------------------------------------------------------------------- node lists


@pytest.mark.parametrize("text, nodes", [
    ("tux", ["tux"]),
    ("lx[10-13]", ["lx10", "lx11", "lx12", "lx13"]),
    ("tux[00-03]", ["tux00", "tux01", "tux02", "tux03"]),                 # padded
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("lx[15,18,32-33]", ["lx15", "lx18", "lx32", "lx33"]),
    ("node[8-10]", ["node8", "node9", "node10"]),                         # not padded: width grows
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),     # padded to the first number
    ("alpha,beta,gamma", ["alpha", "beta", "gamma"]),
    ("login,gpu[1-2],cpu07", ["login", "gpu1", "gpu2", "cpu07"]),       # plain names and brackets
    ("a[1-2],b[5,7-8]", ["a1", "a2", "b5", "b7", "b8"]),                # several bracketed names
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("n[1-2]x", ["n1x", "n2x"]),                                        # a suffix after brackets
    ("gpu-node-1.cluster.local,gpu_2", ["gpu-node-1.cluster.local", "gpu_2"]),
    ("  node[1-2]\n", ["node1", "node2"]),
])
def test_node_lists_expand_as_slurm_writes_them(text: str, nodes: list[str]) -> None:
    assert expand_nodelist(text) == nodes


@pytest.mark.parametrize("text, problem", [
    ("", "is empty"),
    ("node[1-4", "a '[' is never closed"),
    ("node1-4]", "a ']' without its '['"),
    ("node[[1-2]]", "brackets do not nest"),
    ("node[a-c]", "'a-c' inside brackets is not a number"),
    ("node[1-2-3]", "'1-2-3' inside brackets is not a number"),
    ("node[4-1]", "the range '4-1' runs backwards"),
    ("node[]", "empty brackets"),
    ("node[1,,3]", "an empty range"),
    ("node[1,]", "an empty range"),
    ("a,,b", "an empty node name"),
    ("a,", "an empty node name"),
    ("node 1", "' ' in 'node 1' cannot be part of a node name"),
    ("node1,node[1-2]", "names node 'node1' twice"),
    ("n[0-9999999]", "names more than"),
])
def test_malformed_node_lists_name_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ClusterConfigError, match="node list") as caught:
        expand_nodelist(text)
    assert problem in str(caught.value)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1(x1)", [1]),
    ("16(x2),8,4(x3)", [16, 16, 8, 4, 4, 4]),
])
def test_tasks_per_node_expand(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text, problem", [
    ("", "is empty"), ("x", "'x' is not a count"), ("2(3)", "'2(3)' is not a count"),
    ("-1", "'-1' is not a count"), ("2,,1", "'' is not a count"), ("2(x0)", "repeats its count 0 times"),
    ("2,0,1", "'0' gives node 2 of the node list no task"), ("1,0(x2)", "'0(x2)' gives node 2 of the node list no task"),
])
def test_malformed_tasks_per_node_name_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ClusterConfigError, match="tasks per node") as caught:
        expand_tasks_per_node(text)
    assert problem in str(caught.value)


@pytest.mark.parametrize("distribution, placed", [
    (None, [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]),
    ("block", [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]),
    ("block:cyclic", [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]),
    ("cyclic", [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]),
    ("cyclic:block", [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]),
    ("plane=2", [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("a", 2)]),
])
def test_ranks_are_placed_as_slurm_distributes_them(distribution: str | None, placed: list) -> None:
    assert place_tasks(["a", "b", "c"], [3, 1, 2], distribution) == placed


def test_placement_refuses_what_it_cannot_know() -> None:
    with pytest.raises(ClusterConfigError, match="SLURM_DISTRIBUTION='arbitrary'.*--distribution=block"):
        place_tasks(["a", "b"], [1, 1], "arbitrary")
    with pytest.raises(ClusterConfigError, match=r"names 2 nodes \(a, b\) but tasks per node gives 3"):
        place_tasks(["a", "b"], [1, 1, 1])


def test_jobs_text() -> None:
    assert parse_jobs("chief=1, worker=2,ps=1") == {"chief": 1, "worker": 2, "ps": 1}
    for text, problem in (("worker", "'worker' is not 'job=count'"), ("worker=two", "not 'job=count'"),
                          ("worker=1,worker=2", "names job 'worker' twice")):
        with pytest.raises(ClusterConfigError, match="STRATAGEM_SLURM_JOBS") as caught:
            parse_jobs(text)
        assert problem in str(caught.value)


# --------------------------------------------------------------------------- the resolver


def test_every_task_is_a_worker_by_default_with_a_port_per_task_on_its_node() -> None:
    resolvers = [SlurmClusterResolver(environment=step_env(r, "node[01-02]", "2,1")) for r in range(3)]
    assert resolvers[0].cluster_spec().as_dict() == {
        "worker": ["node01:8888", "node01:8889", "node02:8888"]}
    assert [(r.task_type, r.task_id, r.worker_rank) for r in resolvers] == [
        ("worker", 0, 0), ("worker", 1, 1), ("worker", 2, 2)]
    assert [(r.local_rank, r.local_world_size) for r in resolvers] == [(0, 2), (1, 2), (0, 1)]
    assert resolvers[2].is_chief is False and resolvers[0].is_chief
    assert resolvers[2].chief_address == "node01:8888"
    assert resolvers[2].master() == "grpc://node02:8888"       # TensorFlow's rpc_layer
    assert resolvers[2].get_task_info() == ("worker", 2)
    assert resolvers[2].num_accelerators() == {}


def test_jobs_take_the_ranks_in_the_order_of_their_names() -> None:
    env = step_env(0, "node[1-2]", "2,1")
    resolver = SlurmClusterResolver(jobs={"worker": 2, "ps": 1}, environment=env)   # TensorFlow's example
    assert resolver.cluster_spec().as_dict() == {"ps": ["node1:8888"],
                                                 "worker": ["node1:8889", "node2:8888"]}
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)
    assert resolver.worker_rank is None
    env = step_env(3, "node[1-2]", "2(x2)")
    resolver = SlurmClusterResolver(jobs={"worker": 2, "ps": 1, "chief": 1}, environment=env)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["node1:8888"], "ps": ["node1:8889"], "worker": ["node2:8888", "node2:8889"]}
    assert (resolver.task_type, resolver.task_id, resolver.worker_rank) == ("worker", 1, 2)


def test_the_environment_names_the_jobs_and_the_first_port() -> None:
    env = step_env(1, "gpu[7-8]", "1(x2)", STRATAGEM_SLURM_JOBS="chief=1,worker=1",
                   STRATAGEM_SLURM_PORT_BASE="20000")
    resolver = SlurmClusterResolver(environment=env)
    assert resolver.cluster_spec().as_dict() == {"chief": ["gpu7:20000"], "worker": ["gpu8:20000"]}
    explicit = SlurmClusterResolver(jobs={"worker": 2}, port_base=3000, environment=env)
    assert explicit.cluster_spec().as_dict() == {"worker": ["gpu7:3000", "gpu8:3000"]}


def test_too_few_tasks_for_the_jobs_says_so_with_the_fix() -> None:
    with pytest.raises(ClusterConfigError) as caught:
        SlurmClusterResolver(jobs={"chief": 1, "worker": 2, "ps": 1},
                             environment=step_env(0, "node[1-2]", "1(x2)"))
    assert str(caught.value) == (
        "the Slurm step has 2 tasks, but the cluster needs 4 (1 chief, 1 ps, 2 worker, from jobs): "
        "start it with `srun --ntasks=4` (or `#SBATCH --ntasks=4`), or ask for fewer tasks in jobs.")
    with pytest.raises(ClusterConfigError, match="needs 3 .* from STRATAGEM_SLURM_JOBS"):
        SlurmClusterResolver(environment=step_env(0, STRATAGEM_SLURM_JOBS="worker=3", tasks_per_node="1,1"))


def test_more_tasks_than_the_jobs_use_is_refused_too() -> None:
    with pytest.raises(ClusterConfigError, match=r"has 4 tasks, but the cluster uses 3 \(3 worker, from "
                       r"jobs\): task 3 would have no part in it. Start it with `srun --ntasks=3`"):
        SlurmClusterResolver(jobs={"worker": 3}, environment=step_env(0))
    with pytest.raises(ClusterConfigError, match="tasks 1 to 3 would have no part"):
        SlurmClusterResolver(jobs={"worker": 1}, environment=step_env(0))


def test_the_step_comes_before_the_job() -> None:
    env = step_env(1, "node[3-4]", "1(x2)", SLURM_JOB_NODELIST="node[1-4]", SLURM_TASKS_PER_NODE="1(x4)",
                   SLURM_NTASKS="4")
    assert SlurmClusterResolver(environment=env).cluster_spec().as_dict() == {
        "worker": ["node3:8888", "node4:8888"]}
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "c[1-2]",
             "SLURM_TASKS_PER_NODE": "1(x2)"}   # no step: the job's variables
    assert SlurmClusterResolver(environment=batch).cluster_spec().as_dict() == {
        "worker": ["c1:8888", "c2:8888"]}


def test_a_cyclic_step_is_placed_as_slurm_placed_it() -> None:
    env = step_env(1, "n[1-2]", "2(x2)", SLURM_DISTRIBUTION="cyclic", SLURMD_NODENAME="n2", SLURM_LOCALID="0")
    resolver = SlurmClusterResolver(environment=env)
    assert resolver.cluster_spec().as_dict() == {"worker": ["n1:8888", "n2:8888", "n1:8889", "n2:8889"]}
    assert resolver.master() == "grpc://n2:8888" and resolver.local_rank == 0
    assert SlurmClusterResolver(rpc_layer=None, environment=env).master() == "n2:8888"


def test_a_task_elsewhere_than_its_address_is_refused() -> None:
    env = step_env(1, "n[1-2]", "2(x2)", SLURMD_NODENAME="n2", SLURM_LOCALID="0")   # cyclic, unsaid
    with pytest.raises(ClusterConfigError, match="Slurm placed task 1 on node n2 as its task 0, but its "
                       r"distribution \(block\) puts it on n1 as task 1.*--distribution=block"):
        SlurmClusterResolver(environment=env)


def test_tasks_per_node_overrides() -> None:
    env = step_env(2, "n[1-2]", "3,1")
    assert SlurmClusterResolver(tasks_per_node=2, environment=env).cluster_spec().as_dict() == {
        "worker": ["n1:8888", "n1:8889", "n2:8888", "n2:8889"]}
    by_node = SlurmClusterResolver(tasks_per_node={"n2": 1, "n1": 3}, environment=env)
    assert by_node.cluster_spec().as_dict() == {"worker": ["n2:8888", "n1:8888", "n1:8889", "n1:8890"]}
    with pytest.raises(ClusterConfigError, match=r"add up to 6, but Slurm started 4 tasks \(SLURM_STEP_NUM_TASKS\)"):
        SlurmClusterResolver(tasks_per_node=3, environment=env)


@pytest.mark.parametrize("arguments, env_extra, problem", [
    ({}, {"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is out of range for 4 tasks"),
    ({}, {"SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not an integer"),
    ({}, {"SLURM_STEP_NODELIST": "node[1-"}, "a '[' is never closed"),
    ({}, {"SLURM_STEP_TASKS_PER_NODE": "2(x3"}, "is not a count like"),
    ({"jobs": {"workers": 4}}, {}, "unknown job 'workers'"),
    ({"jobs": {"ps": 4}}, {}, "have no chief or worker task"),
    ({"jobs": {"chief": 2, "worker": 2}}, {}, "at most one chief"),
    ({"jobs": {"worker": "4"}}, {}, "task count '4'"),
    ({"gpus_per_node": "4"}, {}, "gpus_per_node='4'; give an integer >= 0"),
    ({"gpus_per_task": -1}, {}, "gpus_per_task=-1; give an integer >= 0"),
    ({"tasks_per_node": 0}, {}, "tasks_per_node=0; give an integer >= 1"),
    ({"port_base": 65535}, {}, "port_base=65535; with up to 2 tasks on a node it must be 1 to 65534"),
    ({}, {"STRATAGEM_SLURM_PORT_BASE": "http"}, "STRATAGEM_SLURM_PORT_BASE='http' is not a port number"),
])
def test_malformed_descriptions_name_the_problem(arguments: dict, env_extra: dict, problem: str) -> None:
    with pytest.raises(ClusterConfigError) as caught:
        SlurmClusterResolver(**arguments, environment=step_env(0, **env_extra))
    assert problem in str(caught.value)


@pytest.mark.parametrize("extra", [{}, {"SLURMD_NODENAME": "n2", "SLURM_LOCALID": "0"},
                                   {"SLURM_DISTRIBUTION": "cyclic"}])
def test_a_node_without_tasks_is_refused_naming_the_variable_whatever_else_is_set(extra: dict) -> None:
    step = step_env(0, "n[1-2]", "0,2", num_tasks=2, **extra)   # 2 tasks, both said to run on n2
    with pytest.raises(ClusterConfigError, match=r"SLURM_STEP_TASKS_PER_NODE='0,2': '0' gives node 1 of the "
                       r"node list no task.*every count is 1 or more") as caught:
        SlurmClusterResolver(environment=step)
    assert "--distribution" not in str(caught.value)
    job = {key: value for key, value in step_env(1, "n[1-3]", "1", **extra).items() if "STEP" not in key}
    with pytest.raises(ClusterConfigError, match=r"SLURM_TASKS_PER_NODE='1\(x2\),0'"):   # outside a step: the job's
        SlurmClusterResolver(environment={**job, "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2),0"})


def test_outside_slurm_it_says_how_to_start() -> None:
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID is not set.*`srun --ntasks=2 python train.py`"):
        SlurmClusterResolver(environment={})


# --------------------------------------------------------------------------- GPUs


def test_each_task_gets_its_share_of_the_node_gpus() -> None:
    envs = [step_env(r, "n[1-2]", "2(x2)", SLURM_LOCALID=str(r % 2)) for r in range(4)]
    resolvers = [SlurmClusterResolver(gpus_per_node=4, environment=env) for env in envs]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "2,3", "0,1", "2,3"]
    assert resolvers[1].num_accelerators() == {"GPU": 2}
    # the GPUs Slurm gave the job (CUDA_VISIBLE_DEVICES) are the ones shared out
    env = step_env(1, "n[1-2]", "2(x2)", CUDA_VISIBLE_DEVICES="4,5,6,7")
    SlurmClusterResolver(gpus_per_task=1, environment=env)
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    SlurmClusterResolver(gpus_per_task=1, environment=env)        # a second resolver: the same share
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    env = step_env(1, CUDA_VISIBLE_DEVICES="4,5,6,7")
    SlurmClusterResolver(auto_set_gpu=False, environment=env)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_gpus_that_slurm_bound_to_the_task_stay_its_own() -> None:
    env = step_env(3, "n[1-2]", "2(x2)", SLURM_GPUS_PER_TASK="a100:2", CUDA_VISIBLE_DEVICES="6,7")
    resolver = SlurmClusterResolver(environment=env)                 # --gpus-per-task=a100:2
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and resolver.num_accelerators() == {"GPU": 2}
    env = step_env(3, "n[1-2]", "2(x2)", SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="4,5")
    SlurmClusterResolver(environment=env)                            # not bound (--gpu-bind=none): shared out
    assert env["CUDA_VISIBLE_DEVICES"] == "5"


def test_a_share_that_cuda_would_not_see_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)   # as after a first CUDA call
    env = step_env(1, CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(ClusterConfigError, match="would set CUDA_VISIBLE_DEVICES='1' for this task, but "
                       "CUDA has already started.*auto_set_gpu=False"):
        SlurmClusterResolver(environment=env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    SlurmClusterResolver(auto_set_gpu=False, environment=env)
    env = step_env(1, "n[1-4]", "1(x4)", CUDA_VISIBLE_DEVICES="3")
    SlurmClusterResolver(environment=env)   # one task per node: its share is what it sees, no change


def test_more_gpus_than_a_node_has_are_refused() -> None:
    with pytest.raises(ClusterConfigError, match="2 tasks on one node with gpus_per_task=3 need 6 GPUs per "
                       "node, but a node has 4"):
        SlurmClusterResolver(gpus_per_node=4, gpus_per_task=3, environment=step_env(0))
    with pytest.raises(ClusterConfigError, match="gpus_per_node=8, but this task sees 2 GPUs"):
        SlurmClusterResolver(gpus_per_node=8, environment=step_env(0, CUDA_VISIBLE_DEVICES="0,1"))


# --------------------------------------------------------------------------- resolve()


def test_resolve_takes_a_slurm_step_after_tf_config_and_torchrun() -> None:
    assert in_slurm_step(step_env(0)) and not in_slurm_step({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert isinstance(resolve(step_env(3)), SlurmClusterResolver)
    tf_config = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}})}
    assert type(resolve({**step_env(3), **tf_config})).__name__ == "TFConfigClusterResolver"
    torchrun = {"RANK": "0", "WORLD_SIZE": "1"}
    assert type(resolve({**step_env(3), **torchrun})).__name__ == "TorchrunClusterResolver"


def test_a_batch_script_is_one_task_with_a_warning() -> None:
    batch = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
             "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.warns(RuntimeWarning, match="Slurm job 42 of 4 tasks, but not as one of them.*"
                      r"`srun python \.\.\.` to run 4 workers"):
        resolver = resolve(batch)
    assert resolver.num_workers == 1 and resolver.task_type is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve({**batch, "SLURM_NTASKS": "1"})   # one task: nothing lost, nothing said


@pytest.fixture
def slurm_environ(monkeypatch: pytest.MonkeyPatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "STRATAGEM_SLURM_JOBS", "STRATAGEM_SLURM_PORT_BASE"):
        monkeypatch.delenv(name, raising=False)

    def use(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    return use


def test_strategies_find_the_slurm_step_by_themselves(slurm_environ) -> None:
    slurm_environ(step_env(0, "localhost", "1"))
    strategy = sg.MultiWorkerMirroredStrategy()
    assert isinstance(strategy.cluster_resolver, SlurmClusterResolver)
    assert strategy.num_replicas_in_sync == 1
    slurm_environ({"STRATAGEM_SLURM_JOBS": "chief=1"})
    with pytest.raises(ClusterConfigError, match="needs 'ps' tasks.*STRATAGEM_SLURM_JOBS"):
        sg.ParameterServerStrategy()
    slurm_environ({**step_env(0, "localhost,other", "0,1", num_tasks=1), "STRATAGEM_SLURM_JOBS": "worker=1",
                   "SLURMD_NODENAME": "other", "SLURM_LOCALID": "0"})
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_TASKS_PER_NODE='0,1'"):
        sg.MultiWorkerMirroredStrategy()


def test_stratagem_server_finds_its_task_in_the_step() -> None:
    from stratagem.ps.server import resolve_task

    task = resolve_task(step_env(2, "n[1-2]", "2(x2)", STRATAGEM_SLURM_JOBS="chief=1,ps=1,worker=2"))
    assert (task.task_type, task.task_id, task.address) == ("worker", 0, "n2:8888")
