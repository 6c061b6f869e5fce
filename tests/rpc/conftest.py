"""Fixtures of the RPC tests (helpers in rpc_processes.py)."""

from __future__ import annotations

import signal

import pytest

from .rpc_processes import start_server_processes


@pytest.fixture(scope="module")
def server_pair(tmp_path_factory: pytest.TempPathFactory):
    """Two server processes: the first for ordinary calls, the second for a test to kill."""
    servers = start_server_processes(2, tmp_path_factory.mktemp("rpc-servers"))
    yield servers
    for server in servers:
        server.stop(signal.SIGKILL)
