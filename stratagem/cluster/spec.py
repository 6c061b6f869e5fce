"""ClusterSpec: the jobs of a cluster and the address of every task in them.

A cluster is a set of named *jobs* ("chief", "worker", "ps", "evaluator"), each a list of
*tasks*; a task is one process, known by its ``(task_type, task_id)`` -- its job name and its
index in the job -- and reachable at one "host:port" address. The vocabulary is
TensorFlow's; a ClusterSpec is only a validated, immutable table of addresses and knows
nothing of roles (which task is chief is the resolver's business, see ``resolver.py``).

Example::

    >>> from stratagem.cluster import ClusterSpec
    >>> spec = ClusterSpec({"chief": ["10.0.0.1:2222"],
    ...                     "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]})
    >>> spec.jobs
    ['chief', 'worker']
    >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
    (2, '10.0.0.3:2222')
    >>> sparse = ClusterSpec({"worker": {1: "10.0.0.3:2222"}})   # TensorFlow's {index: address} form
    >>> sparse.job_tasks("worker")
    [None, '10.0.0.3:2222']
    >>> ClusterSpec({"worker": ["localhost"]})
    Traceback (most recent call last):
    ...
    stratagem.errors.ClusterConfigError: 'worker' task 0: expected 'host:port', got 'localhost'; ...
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Union

from stratagem.errors import ClusterConfigError, InvalidArgumentError

__all__ = ["ClusterSpec", "is_wildcard_host", "validate_address"]

# Job names end up in device strings ("/job:worker/task:0"), hence TensorFlow's rule for them.
_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# A host name or an IPv4 address; IPv6 addresses come in brackets and are checked separately.
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")

Tasks = Union[Sequence[str], Mapping[Union[int, str], str]]


def validate_address(address: object, where: str) -> str:
    """Returns ``address`` if it is "host:port" (or "[ipv6]:port"), else raises.

    ``where`` names the task in the message, e.g. ``"'worker' task 1"``.
    """
    example = "'localhost:2222', '10.0.0.2:2222' or '[::1]:2222'"
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"{where}: expected a 'host:port' string, got {address!r} "
            f"({type(address).__name__}); write it like {example}.")
    if "://" in address:
        raise ClusterConfigError(
            f"{where}: {address!r} has a scheme; drop "
            f"{address.split('://')[0] + '://'!r} and give just 'host:port' (the protocol is "
            "the resolver's rpc_layer).")
    if address.startswith("["):
        close = address.find("]")
        host, port = address[1:close], address[close + 1:]
        if close < 0 or not port.startswith(":"):
            raise ClusterConfigError(
                f"{where}: expected '[ipv6]:port', got {address!r}; write it like '[::1]:2222'.")
        port = port[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(
                f"{where}: {host!r} in {address!r} is not an IPv6 address; brackets are "
                f"only for IPv6, write other hosts without them, like {example}.") from None
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not host:
            raise ClusterConfigError(
                f"{where}: expected 'host:port', got {address!r}; add the host and the port, "
                f"like {example}.")
        if ":" in host:
            raise ClusterConfigError(
                f"{where}: {address!r} looks like an IPv6 address without brackets; write the "
                f"host in brackets, like '[{host}]:{port}'.")
        if not _HOST_NAME.fullmatch(host):
            raise ClusterConfigError(
                f"{where}: host {host!r} in {address!r} is not a host name or IP address "
                "(letters, digits, '.', '-' and '_' only).")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ClusterConfigError(
            f"{where}: port {port!r} in {address!r} is not an integer from 0 to 65535; "
            f"write it like {example}.")
    return address


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` (of a "host:port"; brackets allowed) means every interface.

    >>> [is_wildcard_host(h) for h in ("0.0.0.0", "[::]", "0", "127.0.0.1", "localhost")]
    [True, True, True, False, False]
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        pass
    if not bare.replace(".", "").isalnum():
        return False
    try:  # the short forms the socket calls accept: "0", "0.0", "0x0"
        return socket.inet_aton(bare) == bytes(4)
    except OSError:
        return False


def _task_index(key: object, job: str) -> int:
    # JSON object keys are always strings, so {"1": "host:port"} from TF_CONFIG means task 1.
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise ClusterConfigError(
        f"job {job!r}: task index {key!r} is not a non-negative integer; in the "
        "{index: address} form write keys like 0, 1 (or \"0\", \"1\" in JSON).")


def _parse_tasks(job: str, tasks: object) -> dict[int, str]:
    if isinstance(tasks, Mapping):
        items = [(_task_index(key, job), address) for key, address in tasks.items()]
    elif isinstance(tasks, Sequence) and not isinstance(tasks, (str, bytes)):
        items = list(enumerate(tasks))
    else:
        hint = f" write [{tasks!r}]" if isinstance(tasks, str) else " write ['host:port', ...]"
        raise ClusterConfigError(
            f"job {job!r}: expected a list of 'host:port' addresses or a dict "
            f"{{index: address}}, got {tasks!r} ({type(tasks).__name__});{hint}.")
    parsed: dict[int, str] = {}
    for index, address in items:
        if index in parsed:
            raise ClusterConfigError(
                f"job {job!r}: task {index} is given twice; give each index once.")
        parsed[index] = validate_address(address, where=f"{job!r} task {index}")
        if int(parsed[index].rpartition(":")[2]) == 0:
            raise ClusterConfigError(
                f"{job!r} task {index}: port 0 in {address!r} is not a real port (it asks the "
                "system for any free one, which the other tasks cannot know); give the port "
                "the task listens on, like 'host:2222'.")
    return dict(sorted(parsed.items()))


_LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


def _same_address_key(address: str) -> tuple[str, int]:
    """What makes two valid addresses one host:port: ``(host, port)`` with the host in one
    spelling -- lower case, IP addresses in their canonical form, and ``localhost``,
    ``127.0.0.1``, ``[::1]`` and the other spellings of this host's loopback interface as one
    (a client given ``localhost:2222`` may reach the task listening on ``127.0.0.1:2222``)."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") else host
    host = host.lower().rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ("loopback" if host in _LOOPBACK_NAMES else host), int(port)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")):
        return "loopback", int(port)
    return str(ip), int(port)


def _parse_cluster(cluster: object) -> Mapping[str, Mapping[int, str]]:
    if cluster is None:
        return MappingProxyType({})
    if not isinstance(cluster, Mapping):
        raise ClusterConfigError(
            f"a cluster must be a dict from job name to addresses, like "
            f"{{'worker': ['host1:2222', 'host2:2222']}}; got {type(cluster).__name__} "
            f"{cluster!r}.")
    jobs: dict[str, Mapping[int, str]] = {}
    owners: dict[tuple[str, int], tuple[str, str]] = {}  # same-address key -> (task, address)
    for job, tasks in cluster.items():
        if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
            raise ClusterConfigError(
                f"job name {job!r} ({type(job).__name__}) is not valid; job names are strings "
                "of letters, digits and '_' starting with a letter, like 'worker' or 'ps'.")
        parsed = _parse_tasks(job, tasks)
        for index, address in parsed.items():
            task = f"{job!r} task {index}"
            owner, first = owners.setdefault(_same_address_key(address), (task, address))
            if owner != task:
                spelled = ("" if first.lower() == address.lower() else
                           f" (as {first!r} and {address!r}: two spellings of one host:port)")
                raise ClusterConfigError(
                    f"address {address!r} is given to both {owner} and {task}{spelled}; "
                    "every task needs its own host:port -- change the port of one of them.")
        jobs[job] = MappingProxyType(parsed)
    return MappingProxyType(dict(sorted(jobs.items())))


class ClusterSpec:
    """An immutable, validated map from job name to the addresses of its tasks.

    Built from a dict ``{job: ["host:port", ...]}`` or ``{job: {index: "host:port"}}``
    (TensorFlow's sparse form, for clusters where a task knows only some addresses), or
    from another ClusterSpec; ``ClusterSpec()`` is the empty cluster of a lone local task.
    Malformed input raises :class:`~stratagem.errors.ClusterConfigError`.
    """

    __slots__ = ("_jobs",)
    _jobs: Mapping[str, Mapping[int, str]]

    def __init__(self, cluster: ClusterSpec | Mapping[Any, Tasks] | None = None) -> None:
        jobs = cluster._jobs if isinstance(cluster, ClusterSpec) else _parse_cluster(cluster)
        object.__setattr__(self, "_jobs", jobs)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ClusterSpec is immutable; build a new one from as_dict().")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("ClusterSpec is immutable; build a new one from as_dict().")

    def __reduce__(self) -> tuple[type[ClusterSpec], tuple[dict[str, Any]]]:
        return (ClusterSpec, (self.as_dict(),))

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def _tasks(self, job: str) -> Mapping[int, str]:
        try:
            return self._jobs[job]
        except KeyError:
            raise InvalidArgumentError(
                f"no job {job!r} in this cluster; its jobs are {self.jobs}.") from None

    def num_tasks(self, job: str) -> int:
        """How many tasks ``job`` has (in the sparse form: how many addresses are known)."""
        return len(self._tasks(job))

    def task_indices(self, job: str) -> list[int]:
        """The indices of the tasks of ``job``, sorted."""
        return list(self._tasks(job))

    def task_address(self, job: str, index: int) -> str:
        """The "host:port" of task ``index`` of ``job``."""
        tasks = self._tasks(job)
        if index not in tasks:
            raise InvalidArgumentError(
                f"job {job!r} has no task {index!r}; its task indices are {list(tasks)}.")
        return tasks[index]

    def job_tasks(self, job: str) -> list[str | None]:
        """The addresses of ``job`` by index, ``None`` where the sparse form leaves a gap."""
        tasks = self._tasks(job)
        size = max(tasks, default=-1) + 1
        return [tasks.get(index) for index in range(size)]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A plain dict: a list per dense job, an ``{index: address}`` dict per sparse one."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            result[job] = list(tasks.values()) if dense else dict(tasks)
        return result

    def _key(self) -> tuple[tuple[str, tuple[tuple[int, str], ...]], ...]:
        return tuple((job, tuple(tasks.items())) for job, tasks in self._jobs.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"
