"""Kubernetes: the environments Kubeflow's operators, Kubernetes and JobSet give a pod, read with no
configuration, and the example manifests of examples/kubernetes/ checked for shape.

The operators' variables are copied here as data, as their controllers write them (TFJob's
TF_CONFIG as Go's encoding/json marshals it; PyTorchJob's env list; torchrun's worker env). No
cluster is needed; tests/cluster/test_kubernetes_jobs.py trains with real processes.
"""

from __future__ import annotations

import json
import re

import pytest

import stratagem as sg
from stratagem.cluster import (KubernetesClusterResolver, TFConfigClusterResolver,
                               TorchrunClusterResolver, resolve)
from stratagem.errors import ClusterConfigError
from stratagem.ps.server import resolve_task

from .kube_pods import (MANIFESTS, NAMESPACE, ROOT, TOKEN, container_env, containers, indexed_job_pods,
                        jobset_pods, load, one, pytorchjob_env)

pytestmark = pytest.mark.timeout(60)

# ------------------------------------------------------------------ TFJob (training-operator v1)

# genTFConfigJSONStr for a TFJob "digits-ps" in namespace "ml": Chief 1, Worker 2, PS 2 and an
# Evaluator (left out of "cluster"), port 2222 (the container "tensorflow", port "tfjob-port").
TFJOB_CLUSTER = ('{"chief":["digits-ps-chief-0.ml.svc:2222"],"ps":["digits-ps-ps-0.ml.svc:2222",'
                 '"digits-ps-ps-1.ml.svc:2222"],"worker":["digits-ps-worker-0.ml.svc:2222",'
                 '"digits-ps-worker-1.ml.svc:2222"]}')


def tfjob_env(task_type: str, index: int, cluster: str = TFJOB_CLUSTER) -> dict[str, str]:
    return {"TF_CONFIG": f'{{"cluster":{cluster},"task":{{"type":"{task_type}","index":{index}}},'
                         f'"environment":"cloud"}}', "PYTHONUNBUFFERED": "0"}


@pytest.mark.parametrize("task_type, index, rank", [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2),
                                                    ("ps", 0, None), ("ps", 1, None), ("evaluator", 0, None)])
def test_a_tfjobs_tf_config_is_read_as_the_operator_writes_it(task_type: str, index: int, rank) -> None:
    resolver = resolve(tfjob_env(task_type, index))
    assert isinstance(resolver, TFConfigClusterResolver)
    assert (resolver.task_type, resolver.task_id, resolver.worker_rank) == (task_type, index, rank)
    assert resolver.num_workers == 3 and resolver.chief_address == "digits-ps-chief-0.ml.svc:2222"
    assert resolver.cluster_spec().as_dict() == json.loads(TFJOB_CLUSTER)
    if task_type in ("worker", "ps"):   # what `stratagem server` serves, on the Service's name
        assert resolve_task(tfjob_env(task_type, index)).address == f"digits-ps-{task_type}-{index}.ml.svc:2222"


def test_a_tfjob_with_a_custom_cluster_domain_is_read_too() -> None:
    cluster = ('{"chief":["j-chief-0.ml.svc.cluster.local:2222"],"worker":["j-worker-0.ml.svc.cluster.local:2222"]}')
    resolver = resolve(tfjob_env("worker", 0, cluster))
    assert resolver.worker_rank == 1 and resolver.chief_address == "j-chief-0.ml.svc.cluster.local:2222"


def test_a_tfjobs_master_replica_and_dynamic_workers_are_refused_with_the_fix() -> None:
    master = '{"master":["j-master-0.ml.svc:2222"],"worker":["j-worker-0.ml.svc:2222"]}'
    with pytest.raises(ClusterConfigError, match="Master replica: name it Chief"):
        resolve(tfjob_env("master", 0, master))
    with pytest.raises(ClusterConfigError, match="Master replica: name it Chief"):
        resolve(tfjob_env("worker", 0, master))
    sparse = {"TF_CONFIG": '{"sparseCluster":{"worker":{"1":"j-worker-1.ml.svc:2222"},"ps":["j-ps-0.ml.svc:2222"]},'
                           '"task":{"type":"worker","index":1}}'}
    with pytest.raises(ClusterConfigError, match="enableDynamicWorker"):
        resolve(sparse)


# ------------------------------------------------------------------ PyTorchJob (training-operator v1.8)

# setPodEnv with a Master replica (kube_pods.pytorchjob_env), port 23456: Master 1 + Worker 2 with
# nprocPerNode left to its default "auto"
def _pytorchjob(rank: int, *, world_size: int = 3, nproc: str = "auto", nnodes: int = 3,
                master: str = "digits-master-0") -> dict[str, str]:
    return pytorchjob_env(rank, world_size=world_size, nnodes=nnodes, nproc=nproc, master=master)


PYTORCHJOB_PODS = [_pytorchjob(rank) for rank in range(3)]
# nprocPerNode "4", Master 1 + Worker 1: WORLD_SIZE counts processes, RANK pods
PYTORCHJOB_4_PER_POD = [_pytorchjob(rank, world_size=8, nproc="4", nnodes=2) for rank in range(2)]
# torchrun in the worker pod (node rank 1) starting local rank 1 of 4: torch's LocalElasticAgent env
TORCHRUN_WORKER = {"LOCAL_RANK": "1", "RANK": "5", "GROUP_RANK": "1", "ROLE_RANK": "5", "ROLE_NAME": "default",
                   "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "8",
                   "MASTER_ADDR": "digits-master-0", "MASTER_PORT": "23456", "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
# elasticPolicy (no Master replica): only torchrun's arguments
PYTORCHJOB_ELASTIC = {"PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": "digits-worker-0:23456",
                      "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:4", "PET_MAX_RESTARTS": "3",
                      "PET_NPROC_PER_NODE": "1"}
# Kubeflow Trainer's TrainJob (a JobSet): torchrun's arguments, PET_NODE_RANK from the completion index
TRAINJOB_NODE_1 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
                   "PET_MASTER_ADDR": "digits-node-0-0.digits", "PET_MASTER_PORT": "29400",
                   "JOB_COMPLETION_INDEX": "1"}


@pytest.mark.parametrize("rank", range(3))
def test_a_pytorchjob_pod_is_its_rank_of_every_pod(rank: int) -> None:
    resolver = resolve(PYTORCHJOB_PODS[rank])
    assert isinstance(resolver, TorchrunClusterResolver)
    assert (resolver.task_type, resolver.task_id, resolver.worker_rank, resolver.num_workers) == \
        ("worker", rank, rank, 3)
    assert resolver.is_chief == (rank == 0) and resolver.chief_address == "digits-master-0:23456"


def test_older_and_forked_pytorchjob_environments_are_read_too() -> None:
    # before nprocPerNode (training-operator 1.5): the four variables and nothing else
    old = {"PYTHONUNBUFFERED": "0", "MASTER_PORT": "23456", "MASTER_ADDR": "digits-master-0",
           "WORLD_SIZE": "2", "RANK": "1"}
    assert resolve(old).worker_rank == 1
    # some builds give the master pod MASTER_ADDR=localhost
    master = resolve(_pytorchjob(0, master="localhost"))
    assert master.is_chief and master.chief_address == "localhost:23456"


def test_processes_per_pod_need_torchrun_and_under_it_each_process_has_its_rank() -> None:
    for pod in PYTORCHJOB_4_PER_POD:
        with pytest.raises(ClusterConfigError, match=r"PET_NPROC_PER_NODE=4 .*torchrun") as caught:
            resolve(pod)
        assert 'nprocPerNode: "1"' in str(caught.value)
    resolver = resolve({**PYTORCHJOB_4_PER_POD[1], **TORCHRUN_WORKER})
    assert (resolver.worker_rank, resolver.num_workers, resolver.local_rank, resolver.local_world_size) == (5, 8, 1, 4)


def test_stale_pytorchjob_variables_are_refused_naming_them() -> None:
    with pytest.raises(ClusterConfigError, match="WORLD_SIZE=3 but PET_NNODES=2"):
        resolve({**PYTORCHJOB_PODS[1], "PET_NNODES": "2"})
    with pytest.raises(ClusterConfigError, match="RANK=1 but PET_NODE_RANK=2"):
        resolve({**PYTORCHJOB_PODS[1], "PET_NODE_RANK": "2"})


@pytest.mark.parametrize("env", [PYTORCHJOB_ELASTIC, TRAINJOB_NODE_1], ids=["elastic", "trainjob"])
def test_torchruns_arguments_without_a_rank_ask_for_torchrun(env: dict[str, str]) -> None:
    with pytest.raises(ClusterConfigError, match=r"PET_NNODES.* are set but RANK and WORLD_SIZE are not.*"
                                                 r"command: \[\"torchrun\", \"train.py\"\]"):
        resolve(env)
    assert resolve({**env, **TORCHRUN_WORKER}).worker_rank == 5   # what torchrun then gives each process


# ------------------------------------------------------------------ Indexed Job and JobSet


def _expected_spec(pods: list[tuple[str, str]], service: str, port: int) -> dict[str, list[str]]:
    spec: dict[str, list[str]] = {}
    for job, host in pods:
        spec.setdefault(job, []).append(f"{host}.{service}:{port}")
    return spec


def test_every_pod_of_the_indexed_job_manifest_finds_its_place() -> None:
    docs = load("indexed-job.yaml")
    job = one(docs, "Job")
    (_, _, container), = containers(job)
    pods = list(indexed_job_pods(job))
    expected = _expected_spec([("worker", host) for host, _, _ in pods], "digits-workers", 2222)
    for index, (host, meta, env) in enumerate(pods):
        resolver = resolve({**env, **container_env(container, meta)})
        assert isinstance(resolver, KubernetesClusterResolver)
        assert (resolver.task_type, resolver.task_id, resolver.worker_rank) == ("worker", index, index)
        assert resolver.cluster_spec().as_dict() == expected
        assert resolver.chief_address == "digits-0.digits-workers:2222"


@pytest.mark.parametrize("manifest, roles", [("jobset.yaml", {"worker": 2}),
                                             ("jobset-ps.yaml", {"chief": 1, "worker": 2, "ps": 2})])
def test_every_pod_of_a_jobset_manifest_finds_its_place(manifest: str, roles: dict[str, int]) -> None:
    jobset = one(load(manifest), "JobSet")
    templates = {role: container for role, _, container in containers(jobset)}
    pods = list(jobset_pods(jobset))
    assert {role: sum(r == role for r, *_ in pods) for role in roles} == roles
    expected = _expected_spec([(role, host) for role, host, _, _ in pods], jobset["metadata"]["name"], 2222)
    for role, host, meta, env in pods:
        pod = {**env, **container_env(templates[role], meta)}
        resolver = resolve(pod)
        assert isinstance(resolver, KubernetesClusterResolver)
        assert resolver.cluster_spec().as_dict() == expected
        assert resolver.task_type == role and resolver.master() == f"{host}.{jobset['metadata']['name']}:2222"
        if role in ("worker", "ps") and "ps" in roles:
            assert resolve_task(pod).address == resolver.master()   # where `stratagem server` listens
    chief = resolve({**pods[0][3], **container_env(templates[pods[0][0]], pods[0][2])})
    assert chief.is_chief and chief.worker_rank == 0


def test_a_replicated_job_of_several_jobs_numbers_its_pods_across_them() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "big", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "2",
           "REPLICATED_JOB_REPLICAS": "3", "STRATAGEM_JOBS": "worker=6", "STRATAGEM_PORT": "3000"}
    resolver = KubernetesClusterResolver(environment=env)
    assert (resolver.task_id, resolver.master()) == (5, "big-worker-2-1.big:3000")
    assert resolver.cluster_spec().job_tasks("worker")[:3] == ["big-worker-0-0.big:3000", "big-worker-0-1.big:3000",
                                                               "big-worker-1-0.big:3000"]


def test_the_address_template_names_each_task_otherwise() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "digits-1", "STRATAGEM_JOBS": "worker=2",
           "STRATAGEM_SERVICE": "digits-workers", "POD_NAMESPACE": NAMESPACE,
           "STRATAGEM_ADDRESS_TEMPLATE": "{host}.{service}.{namespace}.svc.cluster.local:{port}"}
    assert KubernetesClusterResolver(environment=env).chief_address == \
        "digits-0.digits-workers.ml.svc.cluster.local:2222"
    env["STRATAGEM_ADDRESS_TEMPLATE"] = "10.0.7.1{index}:{port}"   # no DNS at all
    assert KubernetesClusterResolver(environment=env).cluster_spec().job_tasks("worker") == \
        ["10.0.7.10:2222", "10.0.7.11:2222"]
    env["JOB_NAME"], env["HOSTNAME"] = "digits", "node-7"   # JOB_NAME wins over the host name
    assert KubernetesClusterResolver(environment=env).worker_rank == 1


POD = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "digits-1", "STRATAGEM_JOBS": "worker=2",
       "STRATAGEM_SERVICE": "digits-workers"}
JOBSET_POD = {"JOB_COMPLETION_INDEX": "0", "JOBSET_NAME": "digits", "REPLICATED_JOB_NAME": "worker",
              "JOB_INDEX": "0", "REPLICATED_JOB_REPLICAS": "1", "STRATAGEM_JOBS": "worker=2"}


@pytest.mark.parametrize("change, message", [
    ({"STRATAGEM_JOBS": None}, r"STRATAGEM_JOBS is not set.*\n    - name: STRATAGEM_JOBS\n      value: \"worker=4\""),
    ({"STRATAGEM_SERVICE": None}, r"STRATAGEM_SERVICE is not set.*'digits-<index>\.<service>'"),
    ({"HOSTNAME": "node-7"}, r"host name 'node-7' is not '<job>-1'.*\n    - name: JOB_NAME\n      valueFrom: "
                             r"\{fieldRef: \{fieldPath: \"metadata.labels\['batch.kubernetes.io/job-name'\]\"\}\}"),
    ({"JOB_COMPLETION_INDEX": "2"}, r"JOB_COMPLETION_INDEX=2 is out of range: STRATAGEM_JOBS counts 2 worker pods"),
    ({"JOB_COMPLETION_INDEX": "one"}, r"JOB_COMPLETION_INDEX='one' is not an integer"),
    ({"STRATAGEM_JOBS": "workers=2"}, r"'workers=2' is not 'job=count'"),
    ({"STRATAGEM_JOBS": "worker=0"}, r"'worker=0' is not 'job=count'"),
    ({"STRATAGEM_JOBS": "ps=2"}, r"has no chief or worker"),
    ({"STRATAGEM_JOBS": "chief=2,worker=1"}, r"at most one chief"),
    ({"STRATAGEM_JOBS": "chief=1,worker=2"}, r"names several jobs.*plain Indexed Job.*JOBSET_NAME"),
    ({"STRATAGEM_PORT": "70000"}, r"STRATAGEM_PORT=70000 is not a port"),
    ({"STRATAGEM_ADDRESS_TEMPLATE": "{host}:{rank}"}, r"placeholder \{rank\}; the placeholders are"),
    ({"STRATAGEM_ADDRESS_TEMPLATE": "{host}.{namespace}:{port}"}, r"POD_NAMESPACE is not set"),
    ({"STRATAGEM_ADDRESS_TEMPLATE": "db:5432"}, r"address 'db:5432' is given to both"),
])
def test_a_missing_or_inconsistent_pod_variable_is_named_with_the_manifest_line(change, message) -> None:
    env = {**POD, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ClusterConfigError, match="(?s)" + message):
        resolve(env)


@pytest.mark.parametrize("change, message", [
    ({"REPLICATED_JOB_NAME": None}, r"REPLICATED_JOB_NAME is not set.*replicatedjob-name"),
    ({"REPLICATED_JOB_NAME": "workers"}, r"replicated job 'workers' \(REPLICATED_JOB_NAME\) is not in STRATAGEM_JOBS"),
    ({"JOB_INDEX": "1"}, r"JOB_INDEX=1 but REPLICATED_JOB_REPLICAS=1.*replicatedjob-replicas"),
    ({"REPLICATED_JOB_REPLICAS": "3"}, r"counts 2 'worker' pods, which 3 Jobs .* cannot share equally"),
    ({"REPLICATED_JOB_REPLICAS": "2", "STRATAGEM_JOBS": "chief=1,worker=2"}, r"every replicated job must have "
                                                                              r"replicas: 1"),
    ({"JOB_COMPLETION_INDEX": "2"}, r"JOB_COMPLETION_INDEX=2 is out of range.*2 'worker' pods in 1 Job"),
])
def test_a_jobset_pods_missing_or_inconsistent_variable_is_named(change, message) -> None:
    env = {k: v for k, v in {**JOBSET_POD, **change}.items() if v is not None}
    with pytest.raises(ClusterConfigError, match="(?s)" + message):
        resolve(env)


def test_detection_order_tf_config_then_torchrun_then_kubernetes() -> None:
    assert isinstance(resolve({**POD, **tfjob_env("worker", 0)}), TFConfigClusterResolver)
    assert isinstance(resolve({**POD, **TORCHRUN_WORKER}), TorchrunClusterResolver)
    assert isinstance(resolve({**POD, **TRAINJOB_NODE_1, "JOB_COMPLETION_INDEX": "1"}), KubernetesClusterResolver)
    with pytest.raises(ClusterConfigError, match="JOB_COMPLETION_INDEX is not set"):
        KubernetesClusterResolver(environment={})


def test_strategies_pick_the_pods_cluster_up_with_no_arguments(monkeypatch) -> None:
    # a one-pod Job: MultiWorkerMirroredStrategy() meets no one; ParameterServerStrategy() reads the
    # same description and says what it lacks
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "STRATAGEM_CLUSTER_TOKEN", "GLOO_SOCKET_IFNAME",
                 "STRATAGEM_GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")   # restored (or removed) after the test
        monkeypatch.delenv(name)
    for name, value in {"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "solo-0", "STRATAGEM_JOBS": "worker=1",
                        "STRATAGEM_SERVICE": "solo", "STRATAGEM_ADDRESS_TEMPLATE": "127.0.0.1:{port}"}.items():
        monkeypatch.setenv(name, value)
    strategy = sg.MultiWorkerMirroredStrategy()
    assert isinstance(strategy.cluster_resolver, KubernetesClusterResolver)
    assert strategy.num_replicas_in_sync == 1 and strategy.is_chief
    with pytest.raises(ClusterConfigError, match="needs 'ps' tasks in the cluster, but it has \\['worker'\\]"):
        sg.ParameterServerStrategy()


# ------------------------------------------------------------------ the manifests' shape

KINDS = {("kubeflow.org/v1", "TFJob"), ("kubeflow.org/v1", "PyTorchJob"), ("jobset.x-k8s.io/v1alpha2", "JobSet"),
         ("batch/v1", "Job"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy")}
FILES = sorted(path.name for path in MANIFESTS.glob("*.yaml"))
POD_LABEL = {"TFJob": "training.kubeflow.org/job-name", "PyTorchJob": "training.kubeflow.org/job-name",
             "JobSet": "jobset.sigs.k8s.io/jobset-name", "Job": "batch.kubernetes.io/job-name"}


def workload(docs: list[dict]) -> dict:
    found = [doc for doc in docs if doc["kind"] in POD_LABEL]
    assert len(found) == 1
    return found[0]


def test_the_manifests_are_all_there_and_documented() -> None:
    assert FILES == ["indexed-job.yaml", "jobset-ps.yaml", "jobset.yaml", "pytorchjob-torchrun.yaml",
                     "pytorchjob.yaml", "tfjob-ps.yaml"]
    guide = (ROOT / "docs" / "kubernetes.md").read_text()
    assert all(f"examples/kubernetes/{name}" in guide for name in FILES)


@pytest.mark.parametrize("name", FILES)
def test_a_manifest_is_well_formed_and_every_container_runs_stratagem(name: str) -> None:
    docs = load(name)
    assert {(doc["apiVersion"], doc["kind"]) for doc in docs} <= KINDS
    job = workload(docs)
    commands = []
    for role, pod, container in containers(job):
        command = container["command"] + container.get("args", [])
        commands.append(command)
        if command == ["stratagem", "server"]:
            continue
        assert command[0] in ("python", "torchrun"), f"{role}: {command}"
        script = command[1]
        assert script.startswith("/workspace/examples/"), f"{role}: the image holds the repository's examples"
        source = (ROOT / script[len("/workspace/"):]).read_text()   # the script exists ...
        for option in command[2:]:   # ... and takes these options
            assert not option.startswith("--") or f'"{option}"' in source, f"{role}: {script} has no {option}"
    assert any(c[0] != "stratagem" for c in commands), "someone runs the training script"


@pytest.mark.parametrize("name", FILES)
def test_the_cluster_token_comes_from_a_secret_and_only_there(name: str) -> None:
    docs = load(name)
    assert not any(doc["kind"] == "Secret" for doc in docs)
    text = (MANIFESTS / name).read_text()
    job = workload(docs)
    parameter_servers = "stratagem server" in " ".join(" ".join(c["command"]) for *_, c in containers(job))
    for role, _, container in containers(job):
        entries = [e for e in container.get("env", []) if "TOKEN" in e["name"]]
        if parameter_servers:   # every task of parameter-server training holds the token
            assert [e["name"] for e in entries] == ["STRATAGEM_CLUSTER_TOKEN"], role
        for entry in entries:
            assert "value" not in entry and set(entry["valueFrom"]) == {"secretKeyRef"}, role
    # no literal that could be a token: no `value:` next to the variable, no strong random string
    assert not re.search(r"STRATAGEM_CLUSTER_TOKEN\s*\n\s*value:", text)
    assert TOKEN not in text


@pytest.mark.parametrize("name", FILES)
def test_ports_and_names_agree_with_what_the_pods_are_told(name: str) -> None:
    docs = load(name)
    job = workload(docs)
    kind, job_name = job["kind"], job["metadata"]["name"]
    for role, pod, container in containers(job):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if kind == "TFJob":   # the operator reads the port of the container "tensorflow" named "tfjob-port"
            assert container["name"] == "tensorflow" and ports == {"tfjob-port": 2222}
        elif kind == "PyTorchJob":   # ... and of the container "pytorch" named "pytorchjob-port"
            assert container["name"] == "pytorch" and ports == {"pytorchjob-port": 23456}
        else:
            port = int(env.get("STRATAGEM_PORT") or 2222)
            assert set(ports.values()) <= {port}, f"{role} listens where the resolver says: {port}"
            if role in ("worker", "ps", job_name) and "chief" not in role:
                assert ports, f"{role} names the port it listens on"
    if kind == "Job":
        service = one(docs, "Service")
        pod = job["spec"]["template"]["spec"]
        (_, _, container), = containers(job)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert pod["subdomain"] == service["metadata"]["name"] == env["STRATAGEM_SERVICE"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job_name}
        assert [p["port"] for p in service["spec"]["ports"]] == [int(env["STRATAGEM_PORT"])]
        assert env["STRATAGEM_JOBS"] == f"worker={job['spec']['completions']}" and job["spec"]["parallelism"] == \
            job["spec"]["completions"]
    if kind == "JobSet":
        network = job["spec"]["network"]
        assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True
        for rjob in job["spec"]["replicatedJobs"]:
            spec = rjob["template"]["spec"]
            assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    if kind == "PyTorchJob":   # more than one process per pod only through torchrun
        for _, _, container in containers(job):
            assert (container["command"][0] == "torchrun") == (int(job["spec"]["nprocPerNode"]) > 1)


@pytest.mark.parametrize("name", FILES)
def test_the_restart_policy_gives_stratagems_restart_semantics(name: str) -> None:
    job = workload(load(name))
    kind, spec = job["kind"], job["spec"]
    if kind in ("TFJob", "PyTorchJob"):   # a failed task restarts in place and rejoins
        replicas = spec["tfReplicaSpecs" if kind == "TFJob" else "pytorchReplicaSpecs"]
        assert {r["restartPolicy"] for r in replicas.values()} == {"OnFailure"}
        assert spec["runPolicy"]["backoffLimit"] >= 1 and spec["runPolicy"]["cleanPodPolicy"] == "Running"
    elif kind == "Job":   # no group restart: fail at once, the next run resumes
        assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    elif "successPolicy" in spec:   # parameter servers: tasks restart in place; the chief's end ends the job
        assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["chief"]}
        for rjob in spec["replicatedJobs"]:
            assert rjob["template"]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    else:   # every pod restarts together, from the last checkpoint; a preemption costs no restart
        policy = spec["failurePolicy"]
        assert policy["maxRestarts"] >= 1 and policy["restartStrategy"] == "BlockingRecreate"
        assert policy["rules"] == [{"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                                    "onJobFailureReasons": ["PodFailurePolicy"]}]
        for rjob in spec["replicatedJobs"]:
            jobspec = rjob["template"]["spec"]
            assert jobspec["backoffLimit"] == 0 and jobspec["template"]["spec"]["restartPolicy"] == "Never"
            rules = jobspec["podFailurePolicy"]["rules"]
            assert {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In",
                                                         "values": [75]}} in rules
            assert {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules


@pytest.mark.parametrize("name", FILES)
def test_only_the_jobs_own_pods_may_reach_it(name: str) -> None:
    docs = load(name)
    job = workload(docs)
    policy = one(docs, "NetworkPolicy")
    own = {POD_LABEL[job["kind"]]: job["metadata"]["name"]}
    assert policy["spec"]["podSelector"] == {"matchLabels": own}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
