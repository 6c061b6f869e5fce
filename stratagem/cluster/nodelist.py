"""Slurm's compact forms, read as pure functions: node lists, tasks per node, task placement.

Slurm describes an allocation in a few environment variables written compactly:

- a **node list** (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``) names the nodes in
  Slurm's order, with bracketed ranges: ``node[01-04,07]`` is ``node01 .. node04, node07``
  (a range keeps the width of its first number: ``01-04`` is padded to two digits, ``8-10``
  is not padded), several bracketed groups in one name expand as a product, the leftmost
  slowest (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``), and names and groups are joined by
  commas (``login,gpu[1-2],cpu07``);
- **tasks per node** (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``) counts the
  tasks of each node of the list, a count repeated ``k`` times written ``count(xk)``:
  ``2(x3),1`` is ``[2, 2, 2, 1]``;
- **placement**: which node and which local index each task rank gets. Slurm's default
  distribution is ``block`` (node 0's tasks first, then node 1's, ...); ``cyclic`` deals
  ranks out one per node in turn, ``plane=N`` N at a time (``SLURM_DISTRIBUTION``).

Every malformed text raises :class:`~stratagem.errors.ClusterConfigError` naming the text and
the problem.

Example::

    >>> from stratagem.cluster.nodelist import expand_nodelist, expand_tasks_per_node, place_tasks
    >>> expand_nodelist("node[01-03,07],login")
    ['node01', 'node02', 'node03', 'node07', 'login']
    >>> expand_tasks_per_node("2(x2),1")
    [2, 2, 1]
    >>> place_tasks(["a", "b"], [2, 1], "cyclic")
    [('a', 0), ('b', 0), ('a', 1)]
"""

from __future__ import annotations

import re

from stratagem.errors import ClusterConfigError

__all__ = ["expand_nodelist", "expand_tasks_per_node", "place_tasks"]

# A node name outside brackets: Slurm's node names are host names (letters, digits, '-', '_', '.').
_NAME_PART = re.compile(r"[A-Za-z0-9_.-]*")
_NUMBER = re.compile(r"[0-9]+")
_TASK_COUNT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
# Larger ranges are a typo (or an attack on memory), not a cluster.
MAX_NODES = 1_000_000


def _split_top_level(text: str, what: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            if depth:
                raise ClusterConfigError(f"{what} {text!r}: a '[' inside brackets at character "
                                         f"{position}; brackets do not nest (write 'node[1-4]').")
            depth = 1
        elif char == "]":
            if not depth:
                raise ClusterConfigError(f"{what} {text!r}: a ']' without its '[' at character "
                                         f"{position}.")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:position])
            start = position + 1
    if depth:
        raise ClusterConfigError(f"{what} {text!r}: a '[' is never closed; write ranges like "
                                 "'node[01-04,07]'.")
    items.append(text[start:])
    return items


def _expand_range(part: str, text: str) -> list[str]:
    low, dash, high = part.partition("-")
    if not _NUMBER.fullmatch(low) or (dash and not _NUMBER.fullmatch(high)):
        raise ClusterConfigError(
            f"node list {text!r}: {part!r} inside brackets is not a number or a range of numbers "
            "like '3' or '01-04'.")
    if not dash:
        return [low]
    first, last = int(low), int(high)
    if last < first:
        raise ClusterConfigError(f"node list {text!r}: the range {part!r} runs backwards; write it "
                                 f"'{high}-{low}'.")
    if last - first >= MAX_NODES:
        raise ClusterConfigError(f"node list {text!r}: the range {part!r} names more than "
                                 f"{MAX_NODES} nodes.")
    width = len(low)
    return [str(n).zfill(width) for n in range(first, last + 1)]


def _expand_item(item: str, text: str) -> list[str]:
    """One comma-separated item: a name with zero or more bracketed groups."""
    names = [""]
    rest = item
    while rest:
        prefix = _NAME_PART.match(rest).group()  # type: ignore[union-attr] - matches ""
        rest = rest[len(prefix):]
        names = [name + prefix for name in names]
        if not rest:
            break
        if rest[0] != "[":
            raise ClusterConfigError(f"node list {text!r}: {rest[0]!r} in {item!r} cannot be "
                                     "part of a node name.")
        close = rest.index("]")  # balanced: checked by _split_top_level
        body, rest = rest[1:close], rest[close + 1:]
        if not body:
            raise ClusterConfigError(f"node list {text!r}: empty brackets in {item!r}.")
        values: list[str] = []
        for part in body.split(","):
            if not part:
                raise ClusterConfigError(f"node list {text!r}: an empty range in {item!r} (two "
                                         "commas in a row inside brackets, or one at an end).")
            values += _expand_range(part, text)
        if len(names) * len(values) > MAX_NODES:
            raise ClusterConfigError(f"node list {text!r}: {item!r} names more than {MAX_NODES} nodes.")
        names = [name + value for name in names for value in values]
    if names == [""]:
        raise ClusterConfigError(f"node list {text!r}: an empty node name (two commas in a row, or "
                                 "one at an end).")
    return names


def expand_nodelist(text: str) -> list[str]:
    """The node names of a Slurm node list, in Slurm's order (see the module's docstring).

    A name listed twice is refused: a node list names each node once, and a count per node
    (tasks per node) would otherwise be read against the wrong node.
    """
    if not isinstance(text, str) or not text.strip():
        raise ClusterConfigError(f"node list {text!r} is empty; Slurm writes it like "
                                 "'node[01-04,07]'.")
    text = text.strip()
    nodes = [node for item in _split_top_level(text, "node list") for node in _expand_item(item, text)]
    seen: set[str] = set()
    for node in nodes:
        if node in seen:
            raise ClusterConfigError(f"node list {text!r} names node {node!r} twice.")
        seen.add(node)
    return nodes


def expand_tasks_per_node(text: str, variable: str | None = None) -> list[int]:
    """The task count of each node from Slurm's ``2(x3),1`` form: ``[2, 2, 2, 1]``.

    Every count is 1 or more: Slurm lists the nodes that run tasks only, so a 0 (``0,2``)
    means the text was not written by Slurm. ``variable`` (``SLURM_STEP_TASKS_PER_NODE``)
    names where the text came from in the errors.
    """
    what = f"{variable}={text!r}" if variable else f"tasks per node {text!r}"
    if not isinstance(text, str) or not text.strip():
        raise ClusterConfigError(f"{what} is empty; Slurm writes it like '2(x3),1'.")
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASK_COUNT.fullmatch(item.strip())
        if match is None:
            raise ClusterConfigError(
                f"{what}: {item!r} is not a count like '2' or a repeated count "
                "like '2(x3)' (2 tasks on each of 3 nodes).")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if repeat == 0 or len(counts) + repeat > MAX_NODES:
            raise ClusterConfigError(f"{what}: {item!r} repeats its count "
                                     f"{repeat} times; that must be 1 to {MAX_NODES}.")
        if count == 0:
            raise ClusterConfigError(
                f"{what}: {item!r} gives node {len(counts) + 1} of the node list no task, but Slurm "
                "lists only the nodes that run tasks (every count is 1 or more); srun sets it: check "
                "what overwrote it, or describe the cluster with TF_CONFIG.")
        counts += [count] * repeat
    return counts


def _plane_size(distribution: str | None) -> int | None:
    """Tasks dealt to a node at a time: None for block, 1 for cyclic, N for plane=N."""
    kind = (distribution or "block").split(":")[0].split(",")[0].strip().lower()
    if kind in ("", "block", "*"):
        return None
    if kind == "cyclic":
        return 1
    if kind.startswith("plane"):
        _, _, size = kind.partition("=")
        if size.isdigit() and int(size) > 0:
            return int(size)
    raise ClusterConfigError(
        f"SLURM_DISTRIBUTION={distribution!r}: stratagem knows where Slurm puts the tasks for the "
        "block (the default), cyclic and plane=N distributions only; start the step with one of "
        "them (srun --distribution=block), or describe the cluster with TF_CONFIG.")


def place_tasks(nodes: list[str], counts: list[int],
                distribution: str | None = None) -> list[tuple[str, int]]:
    """``(node, local index)`` of every task rank, as Slurm's ``distribution`` places them.

    ``counts[i]`` is the number of tasks on ``nodes[i]``; ``distribution`` is
    ``SLURM_DISTRIBUTION`` (None or "block": the default).
    """
    if len(nodes) != len(counts):
        raise ClusterConfigError(
            f"the node list names {len(nodes)} node{'s' * (len(nodes) != 1)} ({_short(nodes)}) but "
            f"tasks per node gives {len(counts)} count{'s' * (len(counts) != 1)} ({counts}); both "
            "must describe the same nodes.")
    plane = _plane_size(distribution)
    if plane is None:
        return [(node, local) for node, count in zip(nodes, counts) for local in range(count)]
    placed: list[tuple[str, int]] = []
    given = [0] * len(nodes)
    while len(placed) < sum(counts):
        for i, node in enumerate(nodes):
            take = min(plane, counts[i] - given[i])
            placed += [(node, given[i] + k) for k in range(take)]
            given[i] += take
    return placed


def _short(nodes: list[str]) -> str:
    return ", ".join(nodes) if len(nodes) <= 6 else ", ".join(nodes[:5]) + f", ... {nodes[-1]}"
