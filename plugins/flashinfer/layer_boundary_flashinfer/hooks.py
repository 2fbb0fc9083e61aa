"""FlashInfer's hook implementations, imported only where the plugin can run (a CUDA device and the
``flashinfer-python`` distribution). Importing this module does not import FlashInfer: the
providers import it when construction first asks them for something.

Each hook is called once, when a plugin registry is built, and the registry holds what it
returns. The fusion provider holds the all-reduce workspaces of the models built through it, so
each registry gets its own (``BoundaryContext.discover()`` builds one registry per context);
contexts that share a registry share its workspaces, which is safe for models run one after the
other on a stream, as the stages of one model are.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from layer_boundary.plugin_api import hookimpl

from .fusion import FlashInferAllReduceNorm
from .norm import FlashInferNormProvider

__all__ = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers", "ENV_MAX_TOKENS", "max_tokens_from_env"]

ENV_MAX_TOKENS = "LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 2048


def max_tokens_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """The fused all-reduce's row limit: ``LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS`` or 2048."""
    value = (os.environ if env is None else env).get(ENV_MAX_TOKENS, "").strip()
    if not value:
        return DEFAULT_MAX_TOKENS
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(
            f"{ENV_MAX_TOKENS}={value!r} is not a positive integer; set it to the most rows one fused "
            f"all-reduce takes (default {DEFAULT_MAX_TOKENS}), or unset it"
        )
    return rows


@hookimpl
def layer_boundary_norm_kernels() -> list[Any]:
    """RMSNorm, Gemma RMSNorm and fused add + RMSNorm (bf16, fp16) on CUDA."""
    return [FlashInferNormProvider()]


@hookimpl
def layer_boundary_fusion_providers() -> list[Any]:
    """A fresh all-reduce + add + RMSNorm fusion provider for this registry."""
    return [FlashInferAllReduceNorm(max_tokens=max_tokens_from_env())]
