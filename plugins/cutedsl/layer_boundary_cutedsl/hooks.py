"""The CuTe DSL plugin's hook implementations, imported only where the plugin can run.

Empty for now: the CuTe DSL fused add + RMSNorm kernel (Hopper, sm_90) and the MoE-finalize
handoff fusion provider (``can_defer_finalize``) arrive with issue 7 ("GPU speed, part 2"). Until
then the plugin registers, reports its availability and offers nothing, so selection falls back
to the core's kernels.
"""

from __future__ import annotations

from typing import Any

from layer_boundary.plugins import hookimpl

__all__ = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers"]


@hookimpl
def layer_boundary_norm_kernels() -> list[Any]:
    return []


@hookimpl
def layer_boundary_fusion_providers() -> list[Any]:
    return []
