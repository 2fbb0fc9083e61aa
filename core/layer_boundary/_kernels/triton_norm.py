"""Triton kernels of the norm reads: one program per token row, FP32 accumulation.

For row ``t`` (``ADD``: with a residual; ``FP8``: per-token FP8 output, see ``layer_boundary._quant``)::

    s      = x[t] + r[t]                      FP32 (s = x[t] without ADD)
    r'[t]  = s rounded to the residual dtype  (ADD only; may be r itself: in place)
    y      = s * rsqrt(sum(s^2) / H + eps) * (w + offset)
    out[t] = y rounded to the output dtype,   or FP8 codes of y / scale and scale[t]

the operation order of ``kernels.reference``. A row up to ``MAX_TILE`` elements wide is held in
registers whole, so every element is read once and written once. A wider row is walked in chunks:
one pass for the sum of squares, one for the FP8 amax, and a last pass that reads x and r again
and only then writes r', so an in-place residual is never read after it was overwritten.

Rows are addressed by (row, column) strides: a column slice of a wider tensor needs no copy, and a
column stride of 1 is specialized by Triton into contiguous, vectorized accesses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .._quant import FP8_E4M3_MAX, FP8_SCALE_FLOOR

__all__ = ["norm_rows_kernel", "launch", "launch_config", "INTERPRETED", "MAX_TILE", "CHUNK"]

# Widest row kept in registers: 16K FP32 values over 16 warps is 32 a thread, within the 128
# registers a thread of a 512-thread program may have. Wider rows go in CHUNK-wide pieces.
MAX_TILE = 16384
CHUNK = 4096

# A kernel reads only constexpr globals (the interpreter does not check this; the compiler does).
# Under torch.compile, Inductor re-emits the kernel with these as float64 constants: the scale
# arithmetic is cast back to FP32 explicitly (f64 -> e4m3 has no conversion on the GPU).
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_FP8_SCALE_FLOOR = tl.constexpr(FP8_SCALE_FLOOR)


@triton.jit
def _round_bf16(v):
    # Round-to-nearest-even to bf16 precision on the FP32 bit pattern, so that a truncating
    # conversion afterwards is exact (finite values; this is only used under the interpreter).
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    # Round-to-nearest-even to e4m3 precision in FP32, for |v| <= 448: 3 mantissa bits for normal
    # values (a carry moves into the exponent, as it should), steps of 2^-9 below 2^-6, where
    # adding and removing 1.5 * 2^14 (whose ulp is 2^-9) rounds.
    b = v.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _cast(v, dst_ptr, EXACT_CASTS: tl.constexpr):
    # Triton 3.6's interpreter truncates FP32 -> bf16 (a GPU rounds to nearest even); rounding in
    # FP32 first makes the interpreter's conversion exact. Compiled kernels convert natively.
    if EXACT_CASTS:
        if dst_ptr.dtype.element_ty == tl.bfloat16:
            v = _round_bf16(v)
    return v.to(dst_ptr.dtype.element_ty)


@triton.jit
def _fp8_codes(y, inv_scale, dst_ptr, EXACT_CASTS: tl.constexpr):
    # y * (1 / scale) instead of y / scale: one multiply per element; the two differ by at most
    # an FP32 ulp, which moves an FP8 code only at an exact rounding tie. The clamp is the
    # saturation the GPU's conversion also applies; the interpreter's FP8 conversion mis-rounds
    # (no carry into the exponent), hence the explicit rounding there.
    q = tl.clamp((y * inv_scale).to(tl.float32), -_FP8_MAX, _FP8_MAX).to(tl.float32)
    if EXACT_CASTS:
        q = _round_e4m3(q)
    return q.to(dst_ptr.dtype.element_ty)


@triton.jit
def _row_sum(x_ptr, r_ptr, cols, x_col, r_col, mask, ADD: tl.constexpr):
    s = tl.load(x_ptr + cols * x_col, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        s += tl.load(r_ptr + cols * r_col, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def norm_rows_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, scale_ptr,
    x_row, x_col, r_row, r_col, y_row, y_col, ro_row, ro_col, w_col, scale_row,
    eps, offset,
    H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, FP8: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
):
    # int64 row offsets: T * H passes 2^31 elements at long prefills.
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * x_row
    y_ptr += row * y_row
    if ADD:
        r_ptr += row * r_row
        ro_ptr += row * ro_row
    cols = tl.arange(0, BLOCK)
    if BLOCK >= H:
        mask = cols < H
        s = _row_sum(x_ptr, r_ptr, cols, x_col, r_col, mask, ADD)
        if ADD:
            tl.store(ro_ptr + cols * ro_col, _cast(s, ro_ptr, EXACT_CASTS), mask=mask)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        w = tl.load(w_ptr + cols * w_col, mask=mask, other=0.0).to(tl.float32) + offset
        y = s * rstd * w
        if FP8:
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / _FP8_MAX, _FP8_SCALE_FLOOR).to(tl.float32)
            tl.store(scale_ptr + row * scale_row, scale)
            tl.store(y_ptr + cols * y_col, _fp8_codes(y, 1.0 / scale, y_ptr, EXACT_CASTS), mask=mask)
        else:
            tl.store(y_ptr + cols * y_col, _cast(y, y_ptr, EXACT_CASTS), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in tl.range(0, H, BLOCK):
            c = start + cols
            s = _row_sum(x_ptr, r_ptr, c, x_col, r_col, c < H, ADD)
            acc += s * s
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        if FP8:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in tl.range(0, H, BLOCK):
                c = start + cols
                m = c < H
                s = _row_sum(x_ptr, r_ptr, c, x_col, r_col, m, ADD)
                w = tl.load(w_ptr + c * w_col, mask=m, other=0.0).to(tl.float32) + offset
                amax = tl.maximum(amax, tl.abs(s * rstd * w))
            scale = tl.maximum(tl.max(amax, axis=0) / _FP8_MAX, _FP8_SCALE_FLOOR).to(tl.float32)
            tl.store(scale_ptr + row * scale_row, scale)
            inv_scale = 1.0 / scale
        for start in tl.range(0, H, BLOCK):
            c = start + cols
            m = c < H
            s = _row_sum(x_ptr, r_ptr, c, x_col, r_col, m, ADD)
            if ADD:
                tl.store(ro_ptr + c * ro_col, _cast(s, ro_ptr, EXACT_CASTS), mask=m)
            w = tl.load(w_ptr + c * w_col, mask=m, other=0.0).to(tl.float32) + offset
            y = s * rstd * w
            if FP8:
                tl.store(y_ptr + c * y_col, _fp8_codes(y, inv_scale, y_ptr, EXACT_CASTS), mask=m)
            else:
                tl.store(y_ptr + c * y_col, _cast(y, y_ptr, EXACT_CASTS), mask=m)


# Decided when this module is imported: Triton 3.6 picks the interpreter in @triton.jit.
INTERPRETED = not isinstance(norm_rows_kernel, JITFunction)

_CONFIGS: dict[tuple[int, int], tuple[int, int]] = {}


def launch_config(hidden: int, itemsize: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``hidden`` elements of ``itemsize`` bytes, cached.

    BLOCK is the row rounded up to a power of two (or CHUNK past MAX_TILE); the warps give each
    thread about 16 bytes of the row per access, one vectorized load, up to 16 warps.
    """
    key = (hidden, itemsize)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        block = triton.next_power_of_2(hidden)
        if block > MAX_TILE:
            block = CHUNK
        warps = min(max(block * itemsize // 512, 1), 16)
        cfg = _CONFIGS[key] = (block, warps)
    return cfg


def launch(
    kernel: Any,  # a triton JIT function (untyped), or it wrapped by wrap_triton
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    eps: float,
    offset: float,
) -> None:
    """Run ``kernel`` (``norm_rows_kernel``, or it wrapped by ``torch.library.wrap_triton``) over
    the rows of the 2-D ``x``. ``residual_out=None`` with a residual updates it in place;
    ``scale`` given means ``out`` holds FP8 codes. Nothing is allocated, nothing synchronizes."""
    rows, hidden = x.shape
    if rows == 0:
        return  # an empty grid is not a valid launch
    hidden = int(hidden)  # a constexpr: under torch.compile this pins the width (weights fix it anyway)
    block, warps = launch_config(hidden, x.element_size())
    add = residual is not None
    res_strides = res_out_strides = (0, 0)
    if residual is not None:
        if residual_out is None:
            residual_out = residual
        res_strides = (residual.stride(0), residual.stride(1))
        res_out_strides = (residual_out.stride(0), residual_out.stride(1))
    kernel[(rows,)](
        x, residual, weight, out, residual_out, scale,
        x.stride(0), x.stride(1),
        *res_strides,
        out.stride(0), out.stride(1),
        *res_out_strides,
        weight.stride(0), scale.stride(0) if scale is not None else 0,
        eps, offset,
        H=hidden, BLOCK=block, ADD=add, FP8=scale is not None, EXACT_CASTS=INTERPRETED,
        num_warps=warps,
    )
