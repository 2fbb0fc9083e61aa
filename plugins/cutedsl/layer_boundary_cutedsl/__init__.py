"""layer-boundary-cutedsl: CuTe DSL kernels for layer-boundary on NVIDIA GPUs.

Importing this package is light (neither torch nor the CuTe DSL): discovery loads only
``layer_boundary_cutedsl._manifest``, and ``layer_boundary_cutedsl.hooks`` once the plugin can run
here. The public names below load on first use (PEP 562).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CuteDslFusion": "fusion",
    "install_cutedsl_fusion": "fusion",
    "prepare_cutedsl_fusion": "fusion",
    "CuTeDSLNormProvider": "norm",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'layer_boundary_cutedsl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"layer_boundary_cutedsl.{module}"), name)
    globals()[name] = value
    return value
