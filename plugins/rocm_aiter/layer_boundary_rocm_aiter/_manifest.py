"""The manifest the entry point ``layer_boundary.plugins: rocm_aiter`` loads.

Light on purpose: it imports neither torch nor AITER. Its ``check`` (``detect.probe``) gives the
precise reason when AITER cannot run here; discovery imports ``layer_boundary_rocm_aiter.hooks``
only when it and the declared requirements hold.
"""

from __future__ import annotations

from layer_boundary.plugin_api import PluginManifest, Provides

from .detect import probe

__all__ = ["MANIFEST"]

MANIFEST = PluginManifest(
    name="rocm_aiter",
    api_version=1,  # the hook API this plugin is written against, not the core's current one
    provides=(Provides.NORM_KERNELS.value, Provides.FUSION_PROVIDERS.value),
    hooks="layer_boundary_rocm_aiter.hooks",
    requires_hardware="rocm",
    requires_distributions=("amd-aiter",),
    vendor_library="AITER",
    description="AMD AITER add+RMSNorm kernels and fused all-reduce + add + RMSNorm (ROCm)",
    check=probe,
)
