"""ParameterServerClient: the ParameterServer's methods, called over RPC.

The coordinator and the workers hold one client per ps task. ``client.call(method,
**kwargs)`` runs the :class:`~stratagem.ps.service.ParameterServer` method of that name on
the ps with those keyword arguments; errors come back as :class:`stratagem.rpc.RemoteError`
(an argument the ps refused: its ``remote_exception`` is the ps's ``InvalidArgumentError``)
and a dead or silent ps raises :class:`stratagem.errors.UnavailableError` naming it.
:func:`call_each` talks to several parameter servers at once.

Example::

    >>> import torch
    >>> from stratagem.ps import ParameterServer, ParameterServerClient
    >>> from stratagem.rpc import RpcServer
    >>> import secrets
    >>> token = secrets.token_urlsafe(32)
    >>> server = RpcServer("127.0.0.1:0", ParameterServer(name="ps 0").handlers(), token).start()
    >>> client = ParameterServerClient(server.address, token, task="ps 0")
    >>> client.call("create", var_id="dense/kernel", value=torch.zeros(2, 2),
    ...             optimizer_spec=(torch.optim.SGD, {"lr": 0.5}))
    >>> client.call("push", grads={"dense/kernel": torch.ones(2, 2)})
    >>> client.call("pull", var_ids=["dense/kernel"])["dense/kernel"]
    tensor([[-0.5000, -0.5000],
            [-0.5000, -0.5000]])
    >>> client.close(); server.stop()
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stratagem.ps.ownership import CHANGES
from stratagem.ps.traffic import PsTraffic
from stratagem.rpc.client import RpcClient
from stratagem.rpc.transport import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S

__all__ = ["ParameterServerClient", "call_each"]


class ParameterServerClient:
    """Calls the :class:`~stratagem.ps.ParameterServer` of the ps task at ``address``.

    ``task`` ("ps 0") names it in errors, and the server there must go by that name (see
    :class:`~stratagem.rpc.client.RpcClient`); without it, any server is accepted.
    ``coordinator``: the id of the coordinator this client speaks for; requests that change
    the ps name it (a ps owned by a coordinator refuses the others', see
    :mod:`stratagem.ps.ownership`). ``traffic``: the counters each call adds its tensor bytes
    and time to (a worker's, see :mod:`stratagem.ps.traffic`).
    """

    def __init__(self, address: str, token: str, *, task: str | None = None,
                 default_timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, coordinator: str | None = None,
                 traffic: PsTraffic | None = None) -> None:
        self.rpc = RpcClient(address, token, task=task, default_timeout=default_timeout,
                             max_message_bytes=max_message_bytes)
        self.coordinator = coordinator
        self.traffic = traffic

    @property
    def task(self) -> str:
        return self.rpc.task

    def __repr__(self) -> str:
        return f"ParameterServerClient({self.rpc.address!r}, task={self.task!r})"

    def call(self, method: str, *, timeout: float | None = None, writable_reply: bool = True,
             **kwargs: Any) -> Any:
        """Runs ``method(**kwargs)`` on the ps and returns its result (``writable_reply``:
        see :meth:`stratagem.rpc.RpcClient.call`)."""
        if self.coordinator is not None and method in CHANGES:
            kwargs.setdefault("coordinator", self.coordinator)
        traffic = self.traffic
        if traffic is None:
            return self.rpc.call(method, kwargs, timeout=timeout, writable_reply=writable_reply)
        traffic.begin(kwargs)
        reply = None
        try:
            reply = self.rpc.call(method, kwargs, timeout=timeout, writable_reply=writable_reply)
            return reply
        finally:
            traffic.end(reply)

    def wait_ready(self, timeout: float = 10.0) -> None:
        self.rpc.wait_ready(timeout)

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> ParameterServerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """The threads that run call_each's background calls (started on first use, as needed)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="stratagem-ps-call")
        return _pool


def call_each(calls: Sequence[tuple[ParameterServerClient, str, Mapping[str, Any]]], *,
              timeout: float | None = None, writable_reply: bool = True) -> list[Any]:
    """Runs ``client.method(**kwargs)`` for each ``(client, method, kwargs)`` at once; their results in order.

    ``writable_reply=False``: the caller only reads the tensors of the results (copies them
    into its own), so they need not be copied out of the received bytes first.

    All calls but the last run as blocking calls on a shared pool of threads that live as
    long as the process; the last runs in this thread, which then waits for the others. (A
    gRPC future would start a polling thread whenever none is running -- one per step on a
    worker talking to two parameter servers, measured at about a sixth of its step rate.)
    Every call is waited for before the first error, in call order, is raised; each has its
    deadline, so none can hold a pool thread for longer.

    Example::

        >>> import torch
        >>> from stratagem.ps import ParameterServer, ParameterServerClient, call_each
        >>> from stratagem.rpc import RpcServer
        >>> import secrets; token = secrets.token_urlsafe(32)
        >>> servers = [RpcServer("127.0.0.1:0", ParameterServer().handlers(), token).start() for _ in range(2)]
        >>> clients = [ParameterServerClient(s.address, token, task=f"ps {i}") for i, s in enumerate(servers)]
        >>> call_each([(c, "create", {"var_id": "v", "value": torch.full((2,), float(i))})
        ...            for i, c in enumerate(clients)])
        [None, None]
        >>> [out["v"] for out in call_each([(c, "pull", {"var_ids": ["v"]}) for c in clients])]
        [tensor([0., 0.]), tensor([1., 1.])]
        >>> for c in clients: c.close()
        >>> for s in servers: s.stop()
    """
    if not calls:
        return []
    pending = [_background().submit(client.call, method, timeout=timeout,
                                    writable_reply=writable_reply, **kwargs)
               for client, method, kwargs in calls[:-1]]
    client, method, kwargs = calls[-1]
    outcomes: list[tuple[bool, Any]] = []
    try:
        last: tuple[bool, Any] = (True, client.call(method, timeout=timeout,
                                                    writable_reply=writable_reply, **kwargs))
    except Exception as error:  # noqa: BLE001 - raised below, after the others finished
        last = (False, error)
    for future in pending:
        try:
            outcomes.append((True, future.result()))
        except Exception as error:  # noqa: BLE001
            outcomes.append((False, error))
    outcomes.append(last)
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]
