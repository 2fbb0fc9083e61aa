"""Plugins: hook specifications, manifests, entry-point discovery and the registry.

Nothing here runs at ``import layer_boundary``; call :func:`discover` (or build a
``BoundaryContext`` with ``BoundaryContext.discover()``) to find plugins.
"""

from .discovery import PluginError, PluginRecord
from .hookspecs import hookimpl, hookspec
from .manifest import ENTRY_POINT_GROUP, HOOK_API_VERSION, PluginManifest, PluginStatus, Provides
from .registry import PluginRegistry, discover

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOK_API_VERSION",
    "PluginError",
    "PluginManifest",
    "PluginRecord",
    "PluginRegistry",
    "PluginStatus",
    "Provides",
    "discover",
    "hookimpl",
    "hookspec",
]
