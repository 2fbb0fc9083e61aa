"""Refusal reasons that every 16-bit CUDA norm-kernel provider gives alike (vendor plugins).

Each returns ``None`` when the request passes, else the reason the selection report shows; a
provider then adds its own limits (hidden sizes, library loading).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._providers import NormRequest
from .._quant import QUANT_FORMATS
from .._selection import not_on_this_device

__all__ = ["cuda_half_norm_refusal"]

HALF_DTYPES = (torch.bfloat16, torch.float16)


def cuda_half_norm_refusal(request: NormRequest, *, takes: str, offers: str, fp8_refusal: str,
                           nvidia_only: bool = True) -> Optional[str]:
    """Device (CUDA; NVIDIA only unless ``nvidia_only=False``), quantized output, bf16/fp16 and
    RMSNorm or Gemma RMSNorm. ``takes``: who takes bf16 and fp16 only ("FlashInfer's norm kernels
    take"); ``offers``: what is offered ("FlashInfer has RMSNorm (offset 0) and ...")."""
    if request.device_type != "cuda":
        return not_on_this_device(f"runs on CUDA devices only, not {request.device_type}")
    if nvidia_only and torch.version.hip is not None:
        return not_on_this_device(f"runs on NVIDIA GPUs only, not a ROCm build of torch (torch {torch.__version__})")
    if request.quant is not None:
        if request.quant == "fp8_e4m3":
            return fp8_refusal
        return f"unknown quantized output {request.quant!r} (known: {', '.join(QUANT_FORMATS)})"
    if request.dtype not in HALF_DTYPES:
        return f"{str(request.dtype).replace('torch.', '')} is not supported: {takes} bf16 and fp16 only"
    if request.weight_offset not in (0.0, 1.0):
        return f"weight offset {request.weight_offset} is not offered: {offers}"
    return None
