"""The torch.distributed process group joining the workers of a cluster.

:class:`WorkerGroup` is set up from a cluster resolver: gloo for CPU replicas, NCCL
for CUDA ones (``CommunicationOptions.implementation``), the rendezvous at the
chief's address (torchrun's MASTER_ADDR:MASTER_PORT under torchrun), and an explicit
timeout so that a peer that stops answering is noticed (gloo's default is 30 min).

Every collective runs inside :meth:`WorkerGroup.guard`, which turns the backend's
failure into :class:`~stratagem.errors.UnavailableError` naming the lost task. The
lost task is found through heartbeats: each worker's heartbeat thread stamps a
counter in the rendezvous store every second and reads everyone's counters back;
after a failure, the task whose counter stopped moving is the one that died or hung,
and if the heartbeat's reads stopped coming back, the store -- the chief -- is the
lost one. Only the heartbeat thread waits on the store: a store whose process is
stopped (SIGSTOP) never answers, and torch's TCPStore then blocks past its timeout, so
the caller of the failed collective never asks it anything and raises within the
timeout plus ~2.5 heartbeats. A heartbeat that cannot reach the store logs one
warning with the reason and stops; the next failed collective's error repeats it.

**Where the store listens.** With a cluster spec (TF_CONFIG), the chief builds the
rendezvous ``TCPStore`` itself, on a socket bound to the chief's address from the
spec and nothing else (torch's ``tcp://`` rendezvous would listen on every interface,
``*:PORT``): a loopback cluster exposes nothing beyond the host. Under torchrun
(``env://``) the store is torchrun's -- its agent's, or rank 0's -- and listens where
torchrun and torch put it; a process group initialised before the strategy keeps the
store it was given.

**What is not authenticated.** The synchronous path has no authentication at all:
anyone who can reach the store's port can read and overwrite its keys (rendezvous
addresses, heartbeats) or take a rank's place at the rendezvous, and gloo's (or
NCCL's) connections between the workers carry tensors unauthenticated and
unencrypted. The cluster token that guards parameter-server traffic
(``STRATAGEM_CLUSTER_TOKEN``) does not cover it. Run multi-worker training only on a
network that only the cluster's hosts can reach.

**Where gloo listens.** Before the first group, :func:`~stratagem.comm.binding.bind_gloo`
points gloo at the interface of this task's address in the cluster spec (loopback for a
loopback cluster), unless ``GLOO_SOCKET_IFNAME`` is set; a wildcard address is refused.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import logging
import socket
import threading
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from stratagem.cluster.joined import mark_joined
from stratagem.comm import agreement
from stratagem.comm.binding import bind_gloo
from stratagem.comm.gloo_threads import REST_SECONDS, bring_to_rest
from stratagem.comm.options import CommunicationImplementation, CommunicationOptions
from stratagem.errors import InvalidArgumentError, UnavailableError
from stratagem.observe import flight, hang_report

DEFAULT_TIMEOUT_SECONDS = 180.0
HEARTBEAT_SECONDS = 1.0

logger = logging.getLogger("stratagem.comm")


def task_names(resolver: Any) -> list[str]:
    """The task name of every rank: chief first, then workers in index order."""
    try:
        spec = resolver.cluster_spec()
    except InvalidArgumentError:  # torchrun: every process is a worker named by its rank
        return [f"worker {r}" for r in range(resolver.num_workers)]
    names = [f"chief {i}" if spec.num_tasks("chief") > 1 else "chief"
             for i in range(spec.num_tasks("chief"))] if "chief" in spec.jobs else []
    if "worker" in spec.jobs:
        names += [f"worker {i}" for i in range(spec.num_tasks("worker"))]
    return names or ["worker 0"]


class WorkerGroup:
    """One process's membership of the workers' collective."""

    peers = ""   # its members in a few words, for the flight recorder (set by __init__)

    def __init__(self, resolver: Any, options: CommunicationOptions, uses_cuda: bool):
        rank = resolver.worker_rank
        if rank is None:
            raise InvalidArgumentError(
                f"this task is {resolver.task_type!r} {resolver.task_id}, which takes no part in "
                f"synchronous training; only the chief and the workers run "
                f"MultiWorkerMirroredStrategy (an evaluator uses its own local strategy)")
        self.rank = rank
        self.world_size = resolver.num_workers
        self.names = task_names(resolver)
        self.peers = peers_of(self.names)   # how the flight recorder names this group
        bind_gloo(resolver, self.names[rank])  # before any group, the lone one included
        self.timeout = options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self.backend = _backend(options.implementation, uses_cuda)
        self._stop = threading.Event()
        self.heartbeat_failure: str | None = None  # why this task's heartbeat stopped, if it did
        # (time.monotonic(), every rank's counter) as the heartbeat last read them, newest last
        self._snapshots: collections.deque[tuple[float, list[bytes]]] = collections.deque(maxlen=8)
        self._lost_chief = False  # a collective failed and the store stopped answering
        self._failed = False  # a collective failed: gloo's threads may wait on the lost task
        self._store_failed_at = 0.0  # time.monotonic() of the heartbeat's last failed read
        # NCCL moves CUDA tensors only: small host-side values travel through this device
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self.solo = self.world_size == 1
        if self.solo:  # a lone worker: nothing to join, every collective is the identity
            self.group = None
            return
        _import_before_groups()
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != rank:
                raise InvalidArgumentError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the cluster says rank {rank} of {self.world_size}")
            self.group = dist.new_group(backend=self.backend, timeout=datetime.timedelta(seconds=self.timeout))
        else:
            address = resolver.chief_address
            timeout = datetime.timedelta(seconds=self.timeout)
            try:
                if type(resolver).__name__ == "TorchrunClusterResolver":  # torchrun's store
                    dist.init_process_group(self.backend, init_method="env://", rank=rank,
                                            world_size=self.world_size, timeout=timeout)
                else:
                    store = rendezvous_store(address, rank, self.world_size, timeout)
                    dist.init_process_group(self.backend, store=store, rank=rank,
                                            world_size=self.world_size, timeout=timeout)
            except Exception as error:  # noqa: BLE001 - every rendezvous failure means the same
                raise UnavailableError(
                    f"{self.names[rank]} could not meet the other workers at {address} within "
                    f"{self.timeout:g} s ({type(error).__name__}: {error}); check that every task "
                    f"was started with the same cluster description and that {address} is "
                    f"reachable", task=self.names[0]) from error
            self.group = None  # the default group
        self._store = dist.distributed_c10d._get_default_store()
        mark_joined(self.names[rank])
        self._beats = 0
        self._beat()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat, daemon=True, name="stratagem-heartbeat")
        self._heartbeat_thread.start()
        # Every group, a later strategy's sub-group too: its heartbeat must be joined and the default
        # group left before the interpreter finalizes (a daemon thread still inside the store's C++
        # code then aborts the process). atexit runs the latest first: a sub-group before the default.
        atexit.register(self.close)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # --------------------------------------------------------------- failures

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"stratagem/heartbeat/{self.rank}", str(self._beats))

    def _heartbeat(self) -> None:
        keys = [f"stratagem/heartbeat/{r}" for r in range(self.world_size)]
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._beat()
            except Exception as error:  # noqa: BLE001 - any failure ends the heartbeat: say so
                if self._stop.is_set():  # closing: the store went away with the group
                    return
                first_line = (str(error).splitlines() or [""])[0]
                self.heartbeat_failure = (f"{self.names[self.rank]}'s heartbeat stopped at "
                                          f"{time.strftime('%H:%M:%S')} ({type(error).__name__}: "
                                          f"{first_line})")
                logger.warning(
                    "%s; the rendezvous store on %s could not be reached, and the other workers "
                    "will take %s for lost at their next failed collective",
                    self.heartbeat_failure, self.names[0], self.names[self.rank])
                return
            try:
                self._snapshots.append((time.monotonic(), self._store.multi_get(keys)))
            except Exception:  # noqa: BLE001 - the store refused a read: _lost_tasks sees it
                self._store_failed_at = time.monotonic()

    def _lost_tasks(self) -> list[str]:
        """Tasks whose heartbeat stopped moving; the chief if the store stopped answering.

        Waits until the heartbeat has read everyone's counters twice, at least 1.5
        heartbeats apart, since the failure (at most 3.5 heartbeats).
        """
        failed_at = time.monotonic()
        deadline = failed_at + 3.5 * HEARTBEAT_SECONDS
        while True:
            since = [snapshot for snapshot in list(self._snapshots) if snapshot[0] > failed_at]
            if len(since) >= 2 and since[-1][0] - since[0][0] >= 1.5 * HEARTBEAT_SECONDS:
                break
            # The store lives on the chief: it is gone (a read failed, or the heartbeat
            # stopped) or hung (no read came back in time).
            if (self._store_failed_at > failed_at or self.heartbeat_failure is not None
                    or time.monotonic() > deadline):
                self._lost_chief = True
                return [self.names[0]]
            time.sleep(HEARTBEAT_SECONDS / 10)
        first, last = since[0][1], since[-1][1]
        return [self.names[r] for r in range(self.world_size) if r != self.rank and first[r] == last[r]]

    @contextlib.contextmanager
    def guard(self, what: str, nbytes: int = 0, *, record: bool = True, peers: str = "") -> Iterator[None]:
        """Turn a collective's failure into UnavailableError naming the lost task; the flight
        recorder records the collective (``nbytes`` moved) unless ``record`` is False."""
        seq = flight.begin(what, nbytes, peers or self.peers) if record else 0
        try:
            yield
        except UnavailableError:
            raise
        except (RuntimeError, dist.DistBackendError, ConnectionError) as error:
            self._failed = True   # (collectives may still wait on the lost task: close() does not wait long)
            lost = self._lost_tasks()
            who = ", ".join(lost) if lost else "a peer"
            heartbeat = f"; earlier, {self.heartbeat_failure}" if self.heartbeat_failure else ""
            first_line = (str(error).splitlines() or [""])[0]
            raise UnavailableError(
                f"{what} failed on {self.names[self.rank]}: {who} stopped answering "
                f"(timeout {self.timeout:g} s; {type(error).__name__}: {first_line}{heartbeat}). "
                f"The other workers cannot continue without it: restart the job (stratagem launch "
                f"--max-restarts) and restore from the last checkpoint. Where the tasks stand:\n"
                f"{hang_report.report(self.names[self.rank])}",
                task=lost[0] if lost else None) from error
        finally:
            if seq:
                flight.end(seq)

    # ------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, what: str = "all_reduce", *, op: str = "sum") -> torch.Tensor:
        """Sum (``op="max"``: the maximum of) ``tensor`` over the workers, in place."""
        if self.solo:
            return tensor
        carrier = tensor if tensor.device == self.device else tensor.to(self.device)
        with self.guard(what, carrier.nbytes):
            dist.all_reduce(carrier, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        if carrier is not tensor:
            tensor.copy_(carrier)
        return tensor

    def broadcast(self, tensor: torch.Tensor, what: str = "broadcast") -> torch.Tensor:
        if self.solo:
            return tensor
        carrier = tensor if tensor.device == self.device else tensor.to(self.device)
        with self.guard(what, carrier.nbytes):
            dist.broadcast(carrier, src=self._global(0), group=self.group)
        if carrier is not tensor:
            tensor.copy_(carrier)
        return tensor

    def all_gather_object(self, obj: Any, what: str = "all_gather") -> list[Any]:
        """Every worker's picklable ``obj``, in worker order; every worker must be making the same
        call (``what``: :mod:`~stratagem.comm.agreement` checks it)."""
        if self.solo:
            return [obj]
        return agreement.all_gather_object(self, obj, what)

    def broadcast_object(self, obj: Any, what: str = "broadcast", *, src: int = 0) -> Any:
        """Worker ``src``'s picklable ``obj`` (the chief's by default) on every worker."""
        if self.solo:
            return obj
        return agreement.broadcast_object(self, obj, what, src)

    def global_rank(self, rank: int) -> int:
        """The torch.distributed rank of worker ``rank`` (they differ in a sub-group)."""
        return self._global(rank)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def close(self) -> None:
        """Stop the heartbeat and leave the process group (idempotent)."""
        self._stop.set()
        # A daemon thread still inside the store's C++ code when the interpreter shuts down
        # aborts the process ("terminate called without an active exception"): join it.
        # If the chief's store stopped answering, the thread may be blocked in it for good
        # (torch's TCPStore waits past its timeout for a stopped server): a short wait then.
        thread = getattr(self, "_heartbeat_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=HEARTBEAT_SECONDS if getattr(self, "_lost_chief", False) else 5.0)
        # gloo's threads outlive the groups (a sharded model holds them): they must have let go of every
        # collective before the interpreter finalizes, or one may abort the process (gloo_threads.py);
        # after a failure, some may wait on the lost task until gloo's timeout: a moment then, quietly
        failed = self._failed or self.heartbeat_failure is not None
        bring_to_rest(1.0 if failed else REST_SECONDS, warn=not failed)
        if self.group is None and not self.solo and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already; nothing left to do
                pass


def _import_before_groups() -> None:
    """Import ``torch.distributed._shard`` before this process has a group.

    Imported while a default group exists (FSDP, ``torch.distributed.checkpoint`` and pipelining
    import it, and stratagem imports them when a model or optimizer is placed), it keeps that group
    alive past ``destroy_process_group()``: gloo's threads then outlive :meth:`WorkerGroup.close`,
    and one of them, releasing a finished collective's tensors while the interpreter finalizes,
    aborts the process after a successful run ("terminate called without an active exception":
    up to one run in ten of a short job on a busy machine). Imported first, it holds no group
    (10 ms). A group the program made itself before the strategy is kept if it already imported it."""
    import torch.distributed._shard  # noqa: F401


def peers_of(names: list[str]) -> str:
    """A group's members in a few words: ``"chief, worker 0"``, or ``"8 tasks (chief .. worker 6)"``."""
    return ", ".join(names) if len(names) <= 4 else f"{len(names)} tasks ({names[0]} .. {names[-1]})"


def rendezvous_store(address: str, rank: int, world_size: int,
                     timeout: datetime.timedelta) -> dist.TCPStore:
    """The workers' rendezvous store, listening only on the chief's ``address``.

    Rank 0 (the chief) serves it from a socket it binds to ``address`` itself: torch's own
    ``tcp://`` rendezvous binds ``*:PORT`` whatever the host. The other ranks connect to
    it, retrying until ``timeout`` while the chief starts.
    """
    host, _, port_text = address.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store does
        listener.bind(sockaddr)
    except OSError:
        listener.close()
        raise
    # The store owns the descriptor from here (it listens on it and closes it with itself).
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


def _backend(implementation: CommunicationImplementation, uses_cuda: bool) -> str:
    if implementation is CommunicationImplementation.NCCL:
        if not uses_cuda:
            raise InvalidArgumentError(
                "CommunicationImplementation.NCCL needs CUDA devices, but this worker's replicas "
                "are on the CPU; use RING (gloo) or AUTO")
        if not dist.is_nccl_available():
            raise InvalidArgumentError("this PyTorch build has no NCCL; use RING (gloo) or AUTO")
        return "nccl"
    if implementation is CommunicationImplementation.RING:
        return "gloo"
    return "nccl" if uses_cuda and dist.is_nccl_available() else "gloo"

