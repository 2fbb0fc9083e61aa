"""Lazy public faces: importing a face stays light (no torch), and each name loads its module on
first use (PEP 562).

A face's export list is written once, as the ``.pyi`` stub beside it (``from .x import A as A``
lines): type checkers read the stub, and :func:`attach_stub` reads the same lines at run time to
build the lazy table and ``__all__``. This is the Scientific Python "lazy loading" pattern (SPEC 1),
chosen because the alternatives write every name two or three times (a table, ``TYPE_CHECKING``
imports and ``__all__``) and drift apart.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["attach_stub", "lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``exports[name]`` (a module name,
    relative to ``package`` when it starts with a dot) and caches it in ``namespace``."""
    table = {name: (module, name) for name, module in exports.items()}
    return _getattr(package, table, namespace)


def attach_stub(package: str, file: str, namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the face ``file`` from its ``.pyi`` stub.

    The stub may hold only ``from <module> import <name> as <alias>`` lines (the alias makes the
    re-export explicit for type checkers), docstrings, ``from __future__`` imports and dunder
    annotations (``__version__: str``, defined by the module itself); anything else
    is refused, so the stub stays a plain list that this reader cannot misread.
    """
    stub = Path(file).with_suffix(".pyi")
    table: dict[str, tuple[str, str]] = {}
    for node in ast.parse(stub.read_text(), str(stub)).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.startswith("__"):
            continue  # ``__version__: str``, defined in the module itself
        if not isinstance(node, ast.ImportFrom):
            raise SyntaxError(f"{stub}:{node.lineno}: a face stub holds only 'from ... import ... as ...' lines")
        module = "." * node.level + (node.module or "")
        for alias in node.names:
            if alias.asname is None:
                raise SyntaxError(
                    f"{stub}:{node.lineno}: write 'import {alias.name} as {alias.name}' so that type "
                    "checkers see an explicit re-export")
            table[alias.asname] = (module, alias.name)
    names = sorted(table)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    # a stub's relative imports are relative to the package that holds the face module
    anchor = package if Path(file).stem == "__init__" else package.rpartition(".")[0]
    return _getattr(package, table, namespace, anchor), __dir__, names


def _getattr(package: str, table: Mapping[str, tuple[str, str]], namespace: dict[str, Any],
             anchor: str | None = None) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        try:
            module, attr = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        owner = importlib.import_module(module, anchor or package)
        try:
            value = getattr(owner, attr)
        except AttributeError:  # ``from .pkg import submodule as name``: the submodule itself
            value = importlib.import_module(f"{owner.__name__}.{attr}")
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__
