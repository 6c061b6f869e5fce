"""Where gloo listens: the interface of this task's own address in the cluster.

Besides the rendezvous store, gloo (torch.distributed's CPU backend) opens a listening
socket of its own for every process group, and by default binds it to the address the
host name resolves to -- on many hosts a routable one, also for a job whose cluster spec
says ``127.0.0.1``. Before the first group is created, :func:`bind_gloo` sets
``GLOO_SOCKET_IFNAME`` -- which torch's gloo backend reads each time it creates a group,
so later sub-groups (meshes, axes) follow it too -- to the interface of this process:

- with a cluster spec (TF_CONFIG), the interface that carries this task's address there;
  a loopback address (``127.0.0.1``, ``::1``, ``localhost``) means the loopback interface,
  so a local job listens on loopback only;
- under torchrun, the loopback interface when ``MASTER_ADDR`` is a loopback address (every
  process then runs on this host); otherwise torch's default, since torchrun names no
  address for the other ranks;
- a lone task (no cluster): the loopback interface, as it has no peers.

A ``GLOO_SOCKET_IFNAME`` the user set is kept as it is. A wildcard address ("0.0.0.0",
"[::]") for this task is refused: it would mean every interface. When no interface of this
host carries the task's address (a name that resolves elsewhere, a NAT), a warning says
that gloo listens where torch puts it and how to choose (``GLOO_SOCKET_IFNAME``).

gloo binds one address of the interface it is given (the first); an interface with
several addresses may therefore listen on another of them than the one in the spec, on the
same network.

Example::

    >>> from stratagem.cluster import ClusterSpec, SimpleClusterResolver
    >>> from stratagem.comm.binding import bind_gloo, interface_of
    >>> resolver = SimpleClusterResolver(ClusterSpec({"worker": ["127.0.0.1:2222"]}),
    ...                                  task_type="worker", task_id=0)
    >>> environ = {}
    >>> bind_gloo(resolver, "worker 0", environ) == interface_of("127.0.0.1") == environ["GLOO_SOCKET_IFNAME"]
    True
    >>> bind_gloo(resolver, "worker 0", {"GLOO_SOCKET_IFNAME": "eth1"})  # the user's choice stays
    'eth1'
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import MutableMapping
from typing import Any, Union

from stratagem.cluster.spec import is_wildcard_host
from stratagem.errors import ClusterConfigError, InvalidArgumentError

__all__ = ["GLOO_VARIABLE", "bind_gloo", "interface_of"]

#: The variable torch's gloo backend reads for the interface(s) to listen on.
GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
#: Holds the value stratagem set, so that it is told apart from one the user set.
_OWN_CHOICE = "STRATAGEM_GLOO_SOCKET_IFNAME"
_IFF_LOOPBACK = 0x8  # the same on Linux and macOS

logger = logging.getLogger("stratagem.comm")

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p),
                     ("flags", ctypes.c_uint), ("addr", ctypes.c_void_p),
                     ("netmask", ctypes.c_void_p), ("ifu", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def _sockaddr(pointer: int) -> Address | None:
    """The IPv4 or IPv6 address of a ``struct sockaddr``; None for other families."""
    head = ctypes.string_at(pointer, 2)
    # BSDs (macOS) start with a length byte; Linux has a 16-bit family in host order
    family = head[1] if sys.platform == "darwin" else int.from_bytes(head, sys.byteorder)
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(ctypes.string_at(pointer + 4, 4))
    if family == socket.AF_INET6:
        return ipaddress.IPv6Address(ctypes.string_at(pointer + 8, 16))
    return None


def _interfaces() -> list[tuple[str, Address, bool]]:
    """(interface name, address, is loopback) for every IP address of this host."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError):  # no getifaddrs (Windows): nothing known
        return []
    getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
    freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
    head = ctypes.POINTER(_IfAddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            address = _sockaddr(item.addr) if item.addr else None
            if address is not None and item.name:
                found.append((item.name.decode(errors="replace"), address,
                              bool(item.flags & _IFF_LOOPBACK)))
            entry = item.next
    finally:
        freeifaddrs(head)
    return found


def _resolve(host: str) -> list[Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def interface_of(host: str) -> str | None:
    """The name of this host's network interface that carries ``host``'s address.

    ``host`` is an IP address or a name (resolved); a loopback address gives the loopback
    interface. None when no interface here has it.

    >>> interface_of("127.0.0.1") == interface_of("localhost") is not None
    True
    >>> interface_of("203.0.113.77") is None   # a documentation address: on no interface here
    True
    """
    addresses = _resolve(host.strip("[]"))
    interfaces = _interfaces()
    for address in addresses:
        for name, own, _ in interfaces:
            if own == address:
                return name
    if any(address.is_loopback for address in addresses):
        return next((name for name, _, loopback in interfaces if loopback), None)
    return None


def _own_address(resolver: Any) -> tuple[str | None, str]:
    """This task's "host:port" and where it comes from; None for a lone task."""
    try:
        spec = resolver.cluster_spec()
    except InvalidArgumentError:  # torchrun: only the rendezvous address is known
        return resolver.chief_address, "torchrun's MASTER_ADDR"
    if not spec:
        return None, "no cluster"
    return spec.task_address(resolver.task_type, resolver.task_id), "the cluster spec"


def bind_gloo(resolver: Any, task: str,
              environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point gloo at the interface of this task's address; returns the interface chosen.

    Sets ``GLOO_SOCKET_IFNAME`` in ``environ`` (default ``os.environ``) unless the user set
    it (then returns the user's value). Returns None when the interface is left to torch
    (its default: the address the host name resolves to). Raises ClusterConfigError for a
    wildcard address of this task. ``task`` names it in messages ("worker 1").
    """
    env = os.environ if environ is None else environ
    address, source = _own_address(resolver)
    host = None if address is None else address.rpartition(":")[0].strip("[]")
    if host is not None and source == "the cluster spec" and is_wildcard_host(host):
        raise ClusterConfigError(
            f"{task}'s address {address!r} in the cluster spec means every interface: its gloo "
            f"sockets (and the chief's rendezvous store) would accept connections from any host "
            f"that reaches this one. Give the task's own address instead: loopback "
            f"'127.0.0.1:PORT' for a local cluster (the default of `stratagem launch --host`), "
            f"else the address the other tasks reach this host at.")
    chosen = env.get(GLOO_VARIABLE, "")
    if chosen and chosen != env.get(_OWN_CHOICE):
        logger.info("%s: gloo listens on interface %s, as GLOO_SOCKET_IFNAME says", task, chosen)
        return chosen
    if host is None:  # a lone task: no peers, loopback only
        host = "127.0.0.1"
    addresses = _resolve(host)
    interface = None
    if source != "torchrun's MASTER_ADDR" or any(a.is_loopback for a in addresses):
        interface = interface_of(host)
    if interface is None:
        if env.get(_OWN_CHOICE) is not None:  # an earlier choice of ours no longer holds
            env.pop(GLOO_VARIABLE, None)
            env.pop(_OWN_CHOICE, None)
        if source == "torchrun's MASTER_ADDR":
            logger.info("%s: gloo listens on the address the host name resolves to (torchrun "
                        "names no address for this rank; GLOO_SOCKET_IFNAME chooses one)", task)
        else:
            logger.warning(
                "%s: no network interface of this host has the address %r that %s gives "
                "this task, so gloo listens on the address the host name %r resolves to; set "
                "GLOO_SOCKET_IFNAME to the interface the other workers reach this host on",
                task, address, source, socket.gethostname())
        return None
    env[GLOO_VARIABLE] = env[_OWN_CHOICE] = interface
    logger.info("%s: gloo listens on interface %s, which has %s", task, interface, host)
    return interface
