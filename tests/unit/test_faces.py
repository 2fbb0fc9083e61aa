"""The public faces: ``layer_boundary`` (engines), ``layer_boundary.plugin_api`` (vendors) and
``layer_boundary.testing`` (the kit). Each has one export list; a face stub is read at run time."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from layer_boundary._lazy import attach_stub

CORE = Path(__file__).resolve().parents[2] / "core" / "layer_boundary"
STUB_FACES = {"layer_boundary": CORE / "__init__.pyi", "layer_boundary.plugin_api": CORE / "plugin_api.pyi"}


def _stub_names(stub: Path) -> set[str]:
    return {a.asname for n in ast.parse(stub.read_text()).body if isinstance(n, ast.ImportFrom)
            for a in n.names if n.module != "__future__"}


@pytest.mark.parametrize("face", sorted(STUB_FACES))
def test_face_exports_exactly_its_stub_and_every_name_resolves(face):
    module = importlib.import_module(face)
    assert sorted(module.__all__) == sorted(_stub_names(STUB_FACES[face]))
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="has no attribute 'Owed'"):
        getattr(module, "Owed")


def test_faces_import_without_torch():
    # A plugin's manifest imports the vendor SDK at every startup, usable or not.
    script = textwrap.dedent("""
        import sys
        import layer_boundary, layer_boundary.plugin_api
        from layer_boundary.plugin_api import PluginManifest, Provides, HOOK_API_VERSION, hookimpl
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _face(tmp_path: Path, stub: str) -> dict:
    pkg = tmp_path / "face_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "impl.py").write_text("A = 1\nB = 2\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("C = 3\n")
    (pkg / "api.pyi").write_text(textwrap.dedent(stub))
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        namespace: dict = {}
        getattr_, dir_, names = attach_stub("face_pkg.api", str(pkg / "api.py"), namespace)
        return {"getattr": getattr_, "dir": dir_, "names": names, "namespace": namespace}
    finally:
        sys.path.remove(str(tmp_path))


def test_stub_reader_resolves_names_and_submodules(tmp_path, monkeypatch):
    face = _face(tmp_path, '''
        """doc"""
        from .impl import A as A
        from .impl import B as Bee
        from .sub import leaf as leaf
        __version__: str
    ''')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert face["names"] == ["A", "Bee", "leaf"]
    assert face["getattr"]("A") == 1 and face["getattr"]("Bee") == 2
    assert face["getattr"]("leaf").C == 3
    assert face["namespace"]["A"] == 1  # cached: the next lookup does not come back here
    with pytest.raises(AttributeError, match="has no attribute 'B'"):
        face["getattr"]("B")


@pytest.mark.parametrize("line, why", [
    ("from .impl import A", "explicit re-export"),
    ("X = 1", "holds only"),
    ("import os", "holds only"),
])
def test_stub_reader_refuses_what_it_could_misread(tmp_path, line, why):
    with pytest.raises(SyntaxError, match=why):
        _face(tmp_path, line + "\n")
