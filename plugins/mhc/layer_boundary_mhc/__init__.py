"""layer-boundary-mhc: manifold-constrained hyper-connections (DeepSeek's mHC) as residual semantics.

The residual becomes ``n`` streams ``x [T, n, C]``. Each stage reads ``norm(H_pre x)`` and updates
``x' = H_res x + H_post^T y`` with per-token coefficients computed in FP32 from its input streams;
``H_res`` is doubly stochastic (Sinkhorn-Knopp). Select it by name::

    context = BoundaryContext.discover()
    model = Qwen3ForCausalLM(config, context=context, residual="mhc")

Importing this package is light (no torch): the entry point loads only the manifest, and the
names below are imported on first use.
"""

from __future__ import annotations

from layer_boundary.plugin_api import lazy_exports

from ._manifest import MANIFEST

__all__ = [
    "MANIFEST",
    "MhcSemantics",
    "MhcKernelConfig",
    "MhcStageParams",
    "MhcHead",
    "MhcUpdate",
    "MhcCoefficients",
    "MHC_UPDATE",
    "sinkhorn",
    "mhc_coefficients",
    "mhc_read_ref",
    "mhc_update_ref",
    "mhc_update_read_ref",
]
__version__ = "0.1.0"

_LAZY = {
    "MhcSemantics": "semantics",
    "MhcKernelConfig": "config",
    "MhcStageParams": "params",
    "MhcHead": "params",
    "MhcUpdate": "update",
    "MhcCoefficients": "update",
    "MHC_UPDATE": "update",
    "sinkhorn": "coefficients",
    "mhc_coefficients": "coefficients",
    "mhc_read_ref": "reference",
    "mhc_update_ref": "reference",
    "mhc_update_read_ref": "reference",
}


__getattr__ = lazy_exports(__name__, {name: f".{module}" for name, module in _LAZY.items()}, globals())
