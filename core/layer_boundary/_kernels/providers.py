"""The core's own norm-kernel providers, in selection order: Triton on CUDA, then the torch reference.

Plugins come before both (``BoundaryContext.norm_candidates``). Every provider answers
``refuse(request)`` from the request alone, at construction; nothing here runs per forward.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from .._providers import NormRequest
from .._quant import QUANT_FORMATS
from ..residual._add_norm import NormKernels, reference_kernels
from .._selection import not_on_this_device

__all__ = [
    "ReferenceNormProvider",
    "REFERENCE_PROVIDER",
    "TritonNormProvider",
    "TRITON_PROVIDER",
    "core_norm_providers",
]


def _unknown_quant(request: NormRequest) -> Optional[str]:
    if request.quant is not None and request.quant not in QUANT_FORMATS:
        return f"unknown quantized output {request.quant!r} (known: {', '.join(QUANT_FORMATS)})"
    return None


class ReferenceNormProvider:
    """The pure torch reference: serves every request on any device, unquantized or FP8; exact
    by definition."""

    name = "torch-reference"
    tolerance = {torch.float32: (0.0, 0.0), torch.bfloat16: (0.0, 0.0), torch.float16: (0.0, 0.0),
                 torch.float64: (0.0, 0.0)}

    def refuse(self, request: NormRequest) -> Optional[str]:
        return _unknown_quant(request)

    def kernels(self, request: NormRequest) -> NormKernels:
        return reference_kernels(request.quant)


REFERENCE_PROVIDER = ReferenceNormProvider()


@functools.lru_cache(maxsize=None)
def _triton_missing() -> Optional[str]:
    """Why the Triton kernels cannot load here (``None``: they can); tried once per process."""
    try:
        from . import triton_ops  # noqa: F401  (imports triton, registers the operators)
    except Exception as e:  # ImportError, or a triton/torch pair that does not fit
        return f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
    return None


@functools.lru_cache(maxsize=None)
def _fp8_unsupported() -> Optional[str]:
    if torch.version.hip is not None:
        return "FP8 e4m3fn output is offered on NVIDIA GPUs only (ROCm's MI300 uses e4m3fnuz)"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return f"FP8 e4m3 output needs compute capability 8.9 or newer; this GPU is {major}.{minor}"
    return None


class TritonNormProvider:
    """The core Triton kernels (``kernels.triton_ops``): plain and Gemma RMSNorm, fused add +
    RMSNorm with the residual updated in place, and their per-token FP8 outputs. CUDA only."""

    name = "core-triton"
    # FP32 accumulation in another order than torch's, and an approximate rsqrt: a few FP32 ulps
    # before the output is rounded, so one ulp of a 16-bit output (the defaults' reasoning).
    tolerance = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2),
                 torch.float16: (2e-3, 2e-3)}

    def refuse(self, request: NormRequest) -> Optional[str]:
        if request.device_type != "cuda":
            return not_on_this_device(f"runs on CUDA devices only, not {request.device_type}")
        if request.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return (f"{str(request.dtype).replace('torch.', '')} is not supported (bf16, fp16, fp32): "
                    "FP32 accumulation would round FP64 input")
        why = _unknown_quant(request) or _triton_missing()
        if why is None and request.quant is not None:
            why = _fp8_unsupported()
        return why

    def kernels(self, request: NormRequest) -> NormKernels:
        from .triton_ops import TRITON_FP8_KERNELS, TRITON_KERNELS

        return TRITON_KERNELS if request.quant is None else TRITON_FP8_KERNELS


TRITON_PROVIDER = TritonNormProvider()


def core_norm_providers() -> list[Union[TritonNormProvider, ReferenceNormProvider]]:
    return [TRITON_PROVIDER, REFERENCE_PROVIDER]
