"""What every node of a multi-node launch must agree on: :class:`JobShape`, compared at each join.

The rendezvous (``rendezvous.py``) holds the host's shape and compares every joining node's
with it (:meth:`JobShape.differences`): the job's size and task layout, the options of the
node's command line (all but :data:`PER_NODE_OPTIONS`, so that a new option is compared by
default), the SHA-256 of the script's contents and the script's arguments (unless
``--per-node-args``). Each difference is said with both values, so that the message on
either node names what to fix.

Example::

    >>> from stratagem.launch.job_shape import JobShape
    >>> host = JobShape(max_nodes=2, workers_per_node=1, options=(("--grace-period", 30.0),))
    >>> node = JobShape(max_nodes=2, workers_per_node=1, options=(("--grace-period", 5.0),))
    >>> host.differences(node.as_dict(), "on node 1", "on the rendezvous host")
    ['--grace-period 5 on node 1, 30 on the rendezvous host']
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["JobShape", "PER_NODE_OPTIONS"]

#: The options of ``stratagem launch`` that may differ from node to node; every other one
#: (and the script's contents, and its arguments unless ``--per-node-args``) must be the same.
PER_NODE_OPTIONS = ("--node-rank", "--host", "--rdzv", "--token-file")


@dataclass(frozen=True)
class JobShape:
    """What every node must agree on: the host's launch options, checked at each join.

    ``options`` are the command line's options by name (``(("--grace-period", 5.0), ...)``),
    all but the per-node ones; ``script_digest`` is the SHA-256 of the script's contents
    (``script`` its file name, for messages), and ``script_args`` its arguments, or None where
    they may differ from node to node (``--per-node-args``).
    """

    max_nodes: int
    workers_per_node: int
    min_nodes: int = 0        # 0: the same as max_nodes (not elastic)
    chief: bool = False
    evaluator: int = 0
    max_restarts: int = 0
    max_preemptions: int = 100
    script: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    script_digest: str = ""
    script_args: tuple[str, ...] | None = None

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.max_nodes

    @property
    def least(self) -> int:
        return self.min_nodes or self.max_nodes

    def tasks_on(self, first: bool) -> list[str]:
        """The task types one node runs, in order: the first member has the chief and evaluator."""
        extra = ["chief"] * self.chief + ["evaluator"] * self.evaluator if first else []
        return extra[:1] + ["worker"] * self.workers_per_node + extra[1:]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, theirs: dict[str, Any], there: str, here: str) -> list[str]:
        """What another node's shape (its :meth:`as_dict`) has otherwise, each with both values.

        ``there`` and ``here`` name the two nodes in the text ("on node 1 (10.0.0.2)").
        """
        said = []
        mine, other = dict(self.options), dict(theirs.get("options") or ())
        for name in dict.fromkeys([*mine, *other]):
            if mine.get(name, _ABSENT) != other.get(name, _ABSENT):
                said.append(f"{name} {_show(other.get(name, _ABSENT))} {there}, "
                            f"{_show(mine.get(name, _ABSENT))} {here}")
        if theirs.get("script_digest") != self.script_digest:
            said.append(f"the script's contents differ: {theirs.get('script')} (sha256 "
                        f"{str(theirs.get('script_digest'))[:12]}) {there}, {self.script} (sha256 "
                        f"{self.script_digest[:12]}) {here}; copy the same script to every node")
        args = theirs.get("script_args")
        if args is not None and self.script_args is not None and tuple(args) != self.script_args:
            said.append(f"the script's arguments differ: {list(args)} {there}, {list(self.script_args)} "
                        f"{here}; give --per-node-args to every node where they differ on purpose")
        if not said:   # the job's shape itself (made from the options: it differs only when they do)
            ours = {key: value for key, value in self.as_dict().items() if key not in _DESCRIBED}
            said = [f"{key} {_show(theirs.get(key, _ABSENT))} {there}, {_show(value)} {here}"
                    for key, value in ours.items() if theirs.get(key, _ABSENT) != value]
        return said


_ABSENT = object()
_DESCRIBED = ("options", "script", "script_digest", "script_args")


def _show(value: Any) -> str:
    """An option's value as a command line would give it."""
    if value is _ABSENT:
        return "(unknown to that launcher)"
    if isinstance(value, bool):
        return "given" if value else "not given"
    if value is None:
        return "not given"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
