"""The examples and every Python block of the README run as their text says, so they cannot rot."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "train.py"


def _run(*command: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=cwd)
    assert proc.returncode == 0, f"{shlex.join(command)} failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return proc.stdout


def _python_command(words: list[str]) -> list[str]:
    """A documented command with this interpreter: ``python x`` and ``stratagem ...``."""
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "stratagem":
        return [sys.executable, "-m", "stratagem", *words[1:]]
    raise AssertionError(f"no way to run {shlex.join(words)!r} here")


def readme_blocks() -> list[tuple[int, str]]:
    """(line, code) of each Python block of the README."""
    text = (ROOT / "README.md").read_text()
    return [(text[:match.start()].count("\n") + 1, match.group(1))
            for match in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("line, code", readme_blocks(), ids=lambda value: str(value)[:12])
def test_readme_python_block_runs_as_its_first_line_says(tmp_path: Path, line: int, code: str) -> None:
    first = code.splitlines()[0]
    assert first.startswith("# run: "), f"README block at line {line}: say how to run it ('# run: ...')"
    words = shlex.split(first[len("# run: "):].split("(")[0])
    script = next(word for word in words if word.endswith(".py"))
    (tmp_path / script).write_text(code)
    output = _run(*_python_command(words), cwd=tmp_path)
    assert "loss" in output, output


@pytest.mark.multiprocess
def test_mirrored_and_multi_worker_runs_print_the_same_losses() -> None:
    # the docstring's commands, as written: the default strategy follows the way it is started
    mirrored = _run(sys.executable, str(EXAMPLE), "--epochs", "1")
    launched = _run(sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLE), "--epochs", "1")
    loss_line = [line for line in mirrored.splitlines() if line.startswith("epoch 1")][0]
    assert "(2 replicas)" in loss_line
    assert f"[worker 0] {loss_line}" in launched and f"[worker 1] {loss_line}" in launched


@pytest.mark.multiprocess
def test_parameter_server_example_trains() -> None:
    output = _run(sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "2",
                  str(EXAMPLES / "train_ps.py"), "--steps", "300")
    accuracy = float(re.search(r"\[chief\] +training accuracy ([0-9.]+)", output).group(1))
    assert accuracy > 0.9, output


def test_every_example_is_tested() -> None:
    tested = {"train.py", "train_ps.py",
              "preemptible.py",   # tests/launch/test_restarts.py
              "tensor_parallel.py"}   # tests/strategies/test_multi_worker_tensor_parallel.py
    tested |= {"pipeline.py"}   # tests/strategies/test_multi_worker_pipeline.py
    tested |= {"pipeline_3d.py"}   # tests/strategies/test_pipeline_mesh3d.py
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested


def test_documentation_cites_nothing_outside_the_repository() -> None:
    # users have the repository only: no "SPEC §7", no NOTES.md, no "../shared"
    outside = re.compile(r"SPEC\.md|NOTES\.md|SPEC §|§ ?\d|\.\./shared|seeds/")
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("stratagem/**/*.py"),
             *EXAMPLES.glob("*.py"), *ROOT.glob("benchmarks/*.py"), ROOT / "benchmarks" / "README.md"]
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in files for number, line in enumerate(path.read_text().splitlines(), 1)
             if outside.search(line)]
    assert not cited, "\n".join(cited)
