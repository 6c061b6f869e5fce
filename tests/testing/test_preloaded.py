"""What the test fork server imports before it forks (:mod:`stratagem.testing.preloaded`): stratagem's
core, of which no module reads the environment when imported (a forked task takes its own
environment only after the server's imports), and no grpc; the timeline recorder, which a fresh
task starts from its environment at import, starts in a forked task from the task's environment
(real processes: the fork server and its children)."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

import stratagem
from stratagem.observe.chrome import FOLDER_VARIABLE
from stratagem.testing import run_task

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server needs Linux"),
              pytest.mark.skipif(os.environ.get("STRATAGEM_TEST_FORKSERVER") == "0",
                                 reason="STRATAGEM_TEST_FORKSERVER=0: every task starts fresh")]

_LOADED = "import json, sys; print(json.dumps(sorted(sys.modules)))"


@pytest.fixture(scope="module")
def loaded() -> list[str]:
    """The modules a forked task finds loaded before its code runs."""
    done = run_task([sys.executable, "-c", _LOADED], timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_forked_task_finds_stratagems_core_loaded_and_no_grpc(loaded: list[str]) -> None:
    core = ["stratagem.testing.preloaded", "stratagem.strategies.multi_worker", "stratagem.strategies.mirrored",
            "stratagem.keras.model", "stratagem.checkpoint", "stratagem.strategies.pipeline",
            "stratagem.strategies.tensor_parallel"]
    assert set(core) <= set(loaded), sorted(set(core) - set(loaded))
    # grpc's fork handlers would run at every fork; the launcher and the parameter servers are not
    # what a task of a strategy needs
    assert not [m for m in loaded if m.split(".")[0] == "grpc" or m.startswith(("stratagem.ps", "stratagem.rpc"))]


def _reads_at_import(path: Path) -> list[str]:
    """Where ``path``'s code reads the environment when imported: at module level, in a class body,
    a decorator or a default value (a default that is the mapping ``os.environ`` itself is read
    when called, not when imported)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                defaults = child.args.defaults + [d for d in child.args.kw_defaults if d is not None]
                for expression in [*defaults, *getattr(child, "decorator_list", [])]:
                    if ast.unparse(expression) != "os.environ":
                        visit(ast.Expression(expression))
                continue   # (a body runs when called)
            text = ast.unparse(child) if isinstance(child, (ast.Attribute, ast.Name)) else ""
            if text in ("os.environ", "environ", "os.getenv", "getenv", "os.environb"):
                found.append(f"{path.name}:{child.lineno} {text}")
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _source(module: str) -> Path:
    """The file of stratagem's ``module`` (found without importing it here)."""
    path = Path(stratagem.__file__).parent.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_no_preloaded_module_reads_the_environment_when_imported(loaded: list[str]) -> None:
    ours = [name for name in loaded if name.split(".")[0] == "stratagem"]
    assert len(ours) > 50, ours   # (the core: strategies, placements, Model, checkpoints)
    reads = [read for name in ours for read in _reads_at_import(_source(name))]
    assert not reads, reads


def test_a_forked_task_records_its_timeline_when_its_environment_names_the_folder(tmp_path: Path) -> None:
    code = "from stratagem.observe import record; print(record.launched())"
    done = run_task([sys.executable, "-c", code], timeout=120, env={**os.environ, FOLDER_VARIABLE: str(tmp_path)})
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
    [written] = tmp_path.iterdir()   # this task's events, as under `stratagem launch --timeline`
    assert json.loads(written.read_text().splitlines()[0])["task"].startswith("process ")
    without = run_task([sys.executable, "-c", code], timeout=120)
    assert (without.returncode, without.stdout) == (0, "False\n"), without.stderr
