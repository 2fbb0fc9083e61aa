"""Hook specifications (pluggy). Each hook is called once, when the registry is built.

Implement them with ``layer_boundary.plugin_api.hookimpl``; each returns a list (possibly empty).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # the specs are read at discovery, before anything imports torch
    from .._providers import FusionProvider, NormKernelProvider, ResidualSemantics

__all__ = ["PROJECT", "hookspec", "hookimpl", "LayerBoundarySpecs"]

PROJECT = "layer_boundary"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class LayerBoundarySpecs:
    @hookspec
    def layer_boundary_norm_kernels(self) -> list[NormKernelProvider]:
        """Norm-read kernel providers (``plugin_api.NormKernelProvider``)."""
        raise NotImplementedError  # a specification: pluggy calls the plugins' implementations

    @hookspec
    def layer_boundary_fusion_providers(self) -> list[FusionProvider]:
        """Fusion providers (``plugin_api.FusionProvider``), in preference order."""
        raise NotImplementedError

    @hookspec
    def layer_boundary_residual_semantics(self) -> list[ResidualSemantics]:
        """Named residual schemes (``plugin_api.ResidualSemantics``)."""
        raise NotImplementedError
