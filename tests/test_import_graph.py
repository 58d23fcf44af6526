"""No import cycle between the parts of hf_kvspec.

Every module of the package is parsed with ``ast`` (nothing is imported), and each ``import`` statement —
module-level or inside a function (a lazy import is still a dependency) — becomes an edge between *nodes*: a
subpackage (``hf_kvspec.cache``, ``hf_kvspec.attention``, ``hf_kvspec.speculative``, ...) is one node, a top-level
module (``hf_kvspec._compat``, ``hf_kvspec.memory``, ``hf_kvspec.cli``, ...) is its own node. Imports under
``if TYPE_CHECKING:`` are left out: they never run. ``from hf_kvspec import Name`` of a lazily exported name counts
as an import of the module that defines it (``_EXPORTS`` of ``hf_kvspec/__init__.py``).

The test fails naming the cycle (with one import line per edge) if the node graph has any.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = "hf_kvspec"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Edges still in a cycle that need edits outside this test's reach, each with the import line that makes it.
# Remove an entry once its import is gone; the test also fails when an allowed edge no longer exists.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str:
    """``hf_kvspec.cache.paged`` -> ``hf_kvspec.cache``; ``hf_kvspec.memory`` -> itself; the package root stays."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _exports() -> dict[str, str]:
    """The lazy ``_EXPORTS`` map of the package root: public name -> defining module."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for stmt in tree.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else (stmt.targets[0] if isinstance(stmt, ast.Assign)
                                                                         else None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            return ast.literal_eval(stmt.value)
    raise AssertionError("hf_kvspec/__init__.py has no _EXPORTS map")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (n for stmt in child.orelse for n in _imports_in(stmt))
            continue
        yield from _imports_in(child)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str],
             exports: dict[str, str]) -> list[str]:
    """The hf_kvspec modules one import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    found = []
    for alias in node.names:
        full = f"{source}.{alias.name}"
        if full in modules:
            found.append(full)  # a submodule: `from hf_kvspec.cache import contract`
        elif source == PACKAGE and alias.name in exports:
            found.append(exports[alias.name])
        else:
            found.append(source)
    return found


def import_graph() -> dict[tuple[str, str], str]:
    """(node, node) -> one import line that makes the edge (``path:line: source``)."""
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in files}
    exports = _exports()
    edges: dict[tuple[str, str], str] = {}
    for path in files:
        module = _module_name(path)
        source = path.read_text()
        lines = source.splitlines()
        for node in _imports(ast.parse(source)):
            for target in _targets(node, module, path.name == "__init__.py", modules, exports):
                edge = (_node(module), _node(target))
                if edge[0] != edge[1] and edge[1] != PACKAGE:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                    edges.setdefault(edge, where)
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of the directed graph, or None (depth-first search, colours)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_between_subpackages():
    edges = import_graph()
    remaining = {edge: where for edge, where in edges.items() if edge not in ALLOWED_EDGES}
    cycle = find_cycle(remaining)
    if cycle:
        steps = "\n".join(f"  {a} -> {b}   ({remaining[(a, b)]})" for a, b in itertools.pairwise(cycle))
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{steps}")


def test_allowed_edges_still_exist():
    """An allow-list entry whose import is gone must be removed, so the list only shrinks."""
    edges = import_graph()
    assert [edge for edge in ALLOWED_EDGES if edge not in edges] == []


def test_the_checker_finds_a_cycle_and_lazy_imports():
    """The checker itself: a lazy import inside a function is an edge, and a two-node loop is reported."""
    tree = ast.parse("def f():\n    from hf_kvspec.cache import contract\nif TYPE_CHECKING:\n    import hf_kvspec.heads\n")
    found = [t for node in _imports(tree)
             for t in _targets(node, "hf_kvspec.speculative.x", False, {"hf_kvspec.cache.contract"}, {})]
    assert found == ["hf_kvspec.cache.contract"]
    assert find_cycle({("a", "b"): "", ("b", "c"): "", ("c", "a"): ""}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"): "", ("b", "c"): ""}) is None
