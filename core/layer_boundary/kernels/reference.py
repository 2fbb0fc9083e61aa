"""Pure torch references for the norm reads. Every faster kernel is compared against these.

RMSNorm:            y = x / sqrt(mean(x^2) + eps) * (w + offset)    offset 0, Gemma offset 1
Fused add+RMSNorm:  s = x + r (FP32);  r' = s.to(dtype);  y = RMSNorm(s)

Shapes: x, r: [T, H]; w: [H]. The sum is normalized in FP32 *before* it is rounded to the
residual dtype, so the normalized output does not see the rounding of the stored residual.
The weight is applied in FP32 and the product rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rmsnorm_ref", "fused_add_rmsnorm_ref"]


def _normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    var = s.pow(2).mean(dim=-1, keepdim=True)
    w = weight.float()
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
    """``out = x / sqrt(mean(x^2) + eps) * (weight + weight_offset)``, computed in FP32."""
    y = _normalize(x.float(), weight, eps, weight_offset).to(x.dtype)
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
    s = x.float() + residual.float()
    y = _normalize(s, weight, eps, weight_offset).to(x.dtype)
    r = s.to(residual.dtype)
    if residual_out is not None:
        residual_out.copy_(r)
        r = residual_out
    if out is not None:
        out.copy_(y)
        y = out
    return y, r
