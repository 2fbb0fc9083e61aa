"""The walls of DESIGN.md, read from the sources: the core never imports the application, a
plugin, or a command.

Every module under ``core/layer_boundary`` is parsed with ``ast`` and each import is resolved to
an absolute module name, at module level and inside functions, relative (``from ..cli import``)
and absolute alike. Nothing is imported, so a wall broken only on a path no test runs is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

CORE = Path(__file__).resolve().parents[1] / "core" / "layer_boundary"


def _module_name(path: Path, core: Path) -> str:
    parts = list(path.relative_to(core.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, core: Path = CORE) -> Iterator[tuple[int, str, bool]]:
    """``(line, absolute name, whether it must be a module)`` of every import in ``path``, wherever
    it stands (``from a import b``: ``a`` must be a module, ``a.b`` may be a name in it)."""
    module = _module_name(path, core)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, True
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target, True
            # ``from .. import cli`` names a module as much as ``import layer_boundary.cli`` does.
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}", False


def _is_core_module(name: str) -> bool:
    path = CORE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def wall_broken(importer: str, target: str, module: bool = False) -> str | None:
    """Why ``importer`` (a core module) may not import ``target`` (None: it may); ``module``: the
    target must be a module, so a core name that is none (``..launch`` after the launcher left
    for the application) is a wall broken too."""
    top = target.split(".", 1)[0]
    if module and top == "layer_boundary" and not _is_core_module(target):
        return "no such core module (the application's modules left the core: import nothing of them)"
    if top == "layer_boundary_app":
        return "the application (layer-boundary-app)"
    if top.startswith("layer_boundary_"):
        return f"a plugin ({top})"
    in_cli = importer == "layer_boundary.cli" or importer.startswith("layer_boundary.cli.")
    if (target == "layer_boundary.cli" or target.startswith("layer_boundary.cli.")) and not in_cli:
        return "the command line (nothing in the library imports a command)"
    return None


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def violations(paths: list[Path], core: Path = CORE) -> list[str]:
    """``core``: the folder the paths' module names are read from (a planted copy's in the tests)."""
    out = []
    for path in paths:
        importer = _module_name(path, core)
        for line, target, module in imported_modules(path, core):
            why = wall_broken(importer, target, module)
            if why is not None:
                out.append(f"{path.relative_to(core.parent)}:{line} imports {target}: {why}")
    return sorted(set(out))


def test_the_core_imports_no_application_plugin_or_command():
    assert len(core_modules()) > 50  # the walk found the core
    assert violations(core_modules()) == []


@pytest.mark.parametrize("source, reason", [
    ("from layer_boundary_app.launch import spawn\n", "the application"),
    ("def f():\n    import layer_boundary_mhc.cluster_ops\n", "a plugin (layer_boundary_mhc)"),
    ("def f():\n    from ..cli import commands\n", "the command line"),
    ("from ..cli.main import main\n", "the command line"),
    ("import layer_boundary.cli.main\n", "the command line"),
    ("def f():\n    from ..launch import spawn\n", "no such core module"),
    ("from layer_boundary.models.runner import RunSpec\n", "no such core module"),
])
def test_a_planted_import_is_found(tmp_path, source, reason):
    # A module planted in a copy's layout (layer_boundary/adapters/planted.py), module level and
    # function level, relative and absolute.
    core = tmp_path / "layer_boundary"
    (core / "adapters").mkdir(parents=True)
    planted = core / "adapters" / "planted.py"
    planted.write_text(source)
    found = violations([planted], core)
    assert len(found) >= 1 and all(reason in v for v in found), found


def test_the_core_cli_may_import_itself():
    assert wall_broken("layer_boundary.cli.main", "layer_boundary.cli.commands") is None
    assert wall_broken("layer_boundary.cli.main", "layer_boundary_app.cli.commands") is not None
