"""Imports between scratchd's modules run one way: down the layer table, never in a circle.

Every module of the package (tests/ and scripts/ are not part of it) is parsed with
:mod:`ast` and every import statement in it counts, wherever it sits: at the top, inside a
function, under ``if TYPE_CHECKING:``. An import hidden in a function is still a dependency,
and a circle hidden behind TYPE_CHECKING still means two modules share a concept. That is
why this is an ``ast`` walk and not import-linter or a look at ``sys.modules``: both only see
what runs.

The checks:

* no circle between modules (reported as ``a → b → a``);
* no import up the layer table :data:`LAYERS` (any direction within one layer);
* ``client/`` imports nothing of scratchd outside ``protocol/`` and ``client/``, so a
  gateway can vendor the two folders alone.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "scratchd"

# Bottom to top, one layer a line: module-name prefixes below ``scratchd.``. A module belongs
# to the layer of its longest matching prefix and may import from its own layer or below; a
# new top-level folder has no layer until it is given one here. "" is the package itself.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),  # scratchd/__init__.py: the version
    ("protocol",),
    ("client",),
    ("ipc",),
    ("dataset",),
    ("kernels",),
    ("cpu",),
    ("model",),
    ("gpu",),
    ("workers",),
    ("daemon", "daemon.config", "daemon.lifecycle"),
    ("daemon.frontend", "daemon.pool"),
    ("daemon.ops",),
    ("daemon.kserve",),
    ("daemon.app", "daemon.service", "daemon.commands", "daemon.cli"),
)

# Modules client/ may import: what a gateway vendors.
CLIENT_MAY_IMPORT = ("protocol", "client")

# Import edges known to break the rules, each owned by a change in flight on another branch.
# Delete an entry once that branch is merged; test_no_stale_allowance says when.
KNOWN_EDGES: frozenset[tuple[str, str]] = frozenset()

SKIP_DIRS = {"tests", "scripts", "build", "docs", "deploy", "systemd"}


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SKIP_DIRS or any(p.startswith(".") for p in parts):
            continue
        if len(parts) == 1 and parts[0] != "__init__":  # setup.py: the build, not the package
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((PACKAGE, *parts))] = path
    return modules


def imported_modules(name: str, source: str, known: Iterable[str]) -> set[str]:
    """The package's modules that module `name` imports anywhere in `source`.

    ``from scratchd.pkg import x`` names the submodule ``scratchd.pkg.x`` when there is one,
    else the package ``scratchd.pkg``; ``import scratchd.a.b`` names ``scratchd.a.b``.
    Relative imports are resolved against `name`.
    """
    modules = set(known)
    out: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _nearest(alias.name, modules)
                if found is not None:
                    out.add(found)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = name.split(".")
                # A package's own name is its __init__: relative imports start inside it.
                here = base_parts if _is_package(name, modules) else base_parts[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                    continue
                found = _nearest(base, modules)
                if found is not None:
                    out.add(found)
    out.discard(name)
    return out


def _is_package(name: str, modules: set[str]) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def _nearest(dotted: str, modules: set[str]) -> str | None:
    """`dotted` or the closest package above it that is a module of ours."""
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        return None
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {
        name: imported_modules(name, path.read_text(encoding="utf-8"), modules)
        for name, path in modules.items()
    }


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """The index in `layers` of the longest prefix matching `module`."""
    rel = module.removeprefix(PACKAGE).removeprefix(".")
    best, best_len = -1, -1
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            matches = rel == prefix or (prefix != "" and rel.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a path that
    returns to its start (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop(0)
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_circle_in(component, graph) for component in sorted(components)]


def _circle_in(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest circle through the component's first module, found breadth-first."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a component always has one


def upward_imports(
    graph: Mapping[str, Iterable[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if layer_of(target, layers) > layer_of(module, layers):
                found.append(f"{module} imports {target} from a higher layer")
    return found


def client_escapes(graph: Mapping[str, Iterable[str]]) -> list[str]:
    allowed = tuple(f"{PACKAGE}.{p}" for p in CLIENT_MAY_IMPORT)
    found = []
    for module in sorted(graph):
        if not module.startswith(f"{PACKAGE}.client"):
            continue
        for target in sorted(graph[module]):
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{module} imports {target} (client/ may import only protocol/)")
    return found


@functools.cache
def package_graph() -> dict[str, frozenset[str]]:
    """The package's import graph, parsed once per test session."""
    return {m: frozenset(t) for m, t in import_graph(package_modules()).items()}


def checked_graph() -> dict[str, set[str]]:
    """The package's graph less the allowed :data:`KNOWN_EDGES`."""
    graph = {m: set(t) for m, t in package_graph().items()}
    for module, target in KNOWN_EDGES:
        graph.get(module, set()).discard(target)
    return graph


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


# ---- the package ----------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    cycles = [" → ".join(c) for c in find_cycles(checked_graph())]
    assert not cycles, _report(cycles, "import circles (move the shared concept down)")


def test_imports_go_down_the_layers() -> None:
    upward = upward_imports(checked_graph())
    assert not upward, _report(upward, "upward imports (see LAYERS in tests/test_layers.py)")


def test_client_imports_only_protocol() -> None:
    escapes = client_escapes(checked_graph())
    assert not escapes, _report(escapes, "client/ imports outside protocol/ and client/")


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in package_modules() if layer_of(m) < 0]
    assert not unplaced, _report(unplaced, "modules in no layer of LAYERS")


def test_no_stale_allowance() -> None:
    graph = package_graph()
    stale = [f"{m} → {t}" for m, t in sorted(KNOWN_EDGES) if t not in graph.get(m, set())]
    assert not stale, _report(stale, "KNOWN_EDGES entries no longer needed: delete them")


# ---- the checker itself can fail --------------------------------------------------------------


def _graph_of(sources: Mapping[str, str]) -> dict[str, set[str]]:
    return {name: imported_modules(name, src, sources) for name, src in sources.items()}


def test_checker_flags_a_lazy_cycle() -> None:
    graph = _graph_of(
        {
            "scratchd.gpu": "",
            "scratchd.gpu.a": "from scratchd.gpu import b\n",
            "scratchd.gpu.b": "def f():\n    from scratchd.gpu.c import C\n",
            "scratchd.gpu.c": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
            ),
        }
    )
    assert find_cycles(graph) == [
        ["scratchd.gpu.a", "scratchd.gpu.b", "scratchd.gpu.c", "scratchd.gpu.a"]
    ]


def test_checker_flags_an_upward_import() -> None:
    graph = _graph_of(
        {
            "scratchd.kernels": "",
            "scratchd.kernels.views": "import numpy\ndef f():\n    import scratchd.model.net\n",
            "scratchd.model": "",
            "scratchd.model.net": "from scratchd.kernels.views import VIEWS\n",
        }
    )
    assert upward_imports(graph) == [
        "scratchd.kernels.views imports scratchd.model.net from a higher layer"
    ]
    assert find_cycles(graph) == [
        ["scratchd.kernels.views", "scratchd.model.net", "scratchd.kernels.views"]
    ]


def test_checker_flags_a_client_import_of_the_daemon() -> None:
    graph = _graph_of(
        {
            "scratchd.client.api": "from scratchd.protocol import wire\n",
            "scratchd.client.commands": "from scratchd.ipc.layout import SLOT\n",
            "scratchd.protocol.wire": "",
            "scratchd.ipc.layout": "",
        }
    )
    assert client_escapes(graph) == [
        "scratchd.client.commands imports scratchd.ipc.layout (client/ may import only protocol/)"
    ]


def test_layer_of_takes_the_longest_prefix() -> None:
    assert layer_of("scratchd") == 0
    assert layer_of("scratchd.newfolder.thing") == -1  # test_every_module_has_a_layer fails
    assert layer_of("scratchd.daemon.frontend.dispatch") > layer_of("scratchd.daemon.config")
    assert layer_of("scratchd.daemon.app") > layer_of("scratchd.daemon.ops.reload")
    assert layer_of("scratchd.kernels.views") < layer_of("scratchd.model.net")
