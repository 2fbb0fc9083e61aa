"""Pure torch references for the norm reads. Every faster kernel is compared against these.

RMSNorm:            y = x / sqrt(mean(x^2) + eps) * (w + offset)    offset 0, Gemma offset 1
Fused add+RMSNorm:  s = x + r (FP32);  r' = s.to(dtype);  y = RMSNorm(s)

Shapes: x, r: [T, H]; w: [H]. The sum is normalized in FP32 *before* it is rounded to the
residual dtype, so the normalized output does not see the rounding of the stored residual.
The weight is applied in FP32 and the product rounded once. FP64 inputs are computed in FP64.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rmsnorm_ref", "fused_add_rmsnorm_ref"]


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """FP32 for 16-bit and FP32 inputs; FP64 inputs keep FP64 (never round them to FP32)."""
    acc = torch.float32
    for d in dtypes:
        acc = torch.promote_types(acc, d)
    return acc


def _normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    var = s.pow(2).mean(dim=-1, keepdim=True)
    w = weight.to(s.dtype)
    if weight_offset:
        w = w + weight_offset
    return s * torch.rsqrt(var + eps) * w


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out = x / sqrt(mean(x^2) + eps) * (weight + weight_offset)``, computed in FP32
    (FP64 for FP64 input)."""
    y = _normalize(x.to(_acc_dtype(x.dtype)), weight, eps, weight_offset).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rmsnorm(x + residual), x + residual)`` with the sum kept in FP32 between the two.

    ``out`` and ``residual_out`` are optional destinations (``residual_out=residual`` updates the
    residual in place, as fused kernels do).
    """
    if x.shape != residual.shape:
        raise ValueError(f"contribution shape {tuple(x.shape)} does not match residual {tuple(residual.shape)}")
    acc = _acc_dtype(x.dtype, residual.dtype)
    s = x.to(acc) + residual.to(acc)
    y = _normalize(s, weight, eps, weight_offset).to(x.dtype)
    r = s.to(residual.dtype)
    if residual_out is not None:
        residual_out.copy_(r)
        r = residual_out
    if out is not None:
        out.copy_(y)
        y = out
    return y, r
