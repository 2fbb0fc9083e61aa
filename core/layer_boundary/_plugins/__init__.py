"""Plugins: hook specifications, manifests, entry-point discovery and the registry.

Nothing here runs at ``import layer_boundary``; call :func:`discover` (or build a
``BoundaryContext`` with ``BoundaryContext.discover()``) to find plugins. Names load on first
use, so a plugin's manifest module imports ``layer_boundary._plugins.manifest`` without pulling
in pluggy or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ENTRY_POINT_GROUP": ".manifest",
    "HOOK_API_VERSION": ".manifest",
    "PluginManifest": ".manifest",
    "PluginStatus": ".manifest",
    "Provides": ".manifest",
    "PluginError": ".discovery",
    "PluginRecord": ".discovery",
    "PluginRegistry": ".registry",
    "discover": ".registry",
    "hookimpl": ".hookspecs",
    "hookspec": ".hookspecs",
}

if TYPE_CHECKING:
    from .discovery import PluginError, PluginRecord
    from .hookspecs import hookimpl, hookspec
    from .manifest import ENTRY_POINT_GROUP, HOOK_API_VERSION, PluginManifest, PluginStatus, Provides
    from .registry import PluginRegistry, discover

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
