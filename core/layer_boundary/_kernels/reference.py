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

Under ``torch.compile`` each computation is the operator ``layer_boundary::<name>`` (``kernel_op``;
eager calls stay plain torch): Inductor would regenerate the reduction and the rsqrt in its own
order and fuse the casts, which moves results by an ulp, while the operator runs these same ATen
calls, so a compiled model using the reference gives the eager numbers bit for bit. Destinations
(``out=``, ``residual_out=``) are filled around the operator, in traced Python.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._quant import FP8_E4M3_MAX, FP8_SCALE_FLOOR, QuantizedRows
from .kernel_op import kernel_op

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


# -- the computations (each an operator under torch.compile; fresh outputs only) --------------------

def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    return _normalize(x.to(_acc_dtype(x.dtype)), weight, eps, weight_offset).to(x.dtype)


def _fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _acc_dtype(x.dtype, residual.dtype)
    s = x.to(acc) + residual.to(acc)
    return _normalize(s, weight, eps, weight_offset).to(x.dtype), s.to(residual.dtype)


def _rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_fp8(_normalize(x.to(_acc_dtype(x.dtype)), weight, eps, weight_offset))


def _fused_add_rmsnorm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           weight_offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _acc_dtype(x.dtype, residual.dtype)
    s = x.to(acc) + residual.to(acc)
    data, scale = _quantize_fp8(_normalize(s, weight, eps, weight_offset))
    return data, scale, s.to(residual.dtype)


def _quantize_fp8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (y.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).to(torch.float32).clamp(min=FP8_SCALE_FLOOR)
    # Divide by the FP32 scale that is returned (it differs from an FP64 one), and clamp before
    # the cast: torch turns an out-of-range value into NaN, and y / scale can land an ulp above
    # 448 for the row's largest element.
    data = (y / scale.to(y.dtype)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


for _name, _kernel in (("rmsnorm_ref", _rmsnorm), ("fused_add_rmsnorm_ref", _fused_add_rmsnorm),
                       ("rmsnorm_fp8_ref", _rmsnorm_fp8), ("fused_add_rmsnorm_fp8_ref", _fused_add_rmsnorm_fp8)):
    kernel_op(f"layer_boundary::{_name}", _kernel)


# -- public callables: destinations filled around the computation ---------------------------------

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
    y = _rmsnorm(x, weight, eps, weight_offset)
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
    y, r = _fused_add_rmsnorm(x, residual, weight, eps, weight_offset)
    if residual_out is not None:
        residual_out.copy_(r)
        r = residual_out
    if out is not None:
        out.copy_(y)
        y = out
    return y, r


def _quantized(data: torch.Tensor, scale: torch.Tensor, out: Optional[QuantizedRows]) -> QuantizedRows:
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
    return _quantized(*_rmsnorm_fp8(x, weight, eps, weight_offset), out)


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
    data, scale, r = _fused_add_rmsnorm_fp8(x, residual, weight, eps, weight_offset)
    q = _quantized(data, scale, out)
    if residual_out is not None:
        residual_out.copy_(r)
        r = residual_out
    return q, r
