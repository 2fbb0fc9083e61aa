"""Hook specifications (pluggy). Each hook is called once, when the registry is built.

Implement them with ``layer_boundary.plugins.hookimpl``; each returns a list (possibly empty).
"""

from __future__ import annotations

from typing import Any

import pluggy

__all__ = ["PROJECT", "hookspec", "hookimpl", "LayerBoundarySpecs"]

PROJECT = "layer_boundary"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class LayerBoundarySpecs:
    @hookspec
    def layer_boundary_norm_kernels(self) -> list[Any]:
        """Norm-read kernel providers (``layer_boundary.providers.NormKernelProvider``)."""

    @hookspec
    def layer_boundary_fusion_providers(self) -> list[Any]:
        """Fusion providers (``layer_boundary.providers.FusionProvider``), in preference order."""

    @hookspec
    def layer_boundary_residual_semantics(self) -> list[Any]:
        """Named residual schemes (``layer_boundary.providers.ResidualSemantics``)."""
