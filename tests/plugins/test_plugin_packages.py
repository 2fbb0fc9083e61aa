"""The plugin packages as a user gets them: wheels, a fresh virtual environment, the command line.

Once per module: build the core's and every in-repo plugin's wheel with ``pip wheel --no-deps
--no-build-isolation`` from a copy of the sources (the checkout stays clean), write three
third-party plugin wheels, create a fresh virtual environment, install torch into it from this
machine's local files, then the core and one plugin through the core's extra
(``layer-boundary[flashinfer]``) with ``--no-index --find-links`` the wheel folder, and later the
application through the ``app`` extra (``layer-boundary[app]``: ``run``). The third-party
plugins are:

- ``acme_fusion``: a fusion provider whose attention-input candidate accepts every stage;
- ``broken``: its manifest loads, its hook module raises on import;
- ``incompatible``: written for hook API 999;
- ``future``: built for a newer core (its metadata requires ``layer-boundary>=99``, its manifest
  imports a name this core lacks), installed with ``--no-deps`` so that pip does not refuse it.

Every command runs the installed ``layer-boundary`` script of the fresh environment, from a
folder outside the repository, with no ``PYTHONPATH``: nothing of the checkout or of the test
environment is importable there.

torch comes from pip's configured sources, as the README's ``pip install torch==2.13.0`` gets it
(on this machine: the CPU wheel on local disk), with ``--no-compile``: the install then takes about
30 s instead of about 45 s, and the first command compiles only the modules it imports.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"name", "distribution", "version", "api_version", "provides", "status", "reason"}
CANDIDATE = "acme-allreduce-add-rmsnorm"

# Third-party plugins: (distribution, plugin name, module, manifest keywords, hooks source).
_FUSION_HOOKS = f'''
"""A vendor's fusion provider: one consumer candidate for the attention input."""

from layer_boundary.plugin_api import hookimpl


class AllReduceAddNorm:
    name = {CANDIDATE!r}
    sum_group = None

    def refuse(self, plan):
        return None  # eligible for every stage; the core still refuses the stack entry

    def __call__(self, contribution, residual, read, forward_batch):
        return None  # declines before touching anything: the boundary's own path runs


class AcmeFusion:
    name = "acme"

    def attention_input(self, plan):
        return [AllReduceAddNorm()]


@hookimpl
def layer_boundary_fusion_providers():
    return [AcmeFusion()]
'''
_BROKEN_HOOKS = 'raise RuntimeError("acme-broken: simulated defect at import")\n'
_EMPTY_HOOKS = '''
from layer_boundary.plugin_api import hookimpl


@hookimpl
def layer_boundary_fusion_providers():
    return []
'''
_FUSION = "provides=('fusion_providers',)"
THIRD_PARTY = (
    ("acme-fusion", "acme_fusion", "acme_fusion", f"api_version=1, {_FUSION}", _FUSION_HOOKS),
    ("acme-broken", "broken", "acme_broken", f"api_version=1, {_FUSION}", _BROKEN_HOOKS),
    ("acme-incompatible", "incompatible", "acme_incompatible", f"api_version=999, {_FUSION}", _EMPTY_HOOKS),
)
FUTURE = "acme-future"


@dataclass
class FreshEnv:
    root: Path
    wheels: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def bin(self) -> Path:
        return self.root / "venv" / "bin"

    def pip(self, *args: str) -> None:
        # This interpreter's pip drives the fresh environment (pip --python): the fresh one needs
        # no pip of its own.
        cmd = [sys.executable, "-m", "pip", "--python", str(self.bin / "python"), "install",
               "--no-compile", "--disable-pip-version-check", "-q", *args]
        _check(subprocess.run(cmd, capture_output=True, text=True, cwd=self.root))

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("LAYER_BOUNDARY_", "PYTHON", "VIRTUAL_ENV"))}
        base.update(PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONNOUSERSITE="1", **env)
        return subprocess.run([str(self.bin / "layer-boundary"), *args], capture_output=True, text=True,
                              cwd=self.root, env=base, timeout=300)

    def cli_many(self, calls: dict[str, tuple[tuple[str, ...], dict[str, str]]]) -> dict[str, Any]:
        """Run independent commands side by side (each mostly waits on importing torch)."""
        with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
            futures = {k: pool.submit(self.cli, *args, **env) for k, (args, env) in calls.items()}
            return {k: f.result() for k, f in futures.items()}


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _copy_sources(dest: Path) -> list[Path]:
    """The core's and the plugins' build inputs, copied so the build leaves the checkout clean."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "*.pyc")
    core = dest / "layer-boundary"
    core.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, core / name)
    shutil.copytree(REPO / "core", core / "core", ignore=ignore)
    projects = [core]
    for plugin in sorted((REPO / "plugins").iterdir()):
        if (plugin / "pyproject.toml").is_file():
            projects.append(Path(shutil.copytree(plugin, dest / plugin.name, ignore=ignore)))
    return projects


def _write_third_party_wheels(wheels: Path) -> None:
    """Each third-party plugin as a pure-Python wheel, written directly (what any build backend
    would produce for a package with an entry point), so that pip installs it like any other."""
    for dist, name, module, keywords, hooks in THIRD_PARTY:
        manifest = ("from layer_boundary._plugins.manifest import PluginManifest\n\n"
                    f"MANIFEST = PluginManifest(name={name!r}, {keywords}, hooks='{module}.hooks')\n")
        _write_wheel(wheels, dist, "1.0", {
            f"{module}/__init__.py": "",
            f"{module}/manifest.py": manifest,
            f"{module}/hooks.py": hooks,
        }, entry_points=f"[layer_boundary.plugins]\n{name} = {module}.manifest:MANIFEST\n")
    _write_wheel(wheels, FUTURE, "1.0", {
        "acme_future/__init__.py": "",
        "acme_future/manifest.py": "from layer_boundary._plugins.manifest import PluginManifestV2\n",
    }, entry_points="[layer_boundary.plugins]\nfuture = acme_future.manifest:MANIFEST\n",
        requires="layer-boundary>=99")


def _write_wheel(folder: Path, dist: str, version: str, files: dict[str, str], *, entry_points: str,
                 requires: str = "layer-boundary") -> Path:
    stem = f"{dist.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                             f"Requires-Dist: {requires}\n"),
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: tests/plugins/test_plugin_packages.py\n"
                          "Root-Is-Purelib: true\nTag: py3-none-any\n"),
        f"{info}/entry_points.txt": entry_points,
    }
    record = []
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for arc, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
            whl.writestr(arc, data)
        whl.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> FreshEnv:
    """Wheels built, a fresh environment with torch, the core and the FlashInfer plugin."""
    root = tmp_path_factory.mktemp("packages")
    env = FreshEnv(root=root, wheels=root / "wheels")
    projects = _copy_sources(root / "src")

    t0 = time.perf_counter()
    _check(subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(env.wheels), *map(str, projects)],
        capture_output=True, text=True, cwd=root,
    ))
    _write_third_party_wheels(env.wheels)
    env.timings["build wheels"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                          capture_output=True, text=True))
    # torch as the README installs it, pinned to the version under test; the core's other
    # dependencies (pyproject.toml's list) from the same place, so that the --no-index installs
    # below find them present.
    env.pip(f"torch=={torch.__version__.split('+')[0]}", "pluggy>=1.7", "safetensors>=0.4", "numpy>=1.24",
            "packaging>=22")
    env.timings["fresh venv + torch"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    env.pip("--no-index", "--find-links", str(env.wheels), "layer-boundary[flashinfer]")
    env.timings["core + flashinfer (extra)"] = time.perf_counter() - t0
    return env


@pytest.fixture(scope="module")
def core_only(fresh) -> dict:
    """What the fresh environment says before any third-party plugin is installed."""
    listed = _check(fresh.cli("plugins", "--json"))
    # The core alone has no run: the application (layer-boundary-app) brings it.
    without_app = fresh.cli("run", "--input-ids", "1")
    freeze = _check(subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(fresh.bin / "python"), "list", "--format", "json",
         "--disable-pip-version-check"], capture_output=True, text=True))
    return {"plugins": json.loads(listed.stdout), "pip": {d["name"]: d for d in json.loads(freeze.stdout)},
            "run without app": without_app}


@pytest.fixture(scope="module")
def with_third_party(fresh, core_only) -> dict[str, subprocess.CompletedProcess]:
    """Install the application through the core's extra and the three third-party plugins, then
    run every command the tests below read."""
    t0 = time.perf_counter()
    fresh.pip("--no-index", "--find-links", str(fresh.wheels), "layer-boundary[app]")
    fresh.pip("--no-index", "--find-links", str(fresh.wheels), *(d for d, *_ in THIRD_PARTY))
    fresh.pip("--no-index", "--find-links", str(fresh.wheels), "--no-deps", FUTURE)
    fresh.timings["third-party plugins"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = fresh.cli_many({
        "plugins": (("plugins", "--json", "--check", "acme_fusion", "broken", "flashinfer"), {}),
        "run": (("run", "--input-ids", "5,7,11,13"), {}),
        "run broken": (("run",), {"LAYER_BOUNDARY_PLUGINS": "broken"}),
        "run incompatible": (("run",), {"LAYER_BOUNDARY_PLUGINS": "acme_fusion,incompatible"}),
        "run strict": (("run",), {"LAYER_BOUNDARY_STRICT_PLUGINS": "1"}),
    })
    fresh.timings["five commands"] = time.perf_counter() - t0
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in fresh.timings.items()))
    return results


def _expected_cuda_reason() -> Optional[str]:
    if getattr(torch.version, "hip", None) is not None:
        return f"needs CUDA, but torch {torch.__version__} is a ROCm build"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__} sees none)"
    return None


def _by_name(records: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in records}


# -- the core and one plugin, installed through the extra ----------------------------------------


def test_fresh_environment_holds_the_wheels_and_nothing_of_the_checkout(fresh, core_only):
    pip = core_only["pip"]
    for dist in ("layer-boundary", "layer-boundary-flashinfer"):
        assert pip[dist]["version"] == "0.1.0"
        assert "editable_project_location" not in pip[dist], f"{dist} came from the checkout"
    others = ("layer-boundary-mhc", "layer-boundary-cutedsl", "layer-boundary-rocm-aiter", "layer-boundary-app")
    assert not any(n.startswith("acme-") or n in others for n in pip)
    assert "flashinfer-python" not in pip  # the vendor library stays an optional extra of the plugin
    built = sorted(p.name.split("-")[0] for p in fresh.wheels.glob("*.whl"))
    for module in ("layer_boundary", "layer_boundary_app", "layer_boundary_flashinfer", "layer_boundary_cutedsl",
                   "layer_boundary_rocm_aiter", "acme_fusion"):
        assert module in built


def test_plugins_json_lists_the_installed_plugin_with_its_status(core_only):
    records = core_only["plugins"]
    assert [r["name"] for r in records] == ["flashinfer"]
    rec = records[0]
    assert FIELDS <= set(rec)
    assert rec["distribution"] == "layer-boundary-flashinfer" and rec["version"] == "0.1.0"
    assert rec["api_version"] == 1
    assert rec["provides"] == ["norm_kernels", "fusion_providers"]
    expected = _expected_cuda_reason()
    if expected is not None:
        assert (rec["status"], rec["reason"]) == ("unavailable", expected)
    else:  # a CUDA machine: FlashInfer itself is not installed in the fresh environment
        assert (rec["status"], rec["reason"]) == (
            "unavailable", "FlashInfer not installed (distribution flashinfer-python not found)")


def test_run_without_the_application_names_the_distribution_to_install(core_only):
    proc = core_only["run without app"]
    assert proc.returncode == 2
    assert ("layer-boundary run: this command comes from the distribution layer-boundary-app, which is not "
            "installed here; pip install layer-boundary-app") in proc.stderr
    assert "invalid choice" not in proc.stderr


# -- third-party plugins: one chosen, one broken, one incompatible --------------------------------


def test_plugins_json_reports_every_plugin_with_its_status_and_reason(with_third_party):
    proc = with_third_party["plugins"]
    recs = _by_name(json.loads(proc.stdout))
    assert list(recs) == ["acme_fusion", "broken", "flashinfer", "future", "incompatible"]  # sorted by name
    assert all(FIELDS <= set(r) for r in recs.values())
    assert recs["acme_fusion"]["status"] == "active" and recs["acme_fusion"]["reason"] == ""
    assert recs["acme_fusion"]["distribution"] == "acme-fusion" and recs["acme_fusion"]["version"] == "1.0"
    assert recs["acme_fusion"]["provides"] == ["fusion_providers"]
    assert recs["broken"]["status"] == "failed"
    assert recs["broken"]["reason"] == (
        "importing 'acme_broken.hooks' raised RuntimeError: acme-broken: simulated defect at import")
    assert recs["incompatible"]["status"] == "incompatible"
    assert recs["incompatible"]["api_version"] == 999
    assert "hook API 999" in recs["incompatible"]["reason"]
    assert "acme-incompatible" in recs["incompatible"]["reason"]  # what to reinstall
    assert recs["flashinfer"]["status"] == "unavailable"
    # pip --no-deps installed it against a core it does not support: told from its metadata, before
    # its manifest (which would fail to import) is loaded
    assert recs["future"]["status"] == "incompatible" and recs["future"]["api_version"] is None
    assert recs["future"]["reason"] == (
        "acme-future 1.0 needs layer-boundary>=99, and this is layer-boundary 0.1.0; install a "
        "layer-boundary that meets it, or a version of acme-future built for 0.1.0")


def test_plugins_check_exits_non_zero_naming_each_plugin_that_is_not_active(with_third_party):
    proc = with_third_party["plugins"]  # --check acme_fusion broken flashinfer
    assert proc.returncode == 1
    assert "broken is not active (failed: importing 'acme_broken.hooks'" in proc.stderr
    assert "flashinfer is not active (unavailable: " in proc.stderr
    assert "acme_fusion is not active" not in proc.stderr


def _selection(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = lines.index("selection:") + 1
    return [ln.strip() for ln in lines[start:] if ln.startswith("  ")]


def test_run_chooses_the_third_party_candidate_and_skips_the_bad_plugins(with_third_party):
    proc = _check(with_third_party["run"])
    assert "plugins:  acme_fusion (active), broken (failed), flashinfer (unavailable), " \
           "future (incompatible), incompatible (incompatible)" in proc.stdout
    fusion = [ln for ln in _selection(proc.stdout) if "consumer fusion [attention_input]" in ln]
    layers = int(re.search(r"^stages: +(\d+) boundaries", proc.stdout, re.M).group(1)) // 2
    # Every attention stage but the first takes the candidate; the first, at the stack entry, has
    # nothing owed to fuse and says so, naming the candidate and its plugin. The core's own
    # candidate comes after the plugin's and says why it does not serve gloo (the CPU's backend:
    # not on this device).
    assert (f"attn ORDINARY x{layers - 1}: consumer fusion [attention_input] -> {CANDIDATE}   not on this "
            "device: symm-mem all-reduce + add + rmsnorm (core): needs a nccl group; tp uses gloo") in fusion
    assert (f"attn ORDINARY x1: consumer fusion [attention_input] -> none   refused: {CANDIDATE} "
            "(acme_fusion): stack entry: nothing is owed to this input") in fusion
    assert "forward:" in proc.stdout and "logits:   [4, " in proc.stdout
    # The skipped plugins are said to be skipped, with their reasons, not silently dropped.
    assert "plugin broken (acme-broken) is failed and skipped: importing 'acme_broken.hooks'" in proc.stderr
    assert "plugin incompatible (acme-incompatible) is incompatible and skipped: built for hook API 999" \
        in proc.stderr
    assert "plugin future (acme-future) is incompatible and skipped: acme-future 1.0 needs layer-boundary>=99" \
        in proc.stderr


@pytest.mark.parametrize("key, reason", [
    ("run broken", "plugin 'broken' is asked for by name but is failed: importing 'acme_broken.hooks' "
                   "raised RuntimeError: acme-broken: simulated defect at import"),
    ("run incompatible",
     "plugin 'incompatible' is asked for by name but is incompatible: built for hook API 999"),
    ("run strict", "plugin broken (acme-broken) is failed: importing 'acme_broken.hooks' raised "
                   "RuntimeError: acme-broken: simulated defect at import [strict plugin mode: "
                   "LAYER_BOUNDARY_STRICT_PLUGINS / strict=True]"),
])
def test_a_bad_plugin_asked_for_by_name_or_under_strict_mode_stops_run_with_its_reason(with_third_party, key,
                                                                                        reason):
    proc = with_third_party[key]
    assert proc.returncode != 0
    assert reason in proc.stderr, proc.stderr
    assert "forward:" not in proc.stdout
