"""``import stratagem`` leaves gRPC and cryptography unloaded until a parameter-server name is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

_LOADED = "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('grpc', 'cryptography'))}))"


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", f"import sys; {code}; {_LOADED}"],
                          capture_output=True, text=True, check=True, timeout=100).stdout.strip()


def test_import_stratagem_loads_neither_grpc_nor_cryptography() -> None:
    assert _run("import stratagem as sg; sg.nn.embedding_lookup; sg.MinSizePartitioner; "
                "sg.ShardedVariable") == "[]"


def test_the_parameter_server_names_load_them_on_first_use() -> None:
    assert _run("import stratagem as sg; sg.ParameterServerStrategy, sg.ClusterCoordinator, "
                "sg.RemoteValue") == "['cryptography', 'grpc']"
