"""`stratagem launch` says when its tasks did not train as one cluster (real processes)."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from stratagem.launch import launch_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180), pytest.mark.usefixtures("forked_launches")]


def _launch(tmp_path: Path, code: str, **options: object) -> tuple[int, str, str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, stdout=out, stderr=err, **options)
    return status, out.getvalue(), err.getvalue()


def test_workers_that_never_form_a_cluster_get_a_warning(tmp_path: Path) -> None:
    # what `stratagem launch --workers 2 train.py` does to a single-process script
    status, out, err = _launch(tmp_path, "print('training alone')\n", num_workers=2)
    assert status == 0, out + err
    assert "[launch] warning: the 2 tasks never formed a cluster" in err
    assert "sg.MultiWorkerMirroredStrategy()" in err


def test_workers_that_form_a_cluster_get_no_warning(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, """
        import stratagem as sg
        strategy = sg.MultiWorkerMirroredStrategy()
        print("replicas", strategy.num_replicas_in_sync)
    """, num_workers=2)
    assert status == 0, out + err
    assert "replicas 2" in out and err == ""


def test_parameter_servers_that_never_get_a_variable_fail_the_job(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, "print('no strategy here')\n", num_workers=1, num_ps=1)
    assert status == 1, out + err
    assert "[launch] error: the parameter servers never received a variable" in err
    assert "examples/train_ps.py" in err


def test_an_unused_parameter_server_gets_a_warning(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, """
        import torch
        import stratagem as sg
        strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
        coordinator = sg.ClusterCoordinator(strategy)
        with strategy.scope():
            weight = torch.nn.Linear(1, 1, bias=False)      # one variable: on ps 0 only
            optimizer = torch.optim.SGD(weight.parameters(), lr=0.1)
        def step():
            optimizer.zero_grad(); weight(torch.ones(1, 1)).sum().backward(); optimizer.step()
        for _ in range(8):
            coordinator.schedule(step)
        coordinator.join()
        print("done")
    """, num_workers=1, num_ps=2, grace_period=60)   # a loaded machine stops the servers slowly
    assert status == 0, out + err
    assert "[launch] warning: ps 1 never received a variable" in err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert not any("ps 0" in line or "worker 0" in line for line in warnings), err
