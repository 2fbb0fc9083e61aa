"""The CuTe DSL plugin's hook implementations, imported only where the plugin can run (a CUDA
device and the ``nvidia-cutlass-dsl`` distribution). Importing this module does not import the
DSL: the provider imports ``cutlass`` when construction first asks it for a kernel.

The fusion hook offers one ``CuteDslFusion`` (the MoE finalize handoff service) shared by every
stage the context builds; it lets no exit defer until ``install_cutedsl_fusion(model)`` runs.
"""

from __future__ import annotations

from typing import Any

from layer_boundary.plugin_api import hookimpl

from .fusion import CuteDslFusion
from .norm import CuTeDSLNormProvider

__all__ = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers"]


@hookimpl
def layer_boundary_norm_kernels() -> list[Any]:
    """Fused add + RMSNorm and RMSNorm, plain and Gemma (bf16, fp16) on Hopper."""
    return [CuTeDSLNormProvider()]


@hookimpl
def layer_boundary_fusion_providers() -> list[Any]:
    """The MoE finalize handoff fusion (inert until ``install_cutedsl_fusion``)."""
    return [CuteDslFusion()]
