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

CORE = Path(__file__).resolve().parents[2] / "core" / "layer_boundary"


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
            # ``from .. import cli`` names a module as much as ``import layer_boundary._cli`` does.
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
    in_cli = importer == "layer_boundary._cli" or importer.startswith("layer_boundary._cli.")
    if (target == "layer_boundary._cli" or target.startswith("layer_boundary._cli.")) and not in_cli:
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
    ("def f():\n    from .._cli import commands\n", "the command line"),
    ("from .._cli.main import main\n", "the command line"),
    ("import layer_boundary._cli.main\n", "the command line"),
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
    assert wall_broken("layer_boundary._cli.main", "layer_boundary._cli.commands") is None
    assert wall_broken("layer_boundary._cli.main", "layer_boundary_app.cli.commands") is not None


APP = Path(__file__).resolve().parents[2] / "plugins" / "app" / "layer_boundary_app"

# The faces the application may use: it is written as an engine (and, for its benchmarks of
# providers, a vendor) would write against the core.
FACES = {"layer_boundary", "layer_boundary.plugin_api", "layer_boundary.testing", "layer_boundary.residual.batch"}


def _face_names(stub: str) -> set[str]:
    tree = ast.parse((CORE / stub).read_text())
    return {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names} | {
        t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target] if isinstance(t, ast.Name)}


def app_violations(root: Path = APP) -> list[str]:
    faces = {"layer_boundary": _face_names("__init__.pyi"), "layer_boundary.plugin_api": _face_names("plugin_api.pyi")}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mod, names = node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mod, names = "", [a.name for a in node.names]
            else:
                continue
            for target in ([mod] if mod else names):
                if target.split(".")[0] != "layer_boundary":
                    continue
                if mod == "layer_boundary.residual" and names == ["batch"]:
                    continue  # the spec's path of the batch helpers
                if target not in FACES:
                    out.append(f"{rel}:{node.lineno} imports {target}, not a face of the core")
                elif mod in faces:
                    out += [f"{rel}:{node.lineno} imports {n} from {mod}, which its face does not export"
                            for n in names if n not in faces[mod]]
    return out


def test_the_application_imports_only_the_faces():
    assert len(list(APP.rglob("*.py"))) > 20
    assert app_violations() == []


# Every distribution under plugins/ (the vendors' and the application) is held to the same wall.
DISTRIBUTIONS = sorted(p for p in APP.parents[1].glob("*/layer_boundary_*") if (p / "__init__.py").is_file())


@pytest.mark.parametrize("package", DISTRIBUTIONS, ids=lambda p: p.parent.name)
def test_every_distribution_imports_only_the_faces(package):
    assert len(DISTRIBUTIONS) == 5
    assert app_violations(package) == []


def test_a_private_import_planted_in_the_application_is_found(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "planted.py").write_text(
        "from layer_boundary import Topology, StreamState\n"
        "def f():\n    from layer_boundary._ops import all_reduce\n")
    found = app_violations(tmp_path)
    assert any("StreamState from layer_boundary" in v for v in found), found
    assert any("layer_boundary._ops, not a face" in v for v in found), found
    assert not any("Topology" in v for v in found), found
