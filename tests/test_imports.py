"""The import graph of ``moonplan`` has no cycle (docs/design.md §5).

Every module under ``moonplan/`` is parsed with :mod:`ast`; its imports of
``moonplan.*`` modules (module level and inside functions, but not under
``if TYPE_CHECKING:``) become edges of a module graph. ``from moonplan.x import y``
is an edge to ``moonplan.x.y`` when ``y`` is a submodule, else to ``moonplan.x``;
importing a package is importing its ``__init__``.

Legend: a module is named by its dotted name (``moonplan.comm.heap``); a package
by its dotted name too (its ``__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import moonplan

ROOT = Path(moonplan.__file__).resolve().parent
# Front ends may use the package front door (``import moonplan``); nothing else may.
FRONT_DOOR_OK = ("moonplan.cli",)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package."""
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _walk_runtime(node: ast.AST) -> list[ast.AST]:
    """All nodes below ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.AST] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        found.append(cur)
        for child in ast.iter_child_nodes(cur):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return found


def _absolute(name: str, node: ast.ImportFrom, path: Path) -> str:
    """Resolve a (possibly relative) ``from`` import to a dotted module name."""
    if node.level == 0:
        return node.module or ""
    pkg = list(path.relative_to(ROOT.parent).with_suffix("").parts)[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], bool]:
    """(moonplan modules ``name`` imports, whether it does a bare ``import moonplan``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    edges: set[str] = set()
    front_door = False
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "moonplan":
                    front_door = True
                if alias.name.split(".")[0] == "moonplan" and alias.name in modules:
                    edges.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(name, node, path)
            if mod.split(".")[0] != "moonplan":
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                edges.add(sub if sub in modules else mod)
            if mod == "moonplan" and any(f"moonplan.{a.name}" not in modules for a in node.names):
                front_door = True
    edges.discard(name)
    return edges, front_door


def import_graph() -> tuple[dict[str, set[str]], set[str]]:
    """Module -> imported modules, and the modules that import the front door."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    front: set[str] = set()
    for name, path in modules.items():
        graph[name], door = imports_of(name, path, modules)
        if door:
            front.add(name)
    return graph, front


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def test_cycle_finder_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_of_reads_function_level_and_skips_type_checking(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from moonplan.plan import api\n"
        "from moonplan.plan import Plan\n"
        "if TYPE_CHECKING:\n"
        "    from moonplan.runtime.layer_runtime import LayerRuntime\n"
        "def f():\n"
        "    import moonplan.comm.heap\n"
        "    import moonplan\n"
    )
    edges, door = imports_of("probe", src, module_files())
    assert edges == {"moonplan", "moonplan.plan.api", "moonplan.plan", "moonplan.comm.heap"}
    assert door


def test_graph_sees_known_edges() -> None:
    graph, _ = import_graph()
    assert "moonplan.plan.api" in graph
    assert any(m.startswith("moonplan.") for m in graph["moonplan.core.moe"])


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    cycles = find_cycles(graph)
    for comp in cycles:
        print("cycle:", " <-> ".join(comp))
        for v in comp:
            print("   ", v, "->", sorted(graph[v] & set(comp)))
    assert cycles == []


def test_only_front_ends_use_the_front_door() -> None:
    _, front = import_graph()
    bad = sorted(m for m in front if not m.startswith(FRONT_DOOR_OK) and m != "moonplan")
    assert bad == [], f"modules doing `import moonplan`: {bad}"
