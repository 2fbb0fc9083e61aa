"""The manifest the entry point ``layer_boundary.plugins: cutedsl`` loads.

Light on purpose: it imports neither torch nor ``cutlass``. Discovery decides availability from it
(a CUDA device, then the ``nvidia-cutlass-dsl`` distribution, read through importlib.metadata) and
imports ``layer_boundary_cutedsl.hooks`` only when both hold.
"""

from __future__ import annotations

from layer_boundary.plugin_api import PluginManifest, Provides

__all__ = ["MANIFEST"]

MANIFEST = PluginManifest(
    name="cutedsl",
    api_version=1,  # the hook API this plugin is written against, not the core's current one
    provides=(Provides.NORM_KERNELS.value, Provides.FUSION_PROVIDERS.value),
    hooks="layer_boundary_cutedsl.hooks",
    requires_hardware="cuda",
    requires_distributions=("nvidia-cutlass-dsl",),
    vendor_library="CuTe DSL",
    description="CuTe DSL add+RMSNorm (Hopper) and the fused MoE-finalize handoff",
)
