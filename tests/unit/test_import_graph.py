"""The module graphs of the core and of every distribution under ``plugins/`` have no cycle,
counting imports inside functions and under ``if TYPE_CHECKING:``.

A function-level import only hides a cycle from Python's import machinery, and a type-only import
hides it from Python altogether: the two modules still need each other (one for its types), and
which one is "lower" is no longer readable from the code. A type two layers share lives in a leaf
module below both (``_plan``, ``_declarations``; the MHC plugin's ``derived``), or the lower one
names what it needs as a protocol (``residual._stream.HoldsStream``). This test parses every module
of a package with ``ast`` (nothing is imported), resolves every import, relative or absolute, to
modules of the package (``from . import x`` goes to the submodule ``x`` where ``x`` is one), and
fails naming every cycle it finds.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = "layer_boundary"
# The core and the distributions under plugins/ (each checked on its own: walls, tested in
# test_walls.py, keep imports between them one-way).
PACKAGES = (PACKAGE, "layer_boundary_app", "layer_boundary_mhc", "layer_boundary_flashinfer",
            "layer_boundary_cutedsl", "layer_boundary_rocm_aiter")


def _package_root(package: str = PACKAGE) -> Path:
    spec = importlib.util.find_spec(package)  # finds the package without running it
    assert spec is not None and spec.origin is not None, f"{package} is not installed"
    return Path(spec.origin).parent


def _modules(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in ``tree``: functions, classes and ``if TYPE_CHECKING:``
    bodies included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import x` imports the submodule pkg.x when there is one, else pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            # `import a.b.c` binds a but runs a.b.c: the deepest package module named is the edge.
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(root, package)
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path ``[a, b, ..., a]`` through each strongly connected component of more than
    one module (Tarjan's algorithm, iterative: the graph is a few hundred modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return [_closed_path(graph, set(c)) for c in comps]


def _closed_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    first = min(comp)
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & comp):
                if nxt == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return [first, *reversed(path[:-1]), first] if node != first else [first, first]
                if nxt not in prev:
                    prev[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {first} in its component")


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_no_import_cycle(package: str) -> None:
    found = cycles(import_graph(_package_root(package), package))
    assert not found, (f"import cycles in {package} (function-level and type-only imports count):\n"
                       + "\n".join(" -> ".join(c) for c in found))


# -- the checker itself: it must see what it claims to see --------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_finds_a_cycle_closed_by_a_function_level_import(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from . import a\n",
    })
    assert cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_resolves_subpackages_and_absolute_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "",
        "sub/x.py": "import pkg.top\n",
        "top.py": "class C:\n    def m(self):\n        from .sub.x import y\n",
        "free.py": "from .sub import x\n",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.free"] == {"pkg.sub.x"}
    assert cycles(graph) == [["pkg.sub.x", "pkg.top", "pkg.sub.x"]]


def test_type_checking_imports_count(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from .b import T\nelse:\n    T = None\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
    })
    assert cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_names_every_module_of_a_longer_cycle(tmp_path: Path) -> None:
    n = 3
    files = {"__init__.py": ""}
    for i in range(n):
        files[f"m{i}.py"] = f"def g():\n    from .m{(i + 1) % n} import g\n"
    assert cycles(import_graph(_tree(tmp_path, files), "pkg")) == [["pkg.m0", "pkg.m1", "pkg.m2", "pkg.m0"]]
