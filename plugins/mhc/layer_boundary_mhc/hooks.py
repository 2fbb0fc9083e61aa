"""Hook implementations of the ``mhc`` plugin (imported only once discovery accepts it)."""

from __future__ import annotations

from typing import Any

from layer_boundary.plugin_api import hookimpl

from .semantics import MhcSemantics

__all__ = ["layer_boundary_residual_semantics"]


@hookimpl
def layer_boundary_residual_semantics() -> list[Any]:
    """The ``mhc`` scheme with its defaults: 4 streams, 20 Sinkhorn iterations, mean exit."""
    return [MhcSemantics()]
