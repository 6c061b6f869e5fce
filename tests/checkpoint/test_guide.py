"""The Python examples of docs/checkpoints.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guide_example_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"<docs/checkpoints.md example {index + 1}>", "exec"), {"__name__": "__guide__"})
