"""The vendor plugins (FlashInfer, CuTe DSL, AITER) as discovery sees them on any machine.

Their kernels come in later issues; what holds now: each manifest loads without torch or its
vendor library, each reports on this machine exactly why it cannot run, its hook module imports
and offers nothing where it can, and the AITER probe tells apart every way AITER can be missing,
including PyPI's unrelated ``aiter`` package, without ever raising out of discovery.

The plugins are the installed ones (the README's set-up installs ``plugins/*``); metadata,
``torch.version.hip`` and GPU counts are replaced with fakes where a test needs another machine.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import logging
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from layer_boundary._plugins import ENTRY_POINT_GROUP, PluginRegistry, PluginStatus
from layer_boundary._plugins.discovery import DiscoveryOptions, find_plugins


@dataclass(frozen=True)
class Vendor:
    name: str  # plugin (entry point) name
    package: str
    distribution: str  # the plugin's own distribution
    vendor_distribution: str
    vendor_library: str
    vendor_modules: tuple[str, ...]
    hardware: str


VENDORS = (
    Vendor("flashinfer", "layer_boundary_flashinfer", "layer-boundary-flashinfer", "flashinfer-python",
           "FlashInfer", ("flashinfer",), "cuda"),
    Vendor("cutedsl", "layer_boundary_cutedsl", "layer-boundary-cutedsl", "nvidia-cutlass-dsl",
           "CuTe DSL", ("cutlass",), "cuda"),
    Vendor("rocm_aiter", "layer_boundary_rocm_aiter", "layer-boundary-rocm-aiter", "amd-aiter",
           "AITER", ("aiter",), "rocm"),
)
BY_NAME = {v.name: v for v in VENDORS}
CUDA_VENDORS = [v for v in VENDORS if v.hardware == "cuda"]
IS_ROCM = getattr(torch.version, "hip", None) is not None


def _entry_point(name: str) -> md.EntryPoint:
    eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    assert eps, (f"plugin {name!r} is not installed; the README's set-up installs it "
                 f"(pip install -e plugins/{name})")
    return eps[0]


def _examine(name: str) -> Any:
    """Discovery's record for one installed plugin (the others are left alone: allowlist)."""
    _entry_point(name)
    (rec,) = [r for r in find_plugins(DiscoveryOptions(allow=(name,))) if r.name == name]
    return rec


@pytest.fixture
def fake_metadata(monkeypatch):
    """Distribution metadata as another machine would have it: ``versions`` (name -> version or
    None for absent), ``owners`` (module -> distributions) and ``files`` (distribution -> files).
    Names not mentioned fall through to the real metadata."""

    class Fake:
        versions: dict[str, Optional[str]] = {}
        owners: dict[str, list[str]] = {}
        files: dict[str, list[str]] = {}
        summaries: dict[str, str] = {}

    real_version, real_distribution = md.version, md.distribution

    def norm(name: str) -> str:
        return name.lower().replace("_", "-")

    def version(name: str) -> str:
        found = {norm(k): v for k, v in Fake.versions.items()}
        if norm(name) in found:
            if found[norm(name)] is None:
                raise md.PackageNotFoundError(name)
            return found[norm(name)]
        return real_version(name)

    def distribution(name: str) -> Any:
        if norm(name) in {norm(k) for k in Fake.versions}:
            v = version(name)
            return types.SimpleNamespace(
                version=v, files=list(Fake.files.get(name, [])),
                metadata={"Name": name, "Version": v, "Summary": Fake.summaries.get(name, "")},
            )
        return real_distribution(name)

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(md, "distribution", distribution)
    monkeypatch.setattr(md, "packages_distributions", lambda: dict(Fake.owners))
    return Fake


@pytest.fixture
def rocm_machine(monkeypatch):
    """torch as a ROCm build with ``gpus`` visible GPUs (set ``machine.gpus``)."""
    state = types.SimpleNamespace(gpus=1)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state.gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state.gpus > 0)
    return state


@pytest.fixture
def detect():
    _entry_point("rocm_aiter")
    return importlib.import_module("layer_boundary_rocm_aiter.detect")


# -- manifests: light, and declaring what they need ----------------------------------------------

_LIGHT_PROBE = textwrap.dedent("""
    import importlib.abc, importlib.metadata as md, json, sys
    import layer_boundary.plugin_api, layer_boundary._plugins.manifest  # the core itself; it may import torch

    BLOCKED = set(sys.argv[1].split(","))   # torch, the vendor modules, each plugin's hooks module

    def blocked(name):
        return any(name == b or name.startswith(b + ".") for b in BLOCKED)

    # Hide what the core imported, and refuse to import it again, so that an import of torch or a
    # vendor library by a manifest module fails loudly here instead of hitting sys.modules' cache.
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if blocked(k)}
    attempts = []

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if blocked(name):
                attempts.append(name)
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    out = {}
    for name in sys.argv[2].split(","):
        ep = [e for e in md.entry_points(group="layer_boundary.plugins") if e.name == name][0]
        before = set(sys.modules)
        try:
            manifest = ep.load()
            error = None
        except Exception as e:
            manifest, error = None, f"{type(e).__name__}: {e}"
        new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in sys.stdlib_module_names)
        out[name] = {"error": error, "attempts": list(attempts), "new": new,
                     "type": type(manifest).__name__, "manifest_name": getattr(manifest, "name", None)}
        attempts.clear()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def light_loads() -> dict[str, dict]:
    for v in VENDORS:
        _entry_point(v.name)
    blocked = ["torch", *(m for v in VENDORS for m in v.vendor_modules),
               *(f"{v.package}.hooks" for v in VENDORS)]
    proc = subprocess.run(
        [sys.executable, "-c", _LIGHT_PROBE, ",".join(blocked), ",".join(v.name for v in VENDORS)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v.name)
def test_manifest_loads_without_torch_the_vendor_library_or_the_hooks(light_loads, vendor):
    got = light_loads[vendor.name]
    assert got["error"] is None, got["error"]
    assert got["attempts"] == [], f"the manifest of {vendor.name} imports {got['attempts']}"
    assert (got["type"], got["manifest_name"]) == ("PluginManifest", vendor.name)
    # Only the plugin's own light modules are new (the package, its manifest and, for AITER, the probe).
    assert all(m == vendor.package or m.startswith(vendor.package + ".") for m in got["new"]), got["new"]
    assert f"{vendor.package}.hooks" not in got["new"]


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v.name)
def test_manifest_declares_hardware_vendor_distribution_and_what_it_provides(vendor):
    ep = _entry_point(vendor.name)
    m = ep.load()
    assert ep.value == f"{vendor.package}._manifest:MANIFEST"
    assert ep.dist is not None and ep.dist.metadata["Name"] == vendor.distribution
    assert (m.name, m.api_version, m.hooks) == (vendor.name, 1, f"{vendor.package}.hooks")
    assert m.provides == ("norm_kernels", "fusion_providers")
    assert m.requires_hardware == vendor.hardware
    assert m.requires_distributions == (vendor.vendor_distribution,)
    assert m.vendor_library == vendor.vendor_library
    # The vendor library is an optional extra of the plugin, never one of its requirements.
    requires = ep.dist.requires or []
    hard = [r for r in requires if "extra ==" not in r]
    assert hard == ["layer-boundary"], hard
    vendor_extra = [r for r in requires if 'extra == "vendor"' in r]
    assert [r.split(";")[0].strip() for r in vendor_extra] == [vendor.vendor_distribution], requires
    assert not any(r.startswith("torch") for r in requires)


# -- on this machine -----------------------------------------------------------------------------


@pytest.mark.parametrize("vendor", CUDA_VENDORS, ids=lambda v: v.name)
def test_cuda_plugin_reports_why_it_cannot_run_here(vendor):
    rec = _examine(vendor.name)
    if IS_ROCM:
        expected = f"needs CUDA, but torch {torch.__version__} is a ROCm build"
    elif not torch.cuda.is_available():
        expected = f"no CUDA device (torch {torch.__version__} sees none)"
    else:
        try:
            md.version(vendor.vendor_distribution)
        except md.PackageNotFoundError:
            expected = (f"{vendor.vendor_library} not installed "
                        f"(distribution {vendor.vendor_distribution} not found)")
        else:
            pytest.skip(f"{vendor.vendor_distribution} and a CUDA device are both here: the plugin is "
                        "meant to be active (its kernels are tested by their own GPU tests)")
    assert (rec.status, rec.reason) == (PluginStatus.UNAVAILABLE, expected)
    assert rec.hooks is None


def test_rocm_plugin_reports_why_it_cannot_run_here():
    rec = _examine("rocm_aiter")
    if IS_ROCM:
        pytest.skip("torch is a ROCm build here: the fake-machine tests below cover the reasons")
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason == (f"not a ROCm build of torch (torch {torch.__version__}, torch.version.hip is "
                          "None); AITER runs only on ROCm")


@pytest.mark.parametrize("vendor", CUDA_VENDORS, ids=lambda v: v.name)
def test_cuda_plugin_on_a_cuda_machine_without_its_library_names_the_distribution(vendor, monkeypatch,
                                                                                 fake_metadata):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_metadata.versions = {vendor.vendor_distribution: None}
    rec = _examine(vendor.name)
    assert (rec.status, rec.reason) == (
        PluginStatus.UNAVAILABLE,
        f"{vendor.vendor_library} not installed (distribution {vendor.vendor_distribution} not found)",
    )


# What each CUDA plugin registers once active.
OFFERS = {"flashinfer": (["flashinfer"], ["flashinfer-allreduce-fusion"]), "cutedsl": (["cutedsl"], ["cutedsl-moe-finalize"])}


@pytest.mark.parametrize("vendor", CUDA_VENDORS, ids=lambda v: v.name)
def test_cuda_plugin_with_device_and_library_is_active_without_importing_it(vendor, monkeypatch,
                                                                           fake_metadata):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for module in vendor.vendor_modules:  # a GPU session may have imported the real one earlier
        monkeypatch.delitem(sys.modules, module, raising=False)
    fake_metadata.versions = {vendor.vendor_distribution: "1.0"}
    rec = _examine(vendor.name)
    assert rec.status is PluginStatus.ACTIVE, rec.reason
    reg = PluginRegistry([rec], DiscoveryOptions(allow=(vendor.name,)))
    assert reg.records[0].status is PluginStatus.ACTIVE
    norms, fusions = OFFERS[vendor.name]
    assert [p.name for _, p in reg.norm_kernels] == norms
    assert [p.name for _, p in reg.fusion_providers] == fusions
    for module in vendor.vendor_modules:  # the hooks do not import the vendor library itself
        assert module not in sys.modules


# -- the AITER probe, on fake machines ------------------------------------------------------------


def test_aiter_probe_on_a_cuda_or_cpu_build_says_so_first(detect, monkeypatch, fake_metadata):
    monkeypatch.setattr(torch.version, "hip", None)
    fake_metadata.versions = {"amd-aiter": "0.1.5", "aiter": "0.0.3"}
    fake_metadata.owners = {"aiter": ["aiter"]}  # even with the wrong aiter, ROCm comes first
    assert detect.probe().startswith("not a ROCm build of torch (torch ")


def test_aiter_probe_rocm_build_without_amd_aiter(detect, rocm_machine, fake_metadata):
    fake_metadata.versions = {"amd-aiter": None}
    fake_metadata.owners = {}
    assert detect.probe() == (
        "AITER not installed (distribution amd-aiter not found); "
        "pip install 'layer-boundary-rocm-aiter[vendor]' (or pip install amd-aiter)"
    )


def test_aiter_probe_names_the_unrelated_aiter_package(detect, rocm_machine, fake_metadata):
    fake_metadata.versions = {"amd-aiter": None, "aiter": "0.0.3"}
    fake_metadata.owners = {"aiter": ["aiter"]}
    fake_metadata.files = {"aiter": ["aiter/__init__.py", "aiter-0.0.3.dist-info/METADATA"]}
    reason = detect.probe()
    assert reason.startswith(
        "AITER not installed: the module 'aiter' here comes from the distribution aiter 0.0.3")
    assert "unrelated async-iterator library, not AMD's AITER" in reason
    assert reason.endswith("pip uninstall aiter && pip install amd-aiter")


def test_aiter_probe_tells_an_old_source_build_from_the_unrelated_package(detect, rocm_machine, fake_metadata):
    # AITER source builds from before the rename registered the distribution "aiter" themselves.
    fake_metadata.versions = {"amd-aiter": None, "aiter": "0.1.0+git1234"}
    fake_metadata.owners = {"aiter": ["aiter"]}
    fake_metadata.files = {"aiter": ["aiter/__init__.py", "aiter/jit/core.py"]}
    reason = detect.probe()
    assert "an AITER build registered under its old distribution name" in reason
    assert "unrelated" not in reason
    assert reason.endswith("pip uninstall aiter && pip install amd-aiter")


def test_aiter_probe_both_installed_is_a_conflict(detect, rocm_machine, fake_metadata):
    fake_metadata.versions = {"amd-aiter": "0.1.5", "aiter": "0.0.3"}
    fake_metadata.owners = {"aiter": ["amd-aiter", "aiter"]}
    reason = detect.probe()
    assert reason.startswith(
        "the module 'aiter' is installed both by amd-aiter 0.1.5 and by the distribution aiter 0.0.3")
    assert "pip uninstall aiter && pip install --force-reinstall amd-aiter" in reason


def test_aiter_probe_amd_aiter_without_a_gpu(detect, rocm_machine, fake_metadata, monkeypatch):
    rocm_machine.gpus = 0
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    fake_metadata.versions = {"amd-aiter": "0.1.5"}
    fake_metadata.owners = {"aiter": ["amd-aiter"]}
    assert detect.probe() == (
        f"no ROCm GPU visible (torch {torch.__version__}, HIP 6.2.41133-dd7f95766, sees none; "
        "HIP_VISIBLE_DEVICES='')"
    )


def test_aiter_probe_all_present_imports_aiter_and_passes(detect, rocm_machine, fake_metadata, monkeypatch):
    fake_metadata.versions = {"amd-aiter": "0.1.5"}
    fake_metadata.owners = {"aiter": ["amd_aiter"]}  # metadata may spell the name either way
    fake_aiter = types.ModuleType("aiter")
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter)
    assert detect.probe() is None


def test_aiter_import_raising_runtime_error_is_a_reason_not_an_exception(detect, rocm_machine, fake_metadata,
                                                                         monkeypatch):
    fake_metadata.versions = {"amd-aiter": "0.1.5"}
    fake_metadata.owners = {"aiter": ["amd-aiter"]}

    def import_aiter():
        raise RuntimeError("HIP runtime not found\n(long traceback text)")

    monkeypatch.setattr(detect, "_import_aiter", import_aiter)
    assert detect.probe() == (
        "amd-aiter 0.1.5 is installed but importing aiter raised RuntimeError: HIP runtime not found")


def test_aiter_gpu_query_raising_is_a_reason_not_an_exception(detect, rocm_machine, fake_metadata,
                                                              monkeypatch):
    fake_metadata.versions = {"amd-aiter": "0.1.5"}
    fake_metadata.owners = {"aiter": ["amd-aiter"]}

    def device_count():
        raise RuntimeError("hipErrorNoDevice")

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    assert detect.probe().endswith("for GPUs raised RuntimeError: hipErrorNoDevice")


# -- the AITER probe through discovery ------------------------------------------------------------


def test_discovery_reports_the_unrelated_aiter_rather_than_a_bare_missing_distribution(rocm_machine,
                                                                                       fake_metadata):
    # The core's declared check alone would say "AITER not installed (distribution amd-aiter not
    # found)"; the plugin's probe knows why, and its reason wins.
    fake_metadata.versions = {"amd-aiter": None, "aiter": "0.0.3"}
    fake_metadata.owners = {"aiter": ["aiter"]}
    rec = _examine("rocm_aiter")
    assert rec.status is PluginStatus.UNAVAILABLE
    assert "unrelated async-iterator library" in rec.reason and rec.hooks is None


def test_discovery_activates_aiter_where_everything_holds(rocm_machine, fake_metadata, monkeypatch):
    fake_metadata.versions = {"amd-aiter": "0.1.5"}
    fake_metadata.owners = {"aiter": ["amd-aiter"]}
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    rec = _examine("rocm_aiter")
    assert rec.status is PluginStatus.ACTIVE, rec.reason
    reg = PluginRegistry([rec], DiscoveryOptions(allow=("rocm_aiter",)))
    assert (reg.norm_kernels, reg.fusion_providers) == ([], [])


def test_a_probe_that_raises_is_reported_failed_not_raised(rocm_machine, fake_metadata, monkeypatch, caplog):
    fake_metadata.versions = {"amd-aiter": "0.1.5"}

    def broken_metadata():
        raise OSError("unreadable RECORD in site-packages")

    monkeypatch.setattr(md, "packages_distributions", broken_metadata)
    rec = _examine("rocm_aiter")
    assert rec.status is PluginStatus.FAILED
    assert rec.reason == "its availability check raised OSError: unreadable RECORD in site-packages"
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = PluginRegistry([rec], DiscoveryOptions())  # not strict, nothing asked for by name
    assert reg.records[0].status is PluginStatus.FAILED
    assert any("rocm_aiter" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


def test_a_probe_that_raises_where_a_declared_requirement_fails_keeps_the_declared_reason(monkeypatch):
    # On a CUDA or CPU build the probe runs outside its preconditions; its exception is not a defect.
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(md, "packages_distributions", lambda: 1 / 0)
    import layer_boundary_rocm_aiter.detect as detect

    monkeypatch.setattr(detect, "_torch", lambda: 1 / 0)
    rec = _examine("rocm_aiter")
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason == f"not a ROCm build of torch (torch {torch.__version__})"
