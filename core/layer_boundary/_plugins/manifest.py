"""The plugin manifest: what a plugin is, before any of its heavy modules is imported.

A plugin's entry point (group ``layer_boundary.plugins``) names a :class:`PluginManifest` in a
light module that imports neither torch nor its vendor library. Discovery checks the hook-API
version and the declared requirements from it, and imports ``hooks`` only when they hold.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["HOOK_API_VERSION", "ENTRY_POINT_GROUP", "Provides", "PluginManifest", "PluginStatus"]

HOOK_API_VERSION = 1
ENTRY_POINT_GROUP = "layer_boundary.plugins"


class Provides(str, enum.Enum):
    NORM_KERNELS = "norm_kernels"
    FUSION_PROVIDERS = "fusion_providers"
    RESIDUAL_SEMANTICS = "residual_semantics"


class PluginStatus(str, enum.Enum):
    ACTIVE = "active"  # registered; its providers take part in selection
    UNAVAILABLE = "unavailable"  # its hardware or vendor library is missing here
    FAILED = "failed"  # it raised while loading (a defect of the plugin or its install)
    DISABLED = "disabled"  # left out by configuration
    INCOMPATIBLE = "incompatible"  # built for another hook-API version


@dataclass(frozen=True)
class PluginManifest:
    """Declaration of a plugin.

    ``hooks``: ``"module"`` or ``"module:attribute"`` holding the hook implementations, imported
    only once every requirement holds. ``requires_hardware``: ``None``, ``"cuda"`` or ``"rocm"``.
    ``requires_distributions``: distribution names that must be installed (checked through
    importlib.metadata, never by importing them). ``check``: an optional probe of the plugin's
    own that returns why the plugin cannot run here, or ``None``. It is asked after the declared
    hardware and distributions are checked, even when one of them fails, and its reason then
    replaces the declared one (it may know better, e.g. that an unrelated distribution owns the
    vendor's module); it must not assume the declared requirements hold, and an exception it
    raises counts only when they do.
    """

    name: str
    api_version: int
    provides: tuple[str, ...]
    hooks: str
    requires_hardware: Optional[str] = None
    requires_distributions: tuple[str, ...] = ()
    vendor_library: Optional[str] = None
    description: str = ""
    check: Optional[Callable[[], Optional[str]]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"plugin name {self.name!r} must be an identifier (letters, digits, _)")
        if isinstance(self.api_version, bool) or not isinstance(self.api_version, int):
            raise ValueError(f"plugin {self.name}: api_version must be an int, got {self.api_version!r}")
        for what in ("provides", "requires_distributions"):
            value = getattr(self, what)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"plugin {self.name}: {what} must be a tuple of names, got {value!r} "
                                 f"(for one name: ({value!r},))")
        known = {p.value for p in Provides}
        bad = [p for p in self.provides if p not in known]
        if bad:
            raise ValueError(f"plugin {self.name}: provides {bad} unknown; choose from {sorted(known)}")
        if self.requires_hardware not in (None, "cuda", "rocm"):
            raise ValueError(
                f"plugin {self.name}: requires_hardware={self.requires_hardware!r}; use None, 'cuda' or 'rocm'"
            )
        if not isinstance(self.hooks, str) or not self.hooks:
            raise ValueError(f"plugin {self.name}: hooks must name a module ('pkg.mod' or 'pkg.mod:obj')")
