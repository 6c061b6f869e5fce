"""The Python examples of docs/checkpoints.md run as written.

Here, in the test's process, except a block that begins with ``# run: COMMAND``: a script that
writes into its working folder, which tests/test_examples.py runs as that line says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"
BLOCKS = [block for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
          if not block.startswith("# run: ")]


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guide_example_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"<docs/checkpoints.md example {index + 1}>", "exec"), {"__name__": "__guide__"})
