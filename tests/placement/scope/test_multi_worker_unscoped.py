"""Parameters a MultiWorkerMirroredStrategy with one replica per worker does not hold are refused
on every worker, for every ``sharding=``: a module created outside the scope (the optimizer
inside or outside it; used in ``run``, or in the scope outside ``run``), a submodule or parameter
assigned after the scope (used in ``run`` or outside every scope), an ``sg.Model`` built around
an unscoped module. Before, each worker silently trained its own copy.

And a step written without ``run`` acts as the worker's one replica: a per-replica mean loss, or a
loss helper's scaling computed outside the scope (for one replica), is refused at ``backward()``
instead of training with twice the gradient; the helpers in the scope scale for every replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster

from . import unscoped_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]
SCRIPT = Path(unscoped_script.__file__)


@pytest.mark.parametrize("sharding", ["none", "optimizer", "parameters"])
def test_parameters_the_strategy_does_not_hold_are_refused_on_every_worker(sharding: str) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[sharding], timeout=180)
    for result in results:
        assert result.returncode == 0, result.output
        lines = {line.split(": ")[0][len("case "):]: line for line in result.output.splitlines()
                 if line.startswith("case ")}
        assert set(lines) == set(unscoped_script.CASES) | set(unscoped_script.LOSS_CASES), result.output
        for name in unscoped_script.CASES:
            assert ": refused: " in lines[name], lines[name]
            assert "inside `with strategy.scope():`" in lines[name], lines[name]
        for name, (_, outcome) in unscoped_script.LOSS_CASES.items():
            assert f": {outcome}" in lines[name], lines[name]
            if outcome == "refused":
                assert "loss.backward() outside strategy." in lines[name], lines[name]
    sums = {line for r in results for line in r.output.splitlines() if line.startswith("right way: ")}
    assert len(sums) == 1, [r.output for r in results]
