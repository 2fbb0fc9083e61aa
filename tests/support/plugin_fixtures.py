"""Real installed-looking plugins for discovery tests: ``*.dist-info`` folders plus modules.

:class:`PluginSite` writes, into one temporary folder that the test puts on ``sys.path``:

- ``<dist>-<version>.dist-info/`` with ``METADATA`` (Name, Version) and ``entry_points.txt``
  naming the plugin in the group ``layer_boundary.plugins``;
- ``lbt_<name>_manifest.py``, the light module the entry point names (a ``PluginManifest``);
- ``lbt_<name>_hooks.py``, the hook module the manifest names.

Every module touches ``<module>.imported`` beside itself when it is imported, so a test can prove
a module was never imported. Module names start with ``lbt_``; the ``plugin_site`` fixture drops
them from ``sys.modules`` afterwards so the next test imports its own copies.

Also here: in-process providers a vendor plugin would ship (norm kernels that count their calls, a
fusion provider with refusing and accepting candidates) and :func:`vendor_context`, a
``BoundaryContext`` whose registry holds them.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
import textwrap
from pathlib import Path
from collections import Counter
from typing import Any, Iterator, Optional, Sequence

import pytest
import torch

from layer_boundary import BoundaryContext
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary._plugins import ENTRY_POINT_GROUP, HOOK_API_VERSION, PluginRegistry, hookimpl
from layer_boundary.residual._add_norm import NormKernels

PREFIX = "lbt_"

_MARK = "from pathlib import Path as _P\n_P(__file__).with_name(__name__ + '.imported').touch()\n"

# Hook module body used when a test gives none: one provider of each kind, named after the plugin.
DEFAULT_HOOKS = '''
from layer_boundary.plugin_api import hookimpl


class Fusion:
    def __init__(self, name):
        self.name = name


class Norm:
    tolerance = {}

    def __init__(self, name):
        self.name = name

    def refuse(self, request):
        return "test provider serves nothing"

    def kernels(self, request):
        raise AssertionError("never chosen")


class Semantics:
    def __init__(self, name):
        self.name = name

    def stage(self, hidden_size, *, dtype, device=None):
        raise AssertionError("never used")

    exit = stage


@hookimpl
def layer_boundary_fusion_providers():
    return [Fusion(PLUGIN + "-fusion")]


@hookimpl
def layer_boundary_norm_kernels():
    return [Norm(PLUGIN + "-norm")]


@hookimpl
def layer_boundary_residual_semantics():
    return [Semantics(PLUGIN + "-residual")]
'''


class PluginSite:
    """A folder of fake installed distributions; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def module_names(self, name: str) -> tuple[str, str]:
        return f"{PREFIX}{name}_manifest", f"{PREFIX}{name}_hooks"

    def imported(self, module: str) -> bool:
        """Whether ``module`` (written by this site) was ever imported."""
        return (self.root / f"{module}.imported").exists()

    def hooks_imported(self, name: str) -> bool:
        return self.imported(self.module_names(name)[1])

    def manifest_imported(self, name: str) -> bool:
        return self.imported(self.module_names(name)[0])

    def distribution(self, dist: str, version: str = "1.0", entry_points: Sequence[tuple[str, str]] = ()) -> None:
        """A ``*.dist-info`` folder for ``dist`` with these ``(name, value)`` plugin entry points."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        if entry_points:
            lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{n} = {v}" for n, v in entry_points]
            (info / "entry_points.txt").write_text("\n".join(lines) + "\n")

    def module(self, module: str, source: str) -> None:
        (self.root / f"{module}.py").write_text(_MARK + textwrap.dedent(source))

    def add(
        self,
        name: str,
        *,
        dist: Optional[str] = None,
        version: str = "1.0",
        api_version: int = HOOK_API_VERSION,
        provides: Sequence[str] = ("fusion_providers", "norm_kernels", "residual_semantics"),
        manifest_name: Optional[str] = None,
        manifest_extra: str = "",
        manifest_source: Optional[str] = None,
        hooks_source: Optional[str] = None,
        entry_point: Optional[str] = None,
    ) -> None:
        """One plugin: its distribution (``lbt-<name>`` unless given), manifest and hook modules.

        ``manifest_extra``: more ``PluginManifest`` keyword arguments, as source text.
        ``manifest_source`` / ``hooks_source``: replace the generated module bodies.
        ``entry_point``: replace the entry point's value (``module:attribute``).
        """
        manifest_mod, hooks_mod = self.module_names(name)
        if manifest_source is None:
            manifest_source = f"""
                from layer_boundary.plugin_api import PluginManifest
                MANIFEST = PluginManifest(
                    name={manifest_name or name!r},
                    api_version={api_version!r},
                    provides={tuple(provides)!r},
                    hooks={hooks_mod!r},
                    {manifest_extra}
                )
                """
        self.module(manifest_mod, manifest_source)
        hooks_body = textwrap.dedent(DEFAULT_HOOKS if hooks_source is None else hooks_source)
        self.module(hooks_mod, f"PLUGIN = {name!r}\n" + hooks_body)
        self.distribution(dist or f"lbt-{name.replace('_', '-')}", version,
                          [(name, entry_point or f"{manifest_mod}:MANIFEST")])

    def mine(self, records: Sequence[Any]) -> list[Any]:
        """The records of plugins this site installed (other installed plugins left out)."""
        ours = {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP) if self._ours(ep)}
        return [r for r in records if r.name in ours]

    def foreign(self) -> list[str]:
        """Names of plugins installed outside this site (real plugins of this environment)."""
        return sorted({ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP) if not self._ours(ep)})

    def _ours(self, ep: md.EntryPoint) -> bool:
        return ep.dist is not None and Path(str(ep.dist.locate_file(""))) == self.root


def _drop_modules() -> None:
    for mod in [m for m in sys.modules if m.startswith(PREFIX)]:
        del sys.modules[mod]


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    """A fresh :class:`PluginSite` on ``sys.path``, with the plugin environment variables unset."""
    for var in ("LAYER_BOUNDARY_PLUGINS", "LAYER_BOUNDARY_DISABLE",
                "LAYER_BOUNDARY_DISABLE_PLUGIN_AUTOLOAD", "LAYER_BOUNDARY_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "site"
    root.mkdir()
    _drop_modules()
    monkeypatch.syspath_prepend(str(root))  # also invalidates importlib's finder caches
    try:
        yield PluginSite(root)
    finally:
        _drop_modules()
        importlib.invalidate_caches()


# -- in-process providers a vendor plugin would ship (selection and no-hook-call tests) --------------


class WideOnlyNorm:
    """Serves hidden sizes that are multiples of 128 only (a kernel's tile width)."""

    name = "wide-only-norm"
    tolerance = {torch.float32: (0.0, 0.0)}

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def refuse(self, request: Any) -> Optional[str]:
        if request.hidden_size % 128:
            return f"hidden size {request.hidden_size} is not a multiple of 128"
        return None

    def kernels(self, request: Any) -> NormKernels:
        return _counting(self.name, self.calls)


class CountingNorm:
    """Serves CPU requests with the torch reference, counting each kernel call."""

    name = "counting-norm"
    tolerance = {torch.float32: (0.0, 0.0)}

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.requests: list[Any] = []

    def refuse(self, request: Any) -> Optional[str]:
        if request.device_type != "cpu":
            return f"runs on cpu only, not {request.device_type}"
        return None

    def kernels(self, request: Any) -> NormKernels:
        self.requests.append(request)
        return _counting(self.name, self.calls)


def _counting(name: str, calls: Counter) -> NormKernels:
    def rmsnorm(*a: Any, **k: Any) -> torch.Tensor:
        calls["rmsnorm"] += 1
        return rmsnorm_ref(*a, **k)

    def fused_add_rmsnorm(*a: Any, **k: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["fused_add_rmsnorm"] += 1
        return fused_add_rmsnorm_ref(*a, **k)

    return NormKernels(name, rmsnorm, fused_add_rmsnorm)


class Candidate:
    """A consumer candidate: refuses statically with ``why`` or accepts; declines at run time."""

    sum_group = None

    def __init__(self, name: str, why: Optional[str] = None) -> None:
        self.name = name
        self.why = why
        self.calls = 0

    def refuse(self, plan: Any) -> Optional[str]:
        return self.why

    def __call__(self, contribution: Any, residual: Any, read: Any, forward_batch: Any) -> Any:
        self.calls += 1
        return None


class Fusion:
    """Fusion provider: for each input one statically refusing and one accepting candidate."""

    def __init__(self, name: str = "vendor-fusion") -> None:
        self.name = name
        self.attn = [Candidate("attn-needs-tp8", "needs an attention-TP group of 8"), Candidate("attn-fused")]
        self.ffn = [Candidate("ffn-fused"), Candidate("ffn-fp8-only", "FP8 activations only")]
        self.offers: Counter[str] = Counter()
        self.asked: Counter[str] = Counter()

    def attention_input(self, plan: Any) -> list[Candidate]:
        self.offers[plan.name] += 1
        return self.attn

    def ffn_input(self, plan: Any) -> list[Candidate]:
        self.offers[plan.name] += 1
        return self.ffn

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        self.asked["finalize"] += 1
        return False

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        self.asked["all_reduce"] += 1
        return False


class VendorPlugin:
    def __init__(self) -> None:
        self.wide, self.counting, self.fusion = WideOnlyNorm(), CountingNorm(), Fusion()

    @hookimpl
    def layer_boundary_norm_kernels(self) -> list[Any]:
        return [self.wide, self.counting]

    @hookimpl
    def layer_boundary_fusion_providers(self) -> list[Any]:
        return [self.fusion]


def vendor_context(**kw: Any) -> tuple[BoundaryContext, VendorPlugin]:
    registry = PluginRegistry([])
    plugin = VendorPlugin()
    registry.register(plugin, name="vendor")
    return BoundaryContext(registry=registry, **kw), plugin
