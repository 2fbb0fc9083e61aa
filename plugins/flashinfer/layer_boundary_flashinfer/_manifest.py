"""The manifest the entry point ``layer_boundary.plugins: flashinfer`` loads.

Light on purpose: it imports neither torch nor FlashInfer. Discovery decides availability from it
(a CUDA device, then the ``flashinfer-python`` distribution, read through importlib.metadata) and
imports ``layer_boundary_flashinfer.hooks`` only when both hold.
"""

from __future__ import annotations

from layer_boundary.plugin_api import PluginManifest, Provides

__all__ = ["MANIFEST"]

MANIFEST = PluginManifest(
    name="flashinfer",
    api_version=1,  # the hook API this plugin is written against, not the core's current one
    provides=(Provides.NORM_KERNELS.value, Provides.FUSION_PROVIDERS.value),
    hooks="layer_boundary_flashinfer.hooks",
    requires_hardware="cuda",
    requires_distributions=("flashinfer-python",),
    vendor_library="FlashInfer",
    description="FlashInfer add+RMSNorm kernels and fused all-reduce + add + RMSNorm (NVIDIA GPUs)",
)
