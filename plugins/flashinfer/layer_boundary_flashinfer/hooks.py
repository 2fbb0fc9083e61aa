"""FlashInfer's hook implementations, imported only where the plugin can run.

Empty for now: the FlashInfer norm-read kernels (``fused_add_rmsnorm``, ``gemma_fused_add_rmsnorm``
and their FP8 variants) and the fused all-reduce + add + RMSNorm consumer candidate arrive with
issue 6 ("GPU speed, part 1"). Until then the plugin registers, reports its availability and
offers nothing, so selection falls back to the core's kernels.
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
