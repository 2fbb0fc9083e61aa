"""Pure torch references for the norm reads. Every faster kernel is compared against these.

RMSNorm:            y = x / sqrt(mean(x^2) + eps) * (w + offset)    offset 0, Gemma offset 1
Fused add+RMSNorm:  s = x + r (FP32);  r' = s.to(dtype);  y = RMSNorm(s)

Shapes: x, r: [T, H]; w: [H]. The sum is normalized in FP32 *before* it is rounded to the
residual dtype, so the normalized output does not see the rounding of the stored residual.
The weight is applied in FP32 and the product rounded once. FP64 inputs are computed in FP64.

FP8 outputs (``*_fp8_ref``, the ``quant="fp8_e4m3"`` read) quantize the FP32 normalized row ``y``
itself, never ``y`` rounded to the activation dtype first, per token:

    scale = max(amax(|y|) / 448, 1e-12)                    [T, 1] float32
    data  = float8_e4m3fn(clamp(y / scale, -448, 448))     [T, H], round to nearest even

and return ``QuantizedRows(data, scale)``. The fused form stores ``r' = s`` in the residual dtype
exactly as the unquantized one does. FP64 inputs quantize their FP64 normalized row (divided by
the FP32 scale that is returned). See ``layer_boundary._quant`` for ``QuantizedRows``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._quant import FP8_E4M3_MAX, FP8_SCALE_FLOOR, QuantizedRows

__all__ = ["check_rows", "rmsnorm_ref", "fused_add_rmsnorm_ref", "rmsnorm_fp8_ref", "fused_add_rmsnorm_fp8_ref"]


def check_rows(x: torch.Tensor, residual: torch.Tensor) -> None:
    """Every fused add + norm kernel's first check: the contribution has the residual's shape."""
    if x.shape != residual.shape:
        raise ValueError(f"contribution shape {tuple(x.shape)} does not match residual {tuple(residual.shape)}")


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
    check_rows(x, residual)
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


def _quantize_fp8(y: torch.Tensor, out: Optional[QuantizedRows]) -> QuantizedRows:
    scale = (y.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).to(torch.float32).clamp(min=FP8_SCALE_FLOOR)
    # Divide by the FP32 scale that is returned (it differs from an FP64 one), and clamp before
    # the cast: torch turns an out-of-range value into NaN, and y / scale can land an ulp above
    # 448 for the row's largest element.
    data = (y / scale.to(y.dtype)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    if out is None:
        return QuantizedRows(data, scale)
    out.data.copy_(data)
    out.scale.copy_(scale)
    return out


def rmsnorm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    out: Optional[QuantizedRows] = None,
) -> QuantizedRows:
    """``rmsnorm_ref`` with a per-token FP8 e4m3 output (module docstring); ``out`` is an optional
    ``QuantizedRows`` of destinations."""
    y = _normalize(x.to(_acc_dtype(x.dtype)), weight, eps, weight_offset)
    return _quantize_fp8(y, out)


def fused_add_rmsnorm_fp8_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    out: Optional[QuantizedRows] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[QuantizedRows, torch.Tensor]:
    """``fused_add_rmsnorm_ref`` whose normalized output is per-token FP8 e4m3; the residual keeps
    its dtype."""
    check_rows(x, residual)
    acc = _acc_dtype(x.dtype, residual.dtype)
    s = x.to(acc) + residual.to(acc)
    q = _quantize_fp8(_normalize(s, weight, eps, weight_offset), out)
    r = s.to(residual.dtype)
    if residual_out is not None:
        residual_out.copy_(r)
        r = residual_out
    return q, r
