"""AITER's hook implementations, imported only where the probe found ROCm, a GPU and amd-aiter.

Each hook returns fresh providers (a fusion provider holds the workspaces of the model it is
built into). An installed ``aiter`` that lacks the functions this plugin binds offers nothing,
with a warning naming them: the plugin targets the API of amd-aiter 0.1.7.post2.dev18.
"""

from __future__ import annotations

import logging
from typing import Any

from layer_boundary.plugin_api import hookimpl

from .api import TARGET_VERSION, AiterApi
from .fusion import AiterAllReduceNorm
from .norm import AiterNormKernels

__all__ = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers"]

log = logging.getLogger("layer_boundary.rocm_aiter")


def _api() -> Any:
    api = AiterApi.load()
    why = api.missing_norm()
    if why:
        log.warning("rocm_aiter offers nothing: %s", why)
        return None
    if api.version != TARGET_VERSION:
        log.info("rocm_aiter targets amd-aiter %s; %s is installed (each kernel is checked against "
                 "the torch reference when a model is built)", TARGET_VERSION, api.label)
    return api


@hookimpl
def layer_boundary_norm_kernels() -> list[Any]:
    api = _api()
    return [AiterNormKernels(api)] if api is not None else []


@hookimpl
def layer_boundary_fusion_providers() -> list[Any]:
    api = _api()
    return [AiterAllReduceNorm(api)] if api is not None else []
