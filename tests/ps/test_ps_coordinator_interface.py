"""Nothing outside ``stratagem/ps/coordinator.py`` reads a ClusterCoordinator's private members.

The coordinator's threads reach it through the :class:`~stratagem.ps.coordinator_link.CoordinatorLink`
it hands them, a RemoteValue through the ``check`` callback it is given, the strategy through
the ``live`` callback of ``attach_coordinator``. This reads the source with :mod:`ast`: an
attribute ``._name`` taken of anything named ``coordinator`` or ``_coordinator`` (a variable,
``self._coordinator``, ``strategy.coordinator``) anywhere else in the package fails, naming
the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "stratagem"
OWNER = PACKAGE / "ps" / "coordinator.py"


def _names_a_coordinator(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in ("coordinator", "_coordinator")


def private_reads(source: str, where: str) -> list[str]:
    """``where:line: ._name`` for each private member of a coordinator read in ``source``."""
    return [f"{where}:{node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__") and _names_a_coordinator(node.value)]


def test_no_module_but_the_coordinator_reads_its_private_members() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != OWNER
             for hit in private_reads(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, ("these read a ClusterCoordinator's private members; give them what they need "
                       "through a declared interface (CoordinatorLink, a callback) instead:\n" + "\n".join(found))


def test_the_check_sees_each_kind_of_private_read() -> None:
    source = ("def f(value, strategy, coordinator):\n"
              "    value._coordinator._check()\n"
              "    coordinator._stopping.is_set()\n"
              "    return strategy.coordinator._queue, coordinator.__class__, coordinator.schedule\n")
    assert sorted(hit.split(": ")[1] for hit in private_reads(source, "sample.py")) == \
        ["._check", "._queue", "._stopping"]
