"""The examples and the documentation's code run as their text says, so they cannot rot.

Every Python block of the README, and every one of ``docs/*.md`` that begins with ``# run: COMMAND``,
runs in a temporary folder as that line says; ``>>>`` blocks of ``docs/*.md`` run as doctests. Every
relative link of the README and the guides points to a file, and a heading, that exist.
"""

from __future__ import annotations

import difflib
import doctest
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratagem.testing import run_task

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "train.py"


def _run(*command: str, cwd: Path | None = None) -> str:
    """What ``command`` printed (forked from the test fork server where it can be: torch imported once)."""
    proc = run_task(list(command), timeout=240, cwd=cwd)
    assert proc.returncode == 0, f"{shlex.join(command)} failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return proc.stdout


def _python_command(words: list[str]) -> list[str]:
    """A documented command with this interpreter: ``python x`` and ``stratagem ...``."""
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "stratagem":
        return [sys.executable, "-m", "stratagem", *words[1:]]
    raise AssertionError(f"no way to run {shlex.join(words)!r} here")


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, code) of each Python block of one Markdown file."""
    text = path.read_text()
    return [(text[:match.start()].count("\n") + 1, match.group(1))
            for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def runnable_blocks() -> list[tuple[str, str]]:
    """("FILE:LINE", code) of each block run as its first line says: all of the README's, the
    guides' that begin with ``# run: ``."""
    return [(f"{path.relative_to(ROOT)}:{line}", code) for path in DOCUMENTS for line, code in _python_blocks(path)
            if path.name == "README.md" and path.parent == ROOT or code.startswith("# run: ")]


def doctest_blocks() -> list[tuple[str, str]]:
    """("FILE:LINE", code) of each ``>>>`` block of the guides."""
    return [(f"{path.relative_to(ROOT)}:{line}", code) for path in DOCUMENTS for line, code in _python_blocks(path)
            if code.startswith(">>> ")]


def test_the_documentation_has_runnable_blocks() -> None:
    # the blocks that ran when they all lived in the README (4) run where they moved to
    where = [place.split(":")[0] for place, _ in runnable_blocks()]
    assert len(where) >= 4 and where.count("README.md") >= 1, where


@pytest.mark.multiprocess
@pytest.mark.parametrize("place, code", runnable_blocks(), ids=[place for place, _ in runnable_blocks()])
def test_documented_python_block_runs_as_its_first_line_says(tmp_path: Path, place: str, code: str) -> None:
    first = code.splitlines()[0]
    assert first.startswith("# run: "), f"block at {place}: say how to run it ('# run: ...')"
    words = shlex.split(first[len("# run: "):].split("(")[0])
    script = next(word for word in words if word.endswith(".py"))
    (tmp_path / script).write_text(code)
    output = _run(*_python_command(words), cwd=tmp_path)
    assert "loss" in output, output


@pytest.mark.parametrize("place, code", doctest_blocks(), ids=[place for place, _ in doctest_blocks()])
def test_documented_doctest_block_shows_what_it_prints(place: str, code: str) -> None:
    test = doctest.DocTestParser().get_doctest(code, {}, place, place, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0, f"{place}: {runner.failures} doctest failures"


def _heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (outside code blocks)."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        title = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading.group(1).strip())   # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchors.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def test_every_relative_link_of_the_readme_and_the_guides_points_to_something() -> None:
    broken = []
    for path in DOCUMENTS:
        text = path.read_text()
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):   # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _heading_anchors(linked.read_text()):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading in {linked.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_starts_with_the_demo_and_the_command_ci_runs() -> None:
    # .ci/run ends with the README's test command: a new user and CI run the same tests
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert "stratagem demo" in commands and ci in commands, (ci, first_block)


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


def test_the_ddp_port_changes_six_lines_none_reindented() -> None:
    ddp = (EXAMPLES / "ddp_train.py").read_text().splitlines()
    port = (EXAMPLES / "ddp_train_ported.py").read_text().splitlines()
    removed, added, changed = [], [], 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ddp, port, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += ddp[i1:i2]
            added += port[j1:j2]
            changed += max(i2 - i1, j2 - j1)   # a line replaced counts once
    assert changed <= 6, "\n".join(difflib.unified_diff(ddp, port, lineterm=""))
    assert not {line.strip() for line in removed} & {line.strip() for line in added}, "a line re-indented"
    assert "import stratagem as sg" in added
    assert "    strategy = sg.MultiWorkerMirroredStrategy(); sg.experimental_set_strategy(strategy)" in added
    assert not [line for line in port if re.search(r"DDP\(|\.module\b|process_group\(", line)]
    # docs/from_ddp.md shows this very diff
    diff = "\n".join(difflib.unified_diff(ddp, port, "examples/ddp_train.py", "examples/ddp_train_ported.py",
                                          n=1, lineterm=""))
    assert f"```diff\n{diff}\n```" in (ROOT / "docs" / "from_ddp.md").read_text()


def _iterations(output: str) -> list[str]:
    """Rank 0's per-iteration lines ("iter N: loss ..., grad norm ..., lr ...") and its final evaluation."""
    return re.findall(r"^(?:\[worker 0\] )?((?:iter|step) \d+: .*)$", output, re.M)


@pytest.mark.multiprocess
def test_ddp_script_and_its_port_print_the_same_losses_and_gradient_norms(tmp_path: Path) -> None:
    # float16 autocast, so the GradScaler is on; accumulation, clipping (every norm > 0.25),
    # AdamW groups and the cosine schedule as nanoGPT has them. The outputs must be equal to every
    # printed digit: with two workers DDP's average (a + b) / 2 and stratagem's sum a/2 + b/2
    # round alike, and everything else is the same code on the same numbers.
    options = ["--dtype", "float16", "--max-iters", "4"]
    env = {key: value for key, value in os.environ.items() if key not in ("TF_CONFIG", "RANK", "WORLD_SIZE")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {"ddp under torchrun": [*torchrun, str(EXAMPLES / "ddp_train.py")],
            "port under torchrun": [*torchrun, str(EXAMPLES / "ddp_train_ported.py")],
            "port under stratagem launch": [sys.executable, "-m", "stratagem", "launch", "--workers", "2",
                                            str(EXAMPLES / "ddp_train_ported.py")]}
    lines, checkpoints = {}, {}
    for name, command in runs.items():
        folder = tmp_path / name.replace(" ", "_")
        proc = subprocess.run([*command, *options, "--out-dir", str(folder)], env=env, capture_output=True,
                              text=True, timeout=200)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        lines[name] = _iterations(proc.stdout)
        checkpoints[name] = torch.load(folder / "ckpt.pt", weights_only=True)
    ddp = lines.pop("ddp under torchrun")
    assert len(ddp) == 5 and all(float(norm) > 0.25 for norm in re.findall(r"grad norm ([0-9.]+)", "\n".join(ddp)))
    for name, port in lines.items():
        assert port == ddp, f"{name}:\n" + "\n".join(difflib.unified_diff(ddp, port, lineterm=""))
    # the checkpoints: the same names (no "module." prefix) and values
    reference = checkpoints.pop("ddp under torchrun")
    assert reference["scaler"]["scale"] > 0   # the GradScaler ran
    for name, checkpoint in checkpoints.items():
        assert list(checkpoint["model"]) == list(reference["model"]), name
        for key, value in reference["model"].items():
            assert torch.equal(checkpoint["model"][key], value), (name, key)
        torch.testing.assert_close(checkpoint["optimizer"], reference["optimizer"], rtol=0, atol=0)
        assert checkpoint["scaler"] == reference["scaler"] and checkpoint["iter_num"] == 4, name


def test_every_example_is_tested() -> None:
    tested = {"train.py", "train_ps.py", "ddp_train.py", "ddp_train_ported.py",
              "preemptible.py",   # tests/launch/test_restarts.py
              "tensor_parallel.py"}   # tests/placement/layout/test_multi_worker_tensor_parallel.py
    tested |= {"pipeline.py"}   # tests/placement/layout/test_multi_worker_pipeline.py
    tested |= {"pipeline_3d.py"}   # tests/placement/layout/test_pipeline_mesh3d.py
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
