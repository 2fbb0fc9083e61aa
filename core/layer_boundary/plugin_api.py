"""The vendor SDK: provider protocols, request and kernel types, the torch references, the fused
all-reduce base, refusal helpers, ``hookimpl``, ``PluginManifest`` and tolerances.

The one export list is ``plugin_api.pyi``; names load on first use, so a plugin's light manifest
imports ``PluginManifest`` from here without importing torch.
"""

from __future__ import annotations

from ._lazy import attach_stub

__getattr__, __dir__, __all__ = attach_stub(__name__, __file__, globals())
