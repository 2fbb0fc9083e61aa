"""layer-boundary-cutedsl: CuTe DSL kernels for layer-boundary on NVIDIA GPUs.

Importing this package is light (neither torch nor the CuTe DSL): discovery loads only
``layer_boundary_cutedsl._manifest``, and ``layer_boundary_cutedsl.hooks`` once the plugin can run
here. The public names below load on first use (PEP 562).
"""

from __future__ import annotations

from layer_boundary.plugin_api import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "CuteDslFusion": "fusion",
    "install_cutedsl_fusion": "fusion",
    "prepare_cutedsl_fusion": "fusion",
    "CuTeDSLNormProvider": "norm",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_exports(__name__, {name: f".{module}" for name, module in _LAZY.items()}, globals())
