"""The plugin's manifest: what the entry point ``layer_boundary.plugins: mhc`` loads.

This module imports nothing of its own package beyond this file; the semantics (torch) are in
``layer_boundary_mhc.hooks`` and its imports, which discovery loads only once the manifest's
hook-API version matches the core's.
"""

from __future__ import annotations

from layer_boundary.plugin_api import HOOK_API_VERSION, PluginManifest

__all__ = ["MANIFEST"]

MANIFEST = PluginManifest(
    name="mhc",
    api_version=HOOK_API_VERSION,
    provides=("residual_semantics",),
    hooks="layer_boundary_mhc.hooks",
    description="manifold-constrained hyper-connections: n residual streams, Sinkhorn-projected mixing",
)
