"""An RpcServer in a process of its own, for the transport tests.

    python server_script.py ADDRESS MARKER_DIR [MAX_MESSAGE_BYTES]

Prints ``READY <address>`` once it serves, and stops on SIGTERM. Every handler that runs
first creates a file ``handler-<name>-<n>`` in MARKER_DIR, so a test can prove that a
refused request never reached one; the log goes to MARKER_DIR/server.log. The token is STRATAGEM_CLUSTER_TOKEN.
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

ADDRESS, MARKER_DIR = sys.argv[1], sys.argv[2]
MAX_BYTES = int(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_MAX_MESSAGE_BYTES
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


def ping(_: object) -> str:
    return "pong"


def main() -> None:
    logging.basicConfig(filename=os.path.join(MARKER_DIR, "server.log"), level=logging.INFO)
    server = RpcServer(ADDRESS, {"echo": echo, "fail": fail, "sleep": sleep, "ping": ping},
                       cluster_token(), max_message_bytes=MAX_BYTES, name="ps 0").start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"READY {server.address}", flush=True)
    while not stop.wait(0.2):
        pass
    server.stop(grace=0.5)


if __name__ == "__main__":
    main()
