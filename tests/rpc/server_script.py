"""An RpcServer in a process of its own, for the transport tests.

    python server_script.py ADDRESS MARKER_DIR NAME [MAX_MESSAGE_BYTES]

Serves as server NAME ("ps 0"). Prints ``READY <address> <incarnation>`` once it serves, and
stops on SIGTERM. Every handler that runs first creates a file ``handler-<name>-<n>`` in
MARKER_DIR, so a test can prove that a refused request never reached one; the log goes to
MARKER_DIR/server.log. The token is STRATAGEM_CLUSTER_TOKEN.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time

from stratagem.rpc import DEFAULT_MAX_MESSAGE_BYTES, RpcServer, cluster_token
from stratagem.rpc.server import caller_gone, fast_lane, large_requests

ADDRESS, MARKER_DIR, NAME = sys.argv[1], sys.argv[2], sys.argv[3]
MAX_BYTES = int(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_MAX_MESSAGE_BYTES
_counter = itertools.count()


def _invoked(name: str) -> None:
    open(os.path.join(MARKER_DIR, f"handler-{name}-{next(_counter)}"), "w").close()


def echo(request: object) -> object:
    _invoked("echo")
    return request


def _look_up(key: str) -> None:
    raise KeyError(f"no entry {key!r} in the remote table")


def fail(request: object) -> None:
    _invoked("fail")
    _look_up(str(request))


def sleep(seconds: float) -> float:
    _invoked("sleep")
    time.sleep(seconds)
    return seconds


def lane_echo(request: object) -> object:
    _invoked("lane")
    return request


def ping(_: object) -> str:
    return "pong"


def wait_until_gone(limit_s: float) -> str:
    """Runs until the caller cancels (or ``limit_s`` passes); marks ``handler-gone-*`` if it saw that."""
    _invoked("wait")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if caller_gone():
            _invoked("gone")
            return "gone"
        time.sleep(0.01)
    return "still there"


def main() -> None:
    logging.basicConfig(filename=os.path.join(MARKER_DIR, "server.log"), level=logging.INFO)
    handlers = {"echo": large_requests(echo), "fail": fail, "sleep": sleep, "ping": ping,
                "wait_until_gone": wait_until_gone, "lane_echo": fast_lane(large_requests(lane_echo)),
                "lane_sleep": fast_lane(sleep)}
    server = RpcServer(ADDRESS, handlers, cluster_token(), max_message_bytes=MAX_BYTES, name=NAME).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"READY {server.address} {server.incarnation}", flush=True)
    while not stop.wait(0.2):
        pass
    server.stop(grace=0.5)


if __name__ == "__main__":
    main()
