"""KubernetesClusterResolver: the cluster of an Indexed Job or a JobSet, from the pod's environment.

Kubernetes numbers the pods of an Indexed Job (``completionMode: Indexed``, which every Job of
a JobSet is) and gives each its index in ``JOB_COMPLETION_INDEX`` and a stable host name:
``<job>-<index>`` for a Job, ``<jobset>-<replicated job>-<job index>-<pod index>`` for a
JobSet, reachable as ``<host name>.<subdomain>`` through the headless Service named by the
pod's ``subdomain`` (a JobSet makes one, named after itself). What a pod cannot see is how
many pods there are, so the manifest says it, once, in every pod's environment:

================================  ===========================================================
``STRATAGEM_JOBS``                required: the pods of each job, ``"worker=4"``, or
                                  ``"chief=1,worker=2,ps=2"`` for a JobSet whose replicated
                                  jobs are named after the task types
``STRATAGEM_SERVICE``             the headless Service (the pods' ``subdomain``); default
                                  ``JOBSET_NAME``, a JobSet's own Service
``STRATAGEM_PORT``                the port every task listens on (default 2222)
``STRATAGEM_ADDRESS_TEMPLATE``    each task's ``host:port``; default ``{host}.{service}:{port}``
                                  (also ``{type}``, ``{index}`` and ``{namespace}``, from
                                  ``POD_NAMESPACE``), e.g. for fully qualified names
================================  ===========================================================

and, in a JobSet's pods, the downward API exposes four of the pod's annotations:
``JOBSET_NAME`` (``jobset.sigs.k8s.io/jobset-name``), ``REPLICATED_JOB_NAME``
(``.../replicatedjob-name``), ``JOB_INDEX`` (``.../job-index``) and
``REPLICATED_JOB_REPLICAS`` (``.../replicatedjob-replicas``). Without ``JOBSET_NAME`` the pod
is one of a plain Indexed Job, a ``"worker"`` whose Job name is ``JOB_NAME`` if set, else its
host name (``HOSTNAME``, else the system's) less ``-<index>``.

The task's index is ``JOB_INDEX`` × pods per Job + ``JOB_COMPLETION_INDEX`` (a replicated job
of ``replicas: R`` splits its count into R Jobs; with several jobs in ``STRATAGEM_JOBS`` each
must have ``replicas: 1``). Rank 0 of the collective (the chief, else worker 0) listens for
the others at its address. A missing or inconsistent variable raises ClusterConfigError
naming it and the manifest line that sets it (docs/kubernetes.md has whole manifests).

Example::

    >>> from stratagem.cluster import KubernetesClusterResolver
    >>> pod = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "mnist-1", "STRATAGEM_JOBS": "worker=2",
    ...        "STRATAGEM_SERVICE": "mnist-workers"}
    >>> resolver = KubernetesClusterResolver(environment=pod)
    >>> resolver.task_type, resolver.task_id, resolver.worker_rank, resolver.chief_address
    ('worker', 1, 1, 'mnist-0.mnist-workers:2222')
    >>> jobset = {"JOB_COMPLETION_INDEX": "0", "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "ps",
    ...           "JOB_INDEX": "0", "STRATAGEM_JOBS": "chief=1,worker=2,ps=1"}
    >>> KubernetesClusterResolver(environment=jobset).cluster_spec().as_dict()["worker"]
    ['train-worker-0-0.train:2222', 'train-worker-0-1.train:2222']
"""

from __future__ import annotations

import os
import socket
import string
from collections.abc import Callable, Mapping

from stratagem.cluster.resolver import ClusterResolver, check_task
from stratagem.cluster.spec import ClusterSpec
from stratagem.cluster.tf_config import TASK_TYPES
from stratagem.errors import ClusterConfigError

__all__ = ["DEFAULT_PORT", "KUBERNETES_VARIABLES", "KubernetesClusterResolver"]

#: The port of every task when ``STRATAGEM_PORT`` is not set (TensorFlow's and TFJob's).
DEFAULT_PORT = 2222

#: The variables the resolver reads; :data:`~stratagem.cluster.pytorchjob.PYTORCHJOB_VARIABLES`
#: are PyTorchJob's.
KUBERNETES_VARIABLES = ("JOB_COMPLETION_INDEX", "HOSTNAME", "JOB_NAME", "JOBSET_NAME",
                        "REPLICATED_JOB_NAME", "JOB_INDEX", "REPLICATED_JOB_REPLICAS",
                        "POD_NAMESPACE", "STRATAGEM_JOBS", "STRATAGEM_SERVICE", "STRATAGEM_PORT",
                        "STRATAGEM_ADDRESS_TEMPLATE")

_DEFAULT_TEMPLATE = "{host}.{service}:{port}"
# (this pod's task type, its index, the host name of task (type, index), the Service)
_Place = tuple[str, int, Callable[[str, int], str], str]
_PLACEHOLDERS = ("host", "service", "port", "type", "index", "namespace")
# The manifest line that sets each variable, for the messages.
_FIELD = "valueFrom: {{fieldRef: {{fieldPath: \"{}\"}}}}"
_SETS = {
    "JOBSET_NAME": _FIELD.format("metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
    "REPLICATED_JOB_NAME": _FIELD.format(
        "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
    "JOB_INDEX": _FIELD.format("metadata.annotations['jobset.sigs.k8s.io/job-index']"),
    "REPLICATED_JOB_REPLICAS": _FIELD.format(
        "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']"),
    "JOB_NAME": _FIELD.format("metadata.labels['batch.kubernetes.io/job-name']"),
    "POD_NAMESPACE": _FIELD.format("metadata.namespace"),
    "STRATAGEM_JOBS": 'value: "worker=4" (the number of pods of each job)',
    "STRATAGEM_SERVICE": 'value: "<the headless Service, the pod template\'s subdomain>"',
}


def _line(name: str) -> str:
    return f"- name: {name}\n      {_SETS[name]}" if name in _SETS else f"- name: {name}"


def _missing(name: str, why: str) -> ClusterConfigError:
    return ClusterConfigError(
        f"Kubernetes: {name} is not set, but {why}; add it to the container's env in the "
        f"manifest:\n    {_line(name)}\n(docs/kubernetes.md has whole manifests).")


def _integer(env: Mapping[str, str], name: str, *, minimum: int, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        if default is None:
            raise _missing(name, "this pod's place in the cluster depends on it")
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise ClusterConfigError(
            f"Kubernetes: {name}={text!r} is not an integer; in the manifest:\n    "
            f"{_line(name)}") from None
    if value < minimum:
        raise ClusterConfigError(f"Kubernetes: {name}={value} must be >= {minimum}.")
    return value


def _parse_jobs(text: str | None) -> dict[str, int]:
    """``"chief=1,worker=2,ps=2"`` -> ``{"chief": 1, "worker": 2, "ps": 2}``."""
    if text is None or not text.strip():
        raise _missing("STRATAGEM_JOBS", "JOB_COMPLETION_INDEX is set: this pod is one of an "
                       "Indexed Job's or a JobSet's, and only the manifest knows how many pods "
                       "there are")
    jobs: dict[str, int] = {}
    for item in text.split(","):
        job, sep, count = (part.strip() for part in item.partition("="))
        if not sep or job not in TASK_TYPES or not count.isdigit() or int(count) < 1:
            raise ClusterConfigError(
                f"Kubernetes: STRATAGEM_JOBS={text!r}: {item.strip()!r} is not 'job=count' with "
                f"a job among {', '.join(TASK_TYPES)} and a count >= 1; write it like "
                "'worker=4' or 'chief=1,worker=2,ps=2'.")
        if job in jobs:
            raise ClusterConfigError(f"Kubernetes: STRATAGEM_JOBS={text!r} names {job!r} twice.")
        jobs[job] = int(count)
    if "chief" in jobs and jobs["chief"] > 1:
        raise ClusterConfigError(
            f"Kubernetes: STRATAGEM_JOBS={text!r} has {jobs['chief']} chief pods; a cluster has "
            "at most one chief: make it 'chief=1' and count the others as workers.")
    if not {"chief", "worker"} & set(jobs):
        raise ClusterConfigError(
            f"Kubernetes: STRATAGEM_JOBS={text!r} has no chief or worker; a training cluster "
            "needs at least one: add 'worker=N'.")
    return jobs


def _address_template(env: Mapping[str, str]) -> str:
    template = env.get("STRATAGEM_ADDRESS_TEMPLATE") or _DEFAULT_TEMPLATE
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:
        raise ClusterConfigError(
            f"Kubernetes: STRATAGEM_ADDRESS_TEMPLATE={template!r} is not a template ({error}); "
            f"write it like {_DEFAULT_TEMPLATE!r}.") from None
    unknown = sorted(fields - set(_PLACEHOLDERS))
    if unknown:
        raise ClusterConfigError(
            f"Kubernetes: STRATAGEM_ADDRESS_TEMPLATE={template!r} has the placeholder "
            f"{{{unknown[0]}}}; the placeholders are "
            f"{', '.join('{' + p + '}' for p in _PLACEHOLDERS)}.")
    if "namespace" in fields and not env.get("POD_NAMESPACE"):
        raise _missing("POD_NAMESPACE", f"STRATAGEM_ADDRESS_TEMPLATE={template!r} uses {{namespace}}")
    return template


class KubernetesClusterResolver(ClusterResolver):
    """A resolver reading an Indexed Job's or a JobSet's pod environment (module docstring).

    ``environment`` replaces ``os.environ``, for tests. Unlike TensorFlow's resolver of the
    same name it asks the API server nothing (no RBAC role, no Kubernetes client): the
    Service's DNS names and ``STRATAGEM_JOBS`` describe the cluster.
    """

    def __init__(self, *, rpc_layer: str | None = None,
                 environment: Mapping[str, str] | None = None) -> None:
        env = os.environ if environment is None else environment
        if not env.get("JOB_COMPLETION_INDEX", "").strip():
            raise ClusterConfigError(
                "Kubernetes: JOB_COMPLETION_INDEX is not set, so this is not a pod of an Indexed "
                "Job; give the Job (or each replicated Job of a JobSet) completionMode: Indexed, "
                "and Kubernetes sets it in every pod.")
        index = _integer(env, "JOB_COMPLETION_INDEX", minimum=0)
        jobs = _parse_jobs(env.get("STRATAGEM_JOBS"))
        port = _integer(env, "STRATAGEM_PORT", minimum=1, default=DEFAULT_PORT)
        if port > 65535:
            raise ClusterConfigError(f"Kubernetes: STRATAGEM_PORT={port} is not a port (1 to 65535).")
        template = _address_template(env)
        if env.get("JOBSET_NAME"):
            task_type, task_id, hosts, service = self._jobset(env, jobs, index)
        else:
            task_type, task_id, hosts, service = self._indexed_job(env, jobs, index)
        values = {"service": service, "port": port, "namespace": env.get("POD_NAMESPACE", "")}
        cluster = {job: [template.format(host=hosts(job, i), type=job, index=i, **values)
                         for i in range(count)] for job, count in jobs.items()}
        try:
            spec = ClusterSpec(cluster)
        except ClusterConfigError as error:
            raise ClusterConfigError(
                f"Kubernetes: the addresses built from STRATAGEM_ADDRESS_TEMPLATE={template!r} "
                f"are not a cluster: {error}") from None
        check_task(spec, task_type, task_id, source="Kubernetes")
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer)
        self._spec = spec

    @staticmethod
    def _indexed_job(env: Mapping[str, str], jobs: dict[str, int], index: int) -> _Place:
        if list(jobs) != ["worker"]:
            raise ClusterConfigError(
                f"Kubernetes: STRATAGEM_JOBS={env.get('STRATAGEM_JOBS')!r} names several jobs, but "
                "this pod is one of a plain Indexed Job (JOBSET_NAME is not set), whose pods are "
                "all workers: write 'worker=N', or run a JobSet with one replicated job per task "
                f"type and expose its name:\n    {_line('JOBSET_NAME')}")
        if index >= jobs["worker"]:
            raise ClusterConfigError(
                f"Kubernetes: JOB_COMPLETION_INDEX={index} is out of range: STRATAGEM_JOBS counts "
                f"{jobs['worker']} worker pods; make it agree with the Job's completions.")
        name = env.get("JOB_NAME", "").strip()
        if not name:
            host = env.get("HOSTNAME") or socket.gethostname()
            name, _, suffix = host.partition(".")[0].rpartition("-")
            if suffix != str(index) or not name:
                raise ClusterConfigError(
                    f"Kubernetes: this pod's host name {host!r} is not '<job>-{index}', the name "
                    f"an Indexed Job gives its pod {index} (JOB_COMPLETION_INDEX={index}), so the "
                    f"Job's name is unknown; expose it in the manifest:\n    {_line('JOB_NAME')}")
        service = env.get("STRATAGEM_SERVICE", "").strip()
        if not service:
            raise _missing("STRATAGEM_SERVICE", "the pods reach each other as "
                           f"'{name}-<index>.<service>' through the headless Service named in the "
                           "pod template's subdomain")
        return "worker", index, (lambda job, i: f"{name}-{i}"), service

    @staticmethod
    def _jobset(env: Mapping[str, str], jobs: dict[str, int], index: int) -> _Place:
        jobset = env["JOBSET_NAME"].strip()
        task_type = env.get("REPLICATED_JOB_NAME", "").strip()
        if not task_type:
            raise _missing("REPLICATED_JOB_NAME", f"JOBSET_NAME={jobset!r} is, and the pod's task "
                           "type is its replicated job's name")
        if task_type not in jobs:
            raise ClusterConfigError(
                f"Kubernetes: this pod's replicated job {task_type!r} (REPLICATED_JOB_NAME) is "
                f"not in STRATAGEM_JOBS={env.get('STRATAGEM_JOBS')!r}; name the replicated jobs "
                f"after the task types ({', '.join(TASK_TYPES)}) and count each in "
                "STRATAGEM_JOBS, in every pod template alike.")
        replicas = _integer(env, "REPLICATED_JOB_REPLICAS", minimum=1, default=1)
        job_index = _integer(env, "JOB_INDEX", minimum=0, default=0)
        count = jobs[task_type]
        if job_index >= replicas:
            raise ClusterConfigError(
                f"Kubernetes: JOB_INDEX={job_index} but REPLICATED_JOB_REPLICAS={replicas} "
                f"(the replicated job's replicas); expose the replicas:\n    "
                f"{_line('REPLICATED_JOB_REPLICAS')}")
        if replicas > 1 and len(jobs) > 1:
            raise ClusterConfigError(
                f"Kubernetes: replicated job {task_type!r} has replicas: {replicas}, but with "
                f"several jobs (STRATAGEM_JOBS={env.get('STRATAGEM_JOBS')!r}) every replicated "
                "job must have replicas: 1 and parallelism = completions = its count.")
        if count % replicas:
            raise ClusterConfigError(
                f"Kubernetes: STRATAGEM_JOBS counts {count} {task_type!r} pods, which "
                f"{replicas} Jobs (REPLICATED_JOB_REPLICAS) cannot share equally; make the count "
                "replicas x completions.")
        per_job = count // replicas
        if index >= per_job:
            raise ClusterConfigError(
                f"Kubernetes: JOB_COMPLETION_INDEX={index} is out of range: STRATAGEM_JOBS counts "
                f"{count} {task_type!r} pods in {replicas} Job(s), {per_job} each; make "
                "STRATAGEM_JOBS agree with the Job's completions.")
        service = env.get("STRATAGEM_SERVICE", "").strip() or jobset

        def host(job: str, i: int) -> str:
            split = per_job if job == task_type else jobs[job]
            return f"{jobset}-{job}-{i // split}-{i % split}"

        return task_type, job_index * per_job + index, host, service

    def cluster_spec(self) -> ClusterSpec:
        return self._spec
