"""The import graph of ``moonplan`` has no cycle and no arrow back up (docs/design.md §5).

Every module under ``moonplan/`` is parsed with :mod:`ast`; its imports of
``moonplan.*`` modules (module level, inside functions, and under
``if TYPE_CHECKING:``: a type imported from the wrong file is a type in the wrong file)
become edges of a module graph. ``from moonplan.x import y`` is an edge to
``moonplan.x.y`` when ``y`` is a submodule, else to ``moonplan.x``; importing a package is
importing its ``__init__``. Each module's layer is its package's row in the layer table
of docs/design.md §5, read from the page itself: a module imports its own layer and
the ones above it in the table, never one below.

Legend: a module is named by its dotted name (``moonplan.comm.heap``); a package
by its dotted name too (its ``__init__.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moonplan

ROOT = Path(moonplan.__file__).resolve().parent
DESIGN = ROOT.parent / "docs" / "design.md"
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
    for node in ast.walk(tree):
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


def test_imports_of_reads_function_level_and_type_checking(tmp_path: Path) -> None:
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
    assert edges == {
        "moonplan",
        "moonplan.plan.api",
        "moonplan.plan",
        "moonplan.comm.heap",
        "moonplan.runtime.layer_runtime",
    }
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


# Arrows that still run back up, each with why it is there and who removes it. The test
# below fails when one is gone, so this list only shrinks.
KNOWN_BACK_ARROWS: set[tuple[str, str]] = set()


def layer_table(page: str) -> list[tuple[str, list[str]]]:
    """``[(layer, [package, ...]), ...]`` from the ``| layer | packages | ...`` table of
    ``page`` (docs/design.md), top row first."""
    lines = page[page.index("## 5. Layers of the code") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer | packages |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], re.findall(r"`([\w]+)`", cells[1])))
    return rows


def layer_of() -> dict[str, int]:
    """Top-level package or module of ``moonplan`` (``__init__`` for the package's own
    ``__init__.py``) -> its row in the layer table (0: the top, the leaves)."""
    return {
        pkg: row for row, (_, pkgs) in enumerate(layer_table(DESIGN.read_text())) for pkg in pkgs
    }


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def back_arrows(graph: dict[str, set[str]], layers: dict[str, int]) -> set[tuple[str, str]]:
    """``(importer, imported)`` pairs whose imported module sits on a lower row (a higher
    layer) of the table than its importer."""
    return {(a, b) for a, bs in graph.items() for b in bs if layers[_top(b)] > layers[_top(a)]}


def test_the_layer_table_reads_from_the_design_page() -> None:
    table = layer_table(DESIGN.read_text())
    assert table[0] == ("leaves", ["errors", "checks", "cost", "tables", "moved", "host_arrays"])
    assert table[-1][0] == "front ends" and "cli" in table[-1][1]
    graph = {"moonplan.cost": {"moonplan.cli.main"}, "moonplan.cli.main": {"moonplan.cost"}}
    assert back_arrows(graph, layer_of()) == {("moonplan.cost", "moonplan.cli.main")}


def test_every_package_has_one_layer() -> None:
    named = [pkg for _, pkgs in layer_table(DESIGN.read_text()) for pkg in pkgs]
    assert len(named) == len(set(named)), "a package named in two layers"
    tops = {_top(m) for m in module_files()}
    assert sorted(tops - set(named)) == [], "packages missing from docs/design.md's table"
    assert sorted(set(named) - tops) == [], "the table names packages that do not exist"


def test_no_import_runs_back_up_a_layer() -> None:
    graph, _ = import_graph()
    found = back_arrows(graph, layer_of())
    assert sorted(found - KNOWN_BACK_ARROWS) == [], "imports of a lower layer (docs/design.md §5)"
    assert sorted(KNOWN_BACK_ARROWS - found) == [], "gone: remove it from KNOWN_BACK_ARROWS"
