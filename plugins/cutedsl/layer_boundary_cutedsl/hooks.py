"""The CuTe DSL plugin's hook implementations, imported only where the plugin can run (a CUDA
device and the ``nvidia-cutlass-dsl`` distribution). Importing this module does not import the
DSL: the provider imports ``cutlass`` when construction first asks it for a kernel.

The MoE-finalize handoff fusion provider (``can_defer_finalize``) is not written yet, so the
fusion hook offers nothing and selection keeps the core's path there.
"""

from __future__ import annotations

from typing import Any

from layer_boundary.plugins import hookimpl

from .norm import CuTeDSLNormProvider

__all__ = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers"]


@hookimpl
def layer_boundary_norm_kernels() -> list[Any]:
    """Fused add + RMSNorm and RMSNorm, plain and Gemma (bf16, fp16) on Hopper."""
    return [CuTeDSLNormProvider()]


@hookimpl
def layer_boundary_fusion_providers() -> list[Any]:
    return []
