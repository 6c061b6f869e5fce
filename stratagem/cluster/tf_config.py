"""TFConfigClusterResolver: the cluster described by the TF_CONFIG environment variable.

TF_CONFIG is TensorFlow's JSON description of a training cluster, set in every task's
environment (by ``stratagem launch``, Kubernetes operators, Vertex AI, or by hand)::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"], "evaluator": ["host4:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}                                  # optional

The format is kept exactly, so a TF_CONFIG written for TensorFlow works unchanged. Unknown
top-level keys (``"environment"``, ``"job"``) are ignored, as TensorFlow does: a Kubeflow TFJob's
TF_CONFIG (``"environment": "cloud"``, addresses like ``"job-worker-0.ns.svc:2222"``) is read as
it is (docs/kubernetes.md). The variable is
read and checked once, when the resolver is made, so a bad TF_CONFIG fails at start-up.

Example::

    >>> import json
    >>> from stratagem.cluster import TFConfigClusterResolver
    >>> env = {"TF_CONFIG": json.dumps({
    ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
    ...     "task": {"type": "worker", "index": 1}})}
    >>> resolver = TFConfigClusterResolver(environment=env)
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 1, 'localhost:23456')
    >>> resolver.is_chief, resolver.chief_address        # worker 0 is chief: no chief job
    (False, 'localhost:12345')
    >>> TFConfigClusterResolver(environment={}).cluster_spec()   # no TF_CONFIG: a lone task
    ClusterSpec({})
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from stratagem.cluster.resolver import COLLECTIVE_JOBS, ClusterResolver, check_task
from stratagem.cluster.spec import ClusterSpec
from stratagem.errors import ClusterConfigError

__all__ = ["TFConfigClusterResolver", "TASK_TYPES"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")

_EXAMPLE = ('\'{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}\'')


def _json_error(text: str, err: json.JSONDecodeError) -> ClusterConfigError:
    lines = text.splitlines() or [""]
    line = lines[min(err.lineno, len(lines)) - 1]
    start = max(0, err.colno - 1 - 40)
    excerpt, caret = line[start:start + 80], " " * (err.colno - 1 - start) + "^"
    return ClusterConfigError(
        f"TF_CONFIG is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno} "
        f"(char {err.pos}):\n    {excerpt}\n    {caret}\n"
        f"TF_CONFIG must be a JSON object such as {_EXAMPLE}; JSON needs double quotes "
        "around strings and allows no trailing commas.")


def load_tf_config(text: str | None) -> dict[str, Any]:
    """Parses TF_CONFIG's text; ``{}`` when it is unset, empty or ``{}``."""
    if text is None or not text.strip():
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise _json_error(text, err) from err
    except RecursionError:   # json's decoder recurses once per nested [ or {
        raise ClusterConfigError(
            f"TF_CONFIG is nested too deeply to parse: its [ and {{ go deeper than Python's "
            f"recursion limit ({sys.getrecursionlimit()}); TF_CONFIG is a shallow JSON object "
            f"such as {_EXAMPLE} -- check what sets it.") from None
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object, got a {type(config).__name__}: {text.strip()!r}; "
            f"write it like {_EXAMPLE}.")
    return config


# TFJob's "Master" replica type: TensorFlow 2 refuses it too; its role is the chief's.
_MASTER_HINT = (" (a TFJob's Master replica: name it Chief in tfReplicaSpecs, which gives the same "
                "role)")


def _check_task_type(task_type: object, where: str) -> None:
    if task_type is not None and task_type not in TASK_TYPES:
        raise ClusterConfigError(
            f"{where}: unknown task type {task_type!r}; the task types are "
            f"{', '.join(repr(t) for t in TASK_TYPES)}"
            f"{_MASTER_HINT if task_type == 'master' else ''}.")


def _task_of(config: Mapping[str, Any]) -> tuple[Any, Any]:
    if "task" not in config:
        return None, None
    task = config["task"]
    if not isinstance(task, dict):
        raise ClusterConfigError(
            f'TF_CONFIG: "task" must be an object like {{"type": "worker", "index": 0}}, '
            f"got {task!r}.")
    for key in ("type", "index"):
        if key not in task:
            raise ClusterConfigError(
                f'TF_CONFIG: "task" has no "{key}": {task!r}; write it like '
                '{"type": "worker", "index": 0}, naming this process\'s entry in "cluster".')
    return task["type"], task["index"]


class TFConfigClusterResolver(ClusterResolver):
    """A resolver reading TensorFlow's TF_CONFIG environment variable.

    ``task_type`` / ``task_id`` override TF_CONFIG's ``"task"`` (as in TensorFlow), and
    ``rpc_layer`` its ``"rpc_layer"``. ``environment`` replaces ``os.environ``, for tests.

    Without TF_CONFIG (or with an empty one, or ``{}``) this is a lone local task: an empty
    ClusterSpec and ``task_type`` None, as in TensorFlow. Otherwise the cluster must be a
    training cluster: jobs among chief, worker, ps and evaluator, at most one chief, at
    least one chief or worker, and a "task" naming one of its tasks (an evaluator need not
    be listed in the cluster). Anything else raises ClusterConfigError with the fix.
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, *,
                 rpc_layer: str | None = None,
                 environment: Mapping[str, str] | None = None) -> None:
        env = os.environ if environment is None else environment
        config = load_tf_config(env.get("TF_CONFIG"))
        if config and "cluster" not in config and "sparseCluster" in config:
            raise ClusterConfigError(
                'TF_CONFIG has a "sparseCluster" (a TFJob with enableDynamicWorker: true) but no '
                '"cluster": each task then knows only some addresses, and the coordinator of '
                "parameter-server training needs every worker's and ps's; remove "
                "enableDynamicWorker from the TFJob spec.")
        if config and "cluster" not in config:
            raise ClusterConfigError(
                f'TF_CONFIG has no "cluster": {sorted(config)} are its keys; add the addresses '
                f"of every task, like {_EXAMPLE}.")
        try:
            spec = ClusterSpec(config.get("cluster"))
        except ClusterConfigError as err:
            raise ClusterConfigError(f'TF_CONFIG "cluster": {err}') from None
        config_type, config_id = _task_of(config)
        if spec and config_type is None and (task_type is None or task_id is None):
            raise ClusterConfigError(
                'TF_CONFIG has no "task": add "task": {"type": "worker", "index": 0} naming '
                "this process's entry in \"cluster\" (or pass task_type and task_id).")
        _check_task_type(config_type, 'TF_CONFIG "task"')
        _check_task_type(task_type, "TFConfigClusterResolver(task_type=...)")
        task_type = config_type if task_type is None else task_type
        task_id = config_id if task_id is None else task_id
        unknown = [job for job in spec.jobs if job not in TASK_TYPES]
        if unknown:
            raise ClusterConfigError(
                f'TF_CONFIG "cluster": unknown job {unknown[0]!r}; the jobs of a training '
                f"cluster are {', '.join(repr(t) for t in TASK_TYPES)}"
                f"{_MASTER_HINT if unknown[0] == 'master' else ''}.")
        if spec and not any(job in spec.jobs for job in COLLECTIVE_JOBS):
            raise ClusterConfigError(
                f'TF_CONFIG "cluster" has no chief or worker (its jobs are {spec.jobs}); a '
                'training cluster needs at least one: add a "worker" list.')
        check_task(spec, task_type, task_id, source="TF_CONFIG")
        if rpc_layer is None:
            rpc_layer = config.get("rpc_layer")
        if rpc_layer is not None and not isinstance(rpc_layer, str):
            raise ClusterConfigError(
                f'TF_CONFIG: "rpc_layer" must be a string such as "grpc", got {rpc_layer!r}.')
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer or None)
        self._spec = spec

    def cluster_spec(self) -> ClusterSpec:
        return self._spec
