"""The package's shape, checked: no import cycles, no hidden imports, small modules, documented API.

These checks read the source with :mod:`ast` (nothing is imported except where a check is
about importing), so a failure names files and lines:

1. the static graph of module-level imports between ``stratagem`` modules has no cycle,
   ``if TYPE_CHECKING:`` imports included (a cycle hidden from the interpreter is still two
   modules that cannot be understood apart);
2. no function imports a ``stratagem`` module except the ones in :data:`LAZY_IMPORTS`,
   each with the reason it is lazy -- a heavy optional stack loaded on first use is a
   reason, dodging a cycle is not (fix the cycle instead). Imports by name count too
   (:func:`_dynamic_imports`: ``importlib.import_module``, ``__import__``, a read of
   ``sys.modules``); a package's PEP 562 ``__getattr__`` loading its own modules is the one
   kind allowed without a listing;
3. ``import stratagem`` loads neither ``torch`` nor ``grpc`` nor ``cryptography`` (the
   parameter-server stack is optional and slow to import), and the core, imported, loads
   nothing built on it (the layer rule, observed);
4. no module is longer than :data:`MAX_LINES` lines;
5. every name in ``stratagem.__all__`` has a docstring;
6. the layers of ``docs/architecture.md`` (:data:`LAYERS`): what sits below the core
   (``errors``, ``values``, ``devices``, ``data/``, ``cluster/`` ...) imports nothing of the
   core or above; the core (``_context``, ``strategies/``, ``placement/``, ``comm/``, ``nn/``)
   nothing from the layers built on it (the Keras layer ``keras/``, ``checkpoint/``,
   ``callbacks/``, ``metrics/``, the parameter-server side ``ps/`` and ``rpc/``, the launcher
   ...); ``checkpoint/`` nothing from the Keras layer. Those layers reach the core through its
   declared hooks (:attr:`Strategy.model_steps_kind`, :attr:`Strategy.model_fit_loop_kind`,
   ``Strategy.checkpoint_collective``, the placements' checkpoint methods), never the other
   way round. The rule looks at what importing a module loads, not only at its own import
   lines: importing ``stratagem.nn.losses`` runs ``stratagem/nn/__init__.py`` and whatever
   that imports.

How the graph is built: an edge ``a -> b`` for each ``import b`` / ``from b import x``
executed when ``a`` is imported (module level, including inside ``if``/``try``/``class``
bodies), and for each ``import b`` under ``if TYPE_CHECKING:``. ``from pkg import name`` imports ``pkg.name``
when that is a module and ``pkg`` otherwise; a package is its ``__init__``. Importing
``stratagem.a.b`` also runs ``stratagem/a/__init__.py`` first, so that is an edge too --
but not the root ``stratagem/__init__``: it is always being imported already (every import
of a submodule starts there), and as an edge it would put every module in one cycle. An import
by name is an edge like the others where it runs at import time (module level); in a function
it is a function-level import, listed in :data:`LAZY_IMPORTS` or a package's lazy name.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stratagem"
MAX_LINES = 400

#: Function-level imports of stratagem modules that are there on purpose, as
#: ``(importing module, imported module): why``. Lines move; these pairs do not.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    # the parameter-server names load lazily through PEP 562 module __getattr__
    # (stratagem/__init__.py, stratagem/ps/__init__.py), which the graph does not count.
    ("stratagem.keras.model", "stratagem.ps.fit_loop"):
        "Model.fit under a ParameterServerStrategy: its loop needs the coordinator (grpc), which "
        "`import stratagem` must not load",
    ("stratagem.launch.command", "stratagem.launch.nodes"):
        "`stratagem launch --nnodes`: the rendezvous runs on grpc, which a local launch does not load "
        "(start-up), and GRPC_ENABLE_FORK_SUPPORT must be set before grpc is imported",
    ("stratagem", "stratagem.strategies.default"):
        "the default strategy, built at the first sg.get_strategy() outside every scope: it needs torch, "
        "which `import stratagem` must not load (`stratagem launch` starts its tasks without it)",
    ("stratagem.cli", "stratagem.demo"): "a command line imports only the subcommand it names: `stratagem "
                                         "launch` must not pay for the others (torch, grpc)",
    ("stratagem.cli", "stratagem.launch"): "a command line imports only the subcommand it names",
    ("stratagem.cli", "stratagem.ps.server"): "a command line imports only the subcommand it names",
    ("stratagem.cli", "stratagem.observe.command"): "a command line imports only the subcommand it names",
    ("stratagem.ps.server", "stratagem.ps.service"):
        "`stratagem server` loads the service of its own task type only, named in SERVICES so that "
        "register_service() can replace it",
    ("stratagem.ps.server", "stratagem.ps.worker"):
        "`stratagem server` loads the service of its own task type only (see stratagem.ps.service)",
    ("stratagem.strategies.multi_worker", "stratagem.placement.layout.fully_sharded"):
        "sharding='parameters' only: FSDP2 and DTensor (seconds to import, sympy with them) are not "
        "loaded by a MultiWorkerMirroredStrategy that does not shard its parameters",
    ("stratagem.testing.forkserver", "stratagem.testing.preloaded"):
        "the test fork server, a script, imports torch first, then stratagem's core with its STRATAGEM_* "
        "variables hidden (none of it may see a task's environment); a forked task then calls it",
    ("stratagem.launch.ray_actor", "stratagem.rpc.tokens"):
        "the token's strength rule, needed on a Ray node only when it holds a token; its package "
        "loads grpc and cryptography, which `stratagem launch` (it imports this module) must not pay for",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target among stratagem's modules."""

    source: str       # the importing module, "stratagem.launch.local"
    target: str       # the imported module, "stratagem.cluster.spec"
    line: int
    function: str | None   # the enclosing function's qualified name, None at module level
    type_checking: bool = False   # under `if TYPE_CHECKING:` (never executed, still a dependency)
    dynamic: bool = False   # by name at run time: importlib.import_module, __import__, sys.modules

    @property
    def where(self) -> str:
        return f"{_path_of(self.source)}:{self.line}"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _path_of(module: str) -> str:
    path = MODULES.get(module)
    if path is None:   # (a module a test makes up)
        return module.replace(".", "/") + ".py"
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The stratagem modules that ``node``, written in ``module``, imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    if node.level:   # relative: from the package that holds `module`
        package = module if _is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = ".".join(part for part in (package, node.module) if part)
    else:
        base = node.module or ""
    if base not in MODULES:
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _imports(module: str) -> list[Import]:
    """Every import of a stratagem module in ``module``'s source, with its enclosing function."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], function: str | None, scope: str, typing_only: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.extend(Import(module, target, node.lineno, function, typing_only)
                             for target in _resolve(module, node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, f"{scope}{node.name}", f"{scope}{node.name}.", typing_only)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, function, f"{scope}{node.name}.", typing_only)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, function, scope, True)   # never runs, but a dependency all the same
                visit(node.orelse, function, scope, typing_only)
            else:   # if / for / while / with / try / match: their bodies run at import time too
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []), function, scope, typing_only)
                for clause in getattr(node, "handlers", []) + getattr(node, "cases", []):
                    visit(clause.body, function, scope, typing_only)

    visit(tree.body, None, "", False)
    return found + _dynamic_imports(module, tree)


def _named_modules(module: str, tree: ast.Module, argument: ast.expr) -> list[str]:
    """The stratagem modules a by-name import in ``module`` may load, from the name it is given.

    A string names one module; an f-string its literal start (``f"stratagem.ps.{name}"``:
    every module under ``stratagem.ps``); a name computed otherwise any module whose name the
    module spells in a string, alone or before a ``:`` (its table: ``{"x": "stratagem.a.b"}``,
    ``"stratagem.a.b:attribute"``).
    """
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return [argument.value] if argument.value in MODULES else []
    if isinstance(argument, ast.JoinedStr):
        first = argument.values[0] if argument.values else None
        prefix = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
        return sorted(m for m in MODULES if prefix.startswith("stratagem.") and m.startswith(prefix)
                      and m != module) if prefix else []
    spelled = {node.value.partition(":")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return sorted(m for m in spelled if m in MODULES and m not in (module, "stratagem"))


def _loads_by_name(node: ast.AST) -> ast.expr | None:
    """The name argument of an import by name (None when ``node`` is not one)."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in ("import_module", "__import__"):
            return node.args[0]
        if called == "get" and isinstance(func, ast.Attribute) and _is_sys_modules(func.value):
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
        return node.slice
    return None


def _is_sys_modules(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and \
        isinstance(node.value, ast.Name) and node.value.id == "sys"


def _dynamic_imports(module: str, tree: ast.Module) -> list[Import]:
    """Every import by name in ``module``, with its enclosing function (None at module level)."""
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None, scope: str) -> None:
        argument = _loads_by_name(node)
        if argument is not None:
            found.extend(Import(module, target, node.lineno, function, dynamic=True)
                         for target in _named_modules(module, tree, argument))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            name = getattr(node, "name", "<lambda>")
            function, scope = f"{scope}{name}", f"{scope}{name}."
        elif isinstance(node, ast.ClassDef):
            scope = f"{scope}{node.name}."
        for child in ast.iter_child_nodes(node):
            visit(child, function, scope)

    visit(tree, None, "")
    return found


def _is_lazy_name(imp: Import) -> bool:
    """A package's PEP 562 ``__getattr__`` loading one of its own modules on first use."""
    return imp.function == "__getattr__" and _is_package(imp.source) and \
        (imp.source == "stratagem" or imp.target.startswith(imp.source + "."))


ALL_IMPORTS = [imp for module in MODULES for imp in _imports(module)]


def _edges(imports: list[Import]) -> dict[tuple[str, str], Import]:
    """The graph's edges, each with the first module-level import that makes it.

    Importing ``stratagem.a.b`` runs ``stratagem/a/__init__.py`` first: that is an edge too,
    reported at the same line. The root package is left out (see the module docstring), and
    so are a module's own enclosing packages, which are always being imported already.
    """
    edges: dict[tuple[str, str], Import] = {}
    for imp in imports:
        if imp.function is not None or imp.target == "stratagem":   # the root: always imported already
            continue
        edges.setdefault((imp.source, imp.target), imp)
        parts = imp.target.split(".")
        for package in (".".join(parts[:i]) for i in range(2, len(parts))):
            if not (imp.source == package or imp.source.startswith(package + ".")):
                edges.setdefault((imp.source, package), Import(imp.source, package, imp.line, None))
    return edges


EDGES = _edges(ALL_IMPORTS)
GRAPH: dict[str, set[str]] = {module: {t for s, t in EDGES if s == module} for module in MODULES}


def _path(start: str, goal: str) -> list[str] | None:
    """A shortest chain of module-level imports from ``start`` to ``goal``, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while came_from[path[-1]] is not None:
                path.append(came_from[path[-1]])
            return path[::-1]
        for target in sorted(GRAPH[node]):
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    return None


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return components


def _shortest_cycle(component: list[str]) -> list[Import]:
    """One shortest cycle through the component's first module, as the imports that make it."""
    start = component[0]
    paths = [_path(target, start) for target in sorted(GRAPH[start])]
    path = [start] + min((p for p in paths if p), key=len)
    return [EDGES[hop] for hop in zip(path, path[1:])]


def test_no_import_cycles() -> None:
    cycles = _strongly_connected(GRAPH)
    report = []
    for component in cycles:
        report.append(f"cycle among {', '.join(component)}:\n" +
                      "\n".join(f"    {h.source} -> {h.target}  ({h.where})" for h in _shortest_cycle(component)))
    print("\n".join(report))
    assert not cycles, "module-level import cycles; break each by moving the shared code down:\n" + \
        "\n".join(report)


def test_function_level_imports_are_allow_listed() -> None:
    hidden = [imp for imp in ALL_IMPORTS if imp.function is not None and not _is_lazy_name(imp)
              and (imp.source, imp.target) not in LAZY_IMPORTS]
    report = []
    for imp in hidden:
        cycle = _path(imp.target, imp.source)
        report.append(f"{imp.where}: {imp.function}() imports {imp.target}{' by name' if imp.dynamic else ''}" +
                      (f"; at module level it would close the cycle {' -> '.join(cycle + [imp.target])}"
                       if cycle else "; no cycle in the static graph either: move it to the top"))
    print("\n".join(report))
    assert not hidden, (
        "function-level imports of stratagem modules; import at the top of the module (and break "
        "any cycle that prevents it), or add the pair to LAZY_IMPORTS with the reason it must be "
        "lazy:\n" + "\n".join(report))


def test_allow_list_has_no_stale_entries() -> None:
    present = {(imp.source, imp.target) for imp in ALL_IMPORTS if imp.function is not None}
    stale = sorted(set(LAZY_IMPORTS) - present)
    assert not stale, f"LAZY_IMPORTS names imports that no longer exist; remove them: {stale}"


_LOADS = """
import importlib, json, sys
def loaded(*roots):
    return sorted(m for m in sys.modules if m in roots or m.startswith(tuple(r + '.' for r in roots)))
import stratagem as sg
found = {'import stratagem': loaded('torch', 'grpc', 'cryptography')}
found['default'] = repr(sg.get_strategy()) if sg.get_strategy().is_default else 'not the default'
for name in %r:
    importlib.import_module(name)
found['the core'] = loaded(*%r)
print(json.dumps(found))
"""


@pytest.mark.multiprocess
def test_import_stratagem_loads_little_and_the_core_nothing_built_on_it() -> None:
    # in a fresh interpreter: `import stratagem` loads neither torch (`stratagem launch` starts its
    # tasks without it) nor grpc/cryptography (the parameter-server stack is optional and slow);
    # sg.get_strategy() as the first call gives the default strategy; importing every module of
    # the core loads no module of the layers built on it (what the static rule infers, observed)
    core = sorted(m for m in MODULES if _within(m, CORE))
    code = _LOADS % (core, BUILT_ON_CORE + AROUND_TRAINING)
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert found == {"import stratagem": [], "default": "DefaultStrategy()", "the core": []}, (
        "`import stratagem` must load no torch/grpc/cryptography (load them on first use), and the core "
        f"nothing of the layers built on it; loaded: {found}")


def test_no_module_is_too_long() -> None:
    lengths = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    offenders = sorted(((n, m) for m, n in lengths.items() if n > MAX_LINES), reverse=True)
    report = [f"{_path_of(module)}: {n} lines" for n, module in offenders]
    print("\n".join(report))
    assert not offenders, f"modules over {MAX_LINES} lines; split them by question:\n" + "\n".join(report)


def test_every_public_name_has_a_docstring() -> None:
    import stratagem

    missing = [name for name in stratagem.__all__
               if not (getattr(getattr(stratagem, name), "__doc__", None) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


@pytest.mark.parametrize("source, expected", [
    ("import stratagem.errors", ["stratagem.errors"]),
    ("from stratagem import errors, __version__", ["stratagem.errors", "stratagem"]),
    ("from stratagem.cluster import ClusterSpec", ["stratagem.cluster"]),
    ("from . import spec", ["stratagem.cluster.spec"]),
    ("from ..errors import StratagemError", ["stratagem.errors"]),
    ("import torch", []),
])
def test_resolve(source: str, expected: list[str]) -> None:
    # as written in stratagem/cluster/tf_config.py
    assert _resolve("stratagem.cluster.tf_config", ast.parse(source).body[0]) == expected


def test_importing_a_submodule_runs_its_package_first() -> None:
    imports = [Import("stratagem.launch.local", "stratagem.cluster.spec", 3, None),
               Import("stratagem.cluster", "stratagem.cluster.detect", 4, None),
               Import("stratagem.cluster.detect", "stratagem.cluster.spec", 5, None),
               Import("stratagem.launch.local", "stratagem.devices", 6, "f")]
    assert sorted(_edges(imports)) == [("stratagem.cluster", "stratagem.cluster.detect"),
                                       ("stratagem.cluster.detect", "stratagem.cluster.spec"),
                                       ("stratagem.launch.local", "stratagem.cluster"),
                                       ("stratagem.launch.local", "stratagem.cluster.spec")]


def test_strongly_connected_components() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(_strongly_connected(graph)) == [["a", "b", "c"], ["e"]]


def test_type_checking_imports_and_functions_are_told_apart(tmp_path: Path, monkeypatch) -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    import stratagem.values\n"
              "else:\n    import stratagem.devices\n"
              "try:\n    import stratagem.errors\nexcept ImportError:\n    import stratagem.cli\n"
              "class A:\n    def f(self):\n        import stratagem.launch\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "stratagem.probe", path)
    found = {(imp.target, imp.function, imp.type_checking) for imp in _imports("stratagem.probe")}
    assert found == {("stratagem.values", None, True), ("stratagem.devices", None, False),
                     ("stratagem.errors", None, False), ("stratagem.cli", None, False),
                     ("stratagem.launch", "A.f", False)}


#: The layers of docs/architecture.md's drawing, bottom up (the root ``stratagem/__init__.py``,
#: the public names loaded on first use, reads them all and sits in none).
BELOW_CORE = ("stratagem.errors", "stratagem.values", "stratagem.devices", "stratagem.data", "stratagem.cluster",
              "stratagem._frames", "stratagem._profiling", "stratagem._record", "stratagem.observe")
CORE = ("stratagem._context", "stratagem.strategies", "stratagem.placement", "stratagem.comm", "stratagem.nn")
BUILT_ON_CORE = ("stratagem.keras", "stratagem.checkpoint", "stratagem.callbacks", "stratagem.metrics",
                 "stratagem.models", "stratagem.mixed_precision", "stratagem.preemption", "stratagem.ps",
                 "stratagem.rpc", "stratagem.experimental")
AROUND_TRAINING = ("stratagem.launch", "stratagem.demo", "stratagem.cli", "stratagem.__main__", "stratagem.testing")

#: Each layer, and the packages it must not import (module level, in functions, by name, or
#: for typing) nor load through the modules it imports: the lower layer never knows the ones
#: built on it.
LAYERS: dict[tuple[str, ...], tuple[str, ...]] = {
    BELOW_CORE: CORE + BUILT_ON_CORE + AROUND_TRAINING,
    CORE: BUILT_ON_CORE + AROUND_TRAINING,
    ("stratagem.checkpoint",): (
        "stratagem.keras", "stratagem.callbacks", "stratagem.metrics", "stratagem.models", "stratagem.ps",
        "stratagem.launch", "stratagem.demo", "stratagem.cli"),
}


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _layer_breaches(graph: dict[str, set[str]], edges: dict[tuple[str, str], Import], imports: list[Import],
                    layers: dict[tuple[str, ...], tuple[str, ...]]) -> list[str]:
    """Each import of a forbidden module by a layer's module, and each forbidden module that
    importing a layer's module loads through modules outside the layer (a package's
    ``__init__`` included), with the chain of imports that loads it."""
    breaches = [f"{imp.where}: {imp.source} imports {imp.target}{' by name' if imp.dynamic else ''}"
                for layer, forbidden in layers.items() for imp in imports
                if _within(imp.source, layer) and _within(imp.target, forbidden)]
    for layer, forbidden in layers.items():
        reported: set[tuple[str, str]] = set()
        for start in sorted(m for m in graph if _within(m, layer)):
            came_from: dict[str, str] = {start: start}
            queue = deque([start])
            while queue:
                node = queue.popleft()
                for target in sorted(graph.get(node, ()), key=lambda t: (-t.count("."), t)):   # modules first
                    if target in came_from:
                        continue
                    came_from[target] = node
                    if not _within(target, forbidden):
                        queue.append(target)
                        continue
                    owner = next(p for p in forbidden if _within(target, (p,)))
                    if not _within(node, layer) and (node, owner) not in reported:   # (else reported above)
                        reported.add((node, owner))
                        chain = [target]
                        while chain[-1] != start:
                            chain.append(came_from[chain[-1]])
                        breaches.append(f"{edges[(node, target)].where}: importing {start} loads {target}: "
                                        f"{' -> '.join(reversed(chain))}")
    return breaches


def test_lower_layers_import_nothing_from_the_layers_above() -> None:
    breaches = _layer_breaches(GRAPH, EDGES, ALL_IMPORTS, LAYERS)
    print("\n".join(breaches))
    assert not breaches, ("a lower layer imports a layer built on it; give the core a declared hook "
                          "(an attribute or method the upper layer reads) instead:\n" + "\n".join(breaches))


def test_the_layer_rule_sees_typing_imports(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stratagem.keras.model import Model\n")
    monkeypatch.setitem(MODULES, "stratagem.placement.probe", path)
    imports = _imports("stratagem.placement.probe")
    assert [(imp.target, imp.type_checking) for imp in imports] == [("stratagem.keras.model", True)]
    assert _layer_breaches({}, {}, imports, LAYERS) == [
        f"{path}:3: stratagem.placement.probe imports stratagem.keras.model"]


def test_the_layer_rule_follows_what_an_import_loads() -> None:
    # the core imports a helper package's module; that package's __init__ imports the ps side
    imports = [Import("stratagem.placement.x", "stratagem.helpers.y", 3, None),
               Import("stratagem.helpers", "stratagem.ps.embedding", 4, None),
               Import("stratagem.helpers.y", "stratagem.errors", 5, None)]
    edges = _edges(imports)
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    layers = {("stratagem.placement",): ("stratagem.ps",)}
    assert _layer_breaches(graph, edges, imports, layers) == [
        "stratagem/helpers.py:4: importing stratagem.placement.x loads stratagem.ps.embedding: "
        "stratagem.placement.x -> stratagem.helpers -> stratagem.ps.embedding"]


def test_imports_by_name_are_counted(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "probe.py"
    path.write_text("import importlib, sys\n"
                    "importlib.import_module('stratagem.errors')\n"
                    "TABLE = {'a': 'stratagem.devices', 'b': 'stratagem.values:PerReplica'}\n"
                    "def f(name):\n    return importlib.import_module(name)\n"
                    "class C:\n    def g(self):\n        return sys.modules.get('stratagem.cli')\n"
                    "h = lambda part: __import__(f'stratagem.cluster.{part}')\n")
    monkeypatch.setitem(MODULES, "stratagem.placement.probe", path)
    found = {(imp.target, imp.function) for imp in _imports("stratagem.placement.probe") if imp.dynamic}
    cluster = {(m, "<lambda>") for m in MODULES if m.startswith("stratagem.cluster.")}
    # (a name computed in f: every module the file spells, its table's and the others alike)
    assert found == {("stratagem.errors", None), ("stratagem.devices", "f"), ("stratagem.values", "f"),
                     ("stratagem.errors", "f"), ("stratagem.cli", "f"), ("stratagem.cli", "C.g")} | cluster
    assert len(cluster) > 3


_DRAWING_LAYER = re.compile(r"^layer (\d)  ")
_DRAWING_NAME = re.compile(r"(?<![\w.])([_a-z][_a-z0-9]*)(/|\.py)(?![\w])")


def _drawing() -> dict[int, set[str]]:
    """docs/architecture.md's layer drawing: layer number -> the modules and packages it lists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Folders and layers", 1)[1].split("```", 2)[1]
    layers: dict[int, set[str]] = {}
    layer = None
    for line in block.splitlines():
        found = _DRAWING_LAYER.match(line)
        layer = int(found.group(1)) if found else layer
        if layer is not None:
            layers.setdefault(layer, set()).update(f"stratagem.{name}" for name, _ in _DRAWING_NAME.findall(line))
    return layers


def test_the_layer_drawing_is_the_rule() -> None:
    drawing = _drawing()
    top_level = {m.split(".")[0] + "." + m.split(".")[1] for m in MODULES if m != "stratagem"}
    listed = [name for names in drawing.values() for name in names]
    assert sorted(top_level - set(listed)) == [], "docs/architecture.md's drawing leaves these out"
    assert sorted(set(listed) - top_level) == [], "docs/architecture.md's drawing names what does not exist"
    assert len(listed) == len(set(listed)), "docs/architecture.md's drawing names a module twice"
    assert drawing == {0: set(BELOW_CORE), 1: set(CORE), 2: set(BUILT_ON_CORE), 3: set(AROUND_TRAINING)}


# ---------------------------------------------------------------- the tests' own layout

TESTS = ROOT / "tests"
#: folders of tests/ that mirror no package folder, and why
TEST_FOLDERS_OF_NO_PACKAGE = {
    "_support": "helpers shared by several test folders",
    "tutorials": "TensorFlow's distributed-training tutorials, run end to end",
}


def test_test_files_have_unique_names() -> None:
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not repeated, f"test files share a name; name the second for its topology or subject: {repeated}"


def test_test_folders_mirror_the_package() -> None:
    folders = sorted(p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__")
    strays = [str(p.relative_to(ROOT)) for p in folders
              if p.relative_to(TESTS).parts[0] not in TEST_FOLDERS_OF_NO_PACKAGE
              and not (PACKAGE / p.relative_to(TESTS)).is_dir()]
    assert not strays, (f"test folders with no package folder of the same path under stratagem/: {strays}; "
                        f"put each test beside the module it tests (tests/README.md)")
    not_packages = [str(p.relative_to(ROOT)) for p in [TESTS, *folders] if not (p / "__init__.py").exists()]
    assert not not_packages, f"test folders without __init__.py (tests/ is a package): {not_packages}"
