"""What Kubernetes and JobSet put in a pod, for the tests: the manifests of examples/kubernetes/,
the pods their Jobs make (host names, annotations, JOB_COMPLETION_INDEX) and the environment
each container gets (its env list with the downward API and Secrets evaluated)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "examples" / "kubernetes"
TOKEN = secrets.token_urlsafe(32)   # the Secret's value in the simulated pods
NAMESPACE = "ml"

PodEnv = dict[str, str]


def pytorchjob_env(rank: int, *, world_size: int, nnodes: int, nproc: str = "auto",
                   master: str = "digits-master-0", port: int = 23456) -> PodEnv:
    """The env list training-operator v1.8's setPodEnv gives a PyTorchJob pod with a Master replica
    (its order: PYTHONUNBUFFERED, the master's, WORLD_SIZE, RANK, then torchrun's PET_*)."""
    return {"PYTHONUNBUFFERED": "0", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
            "MASTER_ADDR": master, "PET_MASTER_ADDR": master, "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank),
            "PET_NNODES": str(nnodes)}


def load(name: str) -> list[dict[str, Any]]:
    with (MANIFESTS / name).open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _field(path: str, meta: dict[str, Any]) -> str:
    """The downward API: the value of a pod's ``fieldRef.fieldPath``."""
    for kind in ("annotations", "labels"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return meta[kind][path[len(prefix):-2]]   # KeyError: the pod has no such field
    return {"metadata.namespace": meta["namespace"], "metadata.name": meta["name"]}[path]


def container_env(container: dict[str, Any], meta: dict[str, Any]) -> PodEnv:
    """The container's env list as the kubelet evaluates it for a pod with ``meta``."""
    env: PodEnv = {}
    for item in container.get("env", []):
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in source:
            env[item["name"]] = _field(source["fieldRef"]["fieldPath"], meta)
        elif "secretKeyRef" in source:
            assert source["secretKeyRef"] == {"name": "stratagem-cluster-token", "key": "token"}
            env[item["name"]] = TOKEN
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


def indexed_job_pods(job: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], PodEnv]]:
    """(host name, metadata, env) of each pod of an Indexed Job, as Kubernetes makes them."""
    name, spec = job["metadata"]["name"], job["spec"]
    assert spec["completionMode"] == "Indexed"
    for index in range(spec["completions"]):
        meta = {"name": f"{name}-{index}-x7k2p", "namespace": NAMESPACE,
                "labels": {"batch.kubernetes.io/job-name": name, "job-name": name,
                           "batch.kubernetes.io/job-completion-index": str(index)},
                "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}
        host = f"{name}-{index}"
        env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": host}   # Kubernetes and the runtime
        yield host, meta, env


def jobset_pods(jobset: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any], PodEnv]]:
    """(replicated job, host name, metadata, env) of every pod of a JobSet, as the JobSet and Job
    controllers make them: the Jobs ``<jobset>-<rjob>-<job index>``, their pods' host names
    ``<job>-<pod index>``, the JobSet's annotations and labels on every pod."""
    name = jobset["metadata"]["name"]
    rjobs = jobset["spec"]["replicatedJobs"]
    total = sum(r.get("replicas", 1) for r in rjobs)
    global_index = 0
    for rjob in rjobs:
        replicas = rjob.get("replicas", 1)
        for job_index in range(replicas):
            job_name = f"{name}-{rjob['name']}-{job_index}"
            marks = {"jobset.sigs.k8s.io/jobset-name": name,
                     "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                     "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicas),
                     "jobset.sigs.k8s.io/global-replicas": str(total),
                     "jobset.sigs.k8s.io/job-index": str(job_index),
                     "jobset.sigs.k8s.io/job-global-index": str(global_index),
                     "jobset.sigs.k8s.io/restart-attempt": "0"}
            global_index += 1
            job = {"metadata": {"name": job_name}, "spec": rjob["template"]["spec"]}
            for host, meta, env in indexed_job_pods(job):
                meta["labels"].update(marks)
                meta["annotations"].update(marks)
                yield rjob["name"], host, meta, env


def containers(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(role, pod spec, container) of every container a workload's pod templates run."""
    kind, spec = doc["kind"], doc["spec"]
    if kind in ("TFJob", "PyTorchJob"):
        replicas = spec["tfReplicaSpecs" if kind == "TFJob" else "pytorchReplicaSpecs"]
        templates = [(role, replica["template"]["spec"]) for role, replica in replicas.items()]
    elif kind == "JobSet":
        templates = [(r["name"], r["template"]["spec"]["template"]["spec"]) for r in spec["replicatedJobs"]]
    elif kind == "Job":
        templates = [(doc["metadata"]["name"], spec["template"]["spec"])]
    else:
        return
    for role, pod in templates:
        for container in pod["containers"]:
            yield role, pod, container
