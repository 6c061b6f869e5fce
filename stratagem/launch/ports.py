"""Ports for a local cluster: free ones picked by the kernel, or a block from a base port.

A local launch gives every task its own loopback port. :func:`free_ports` asks the kernel
for ports nobody listens on (it binds port 0 and releases the socket); :func:`ports_from_base`
takes a consecutive block and checks that each is free. Either way the port is released
before the task binds it, so another program could take it in between: the window is the
few milliseconds of a process start, and a task that loses the race fails at start-up
(and is restarted with ``--max-restarts``) rather than talking to a stranger.

Example::

    >>> from stratagem.launch.ports import free_ports, format_address
    >>> ports = free_ports(3)
    >>> len(set(ports)) == 3 and all(0 < port < 65536 for port in ports)
    True
    >>> format_address("127.0.0.1", 2222), format_address("::1", 2222)
    ('127.0.0.1:2222', '[::1]:2222')
"""

from __future__ import annotations

import socket

from stratagem.errors import ClusterConfigError

__all__ = ["format_address", "free_ports", "ports_from_base"]

MAX_PORT = 65535


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets as TF_CONFIG writes it."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _socket_for(host: str) -> tuple[socket.socket, str]:
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM), bare


def _cannot_bind(host: str, port: int, err: OSError) -> ClusterConfigError:
    if port == 0:
        return ClusterConfigError(
            f"cannot listen on host {host!r}: {err.strerror or err}; a local launch needs an "
            "address of this machine, normally the loopback address '127.0.0.1' (--host).")
    return ClusterConfigError(
        f"port {port} on {host!r} is not free ({err.strerror or err}); choose another "
        "--port-base, or leave it out to let the launcher pick free ports.")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports on ``host`` that nothing listens on right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):  # all held open at once, so the kernel gives distinct ports
            sock, bare = _socket_for(host)
            sockets.append(sock)
            sock.bind((bare, 0))
        return [sock.getsockname()[1] for sock in sockets]
    except OSError as err:
        raise _cannot_bind(host, 0, err) from None
    finally:
        for sock in sockets:
            sock.close()


def ports_from_base(base: int, count: int, host: str = "127.0.0.1") -> list[int]:
    """The ports ``base, base + 1, ...`` (``count`` of them), each checked to be free."""
    last = base + count - 1
    if base < 1 or last > MAX_PORT:
        raise ClusterConfigError(
            f"--port-base {base} gives {count} task(s) the ports {base}..{last}, outside 1..{MAX_PORT}; "
            f"choose a base from 1 to {MAX_PORT - count + 1}.")
    ports = list(range(base, last + 1))
    for port in ports:
        sock, bare = _socket_for(host)
        # SO_REUSEADDR, as servers set it: a port in TIME_WAIT counts as free, a listener not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bare, port))
        except OSError as err:
            raise _cannot_bind(host, port, err) from None
        finally:
            sock.close()
    return ports
