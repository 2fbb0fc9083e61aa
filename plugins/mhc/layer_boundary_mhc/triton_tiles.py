"""Tile helpers shared by the MHC stream passes (``triton_mhc``, ``stream_joined``): loads, the
stream mix ``H_post y + H_res x`` and the rounding store."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["CAST_PLAIN", "CAST_EXACT", "CAST_PTX", "CAST_PTX_PURE"]

# How _store_cast rounds FP32 to the stored dtype (the CASTS constexpr, fixed at import in triton_mhc).
CAST_PLAIN, CAST_EXACT, CAST_PTX, CAST_PTX_PURE = 0, 1, 2, 3


@triton.jit
def _store_cast(ptr, v, mask, CASTS: tl.constexpr, POLICY: tl.constexpr):
    """Store ``v`` (FP32) rounded to nearest even to ``ptr``'s dtype; returns the rounded value, in that dtype."""
    if CASTS == 1:  # CAST_EXACT
        # Triton 3.6's interpreter converts FP32 to bf16 by truncation, a GPU to nearest even:
        # round the FP32 bit pattern to 16 significant bits first, then the conversion is exact
        # (finite values only, which is all a kernel here stores).
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            half = 0x7FFF + ((bits >> 16) & 1)
            v = ((bits + half) & -65536).to(tl.float32, bitcast=True)
        r = v.to(ptr.dtype.element_ty)
    elif CASTS == 3:  # CAST_PTX_PURE
        # Two values an instruction (cvt's b is element 0, the low half), pure: torch.compile's
        # mutation analysis reads pure inline assembly only. For tiles whose rounded value feeds
        # one layout (stream_joined), where nothing is recomputed.
        if ptr.dtype.element_ty == tl.bfloat16:
            r = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [v], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            r = v.to(ptr.dtype.element_ty)
    elif CASTS == 2:  # CAST_PTX
        # The instruction .to() emits, made opaque (not pure): the stream pass uses the rounded
        # mix in two register layouts (the store's and the projection MMA's), and Triton would
        # otherwise recompute the whole mix, loads and FMAs, in each. On sm_90 at n = 4, 64
        # tokens: 1387 -> 674 instructions a chunk and 245 -> 170 registers (with the
        # coefficients loaded once a stream pass).
        if ptr.dtype.element_ty == tl.bfloat16:
            r = tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [v], dtype=tl.bfloat16,
                                          is_pure=False, pack=1)
        elif ptr.dtype.element_ty == tl.float16:
            r = tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [v], dtype=tl.float16,
                                          is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=False, pack=1)
    else:
        r = v.to(ptr.dtype.element_ty)
    tl.store(ptr, r, mask=mask, eviction_policy=POLICY)
    return r


@triton.jit
def _load_rows(ptr, tt, c, m2, st, sc, POLICY: tl.constexpr):
    return tl.load(ptr + tt[:, None] * st + c[None, :] * sc, mask=m2, other=0.0,
                   eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _stream_coefficients(hp_ptr, hr_ptr, tt, tm, i: tl.constexpr, N: tl.constexpr):
    """``(H_post[:, i], (H_res[:, i, j] for j))`` of the rows ``tt``, [BT] each, from contiguous
    coefficients."""
    hr = ()
    for j in tl.static_range(N):
        # Triton source, checked as Python: mypy types `()` as an empty tuple, which Triton grows by `+`;
        # annotating it would not do, as Triton's code generator evaluates the annotation (no `tuple` there).
        hr = hr + (tl.load(hr_ptr + tt * (N * N) + i * N + j, mask=tm, other=0.0),)  # type: ignore[assignment]
    return tl.load(hp_ptr + tt * N + i, mask=tm, other=0.0), hr


@triton.jit
def _mixed_stream(y, xs, hp, hr, N: tl.constexpr):
    """A stream of ``H_post y + H_res x`` in FP32, [BT, BC], of the tiles ``y`` and ``xs`` and
    that stream's coefficients (``_stream_coefficients``)."""
    v = hp[:, None] * y
    for j in tl.static_range(N):
        v += hr[j][:, None] * xs[j]
    return v


@triton.jit
def _block_coefficients(hp_ptr, hr_ptr, tt, tm, N: tl.constexpr):
    """Each stream's ``_stream_coefficients`` of the block's rows ``tt``, loaded once a program:
    inside the column loop the pipeliner would copy all n + n^2 of them through shared memory for
    every chunk."""
    coefs = ()
    for i in tl.static_range(N):
        coefs = coefs + (_stream_coefficients(hp_ptr, hr_ptr, tt, tm, i, N),)  # type: ignore[assignment]  # see _stream_coefficients
    return coefs


@triton.jit
def _stream_inputs(y_ptr, x_ptr, tt, c, m2, syt, syc, sxt, sxn, sxc, N: tl.constexpr, POLICY: tl.constexpr):
    """A chunk's stage output tile and the n stream tiles, FP32 (``POLICY``: their L2 eviction hint)."""
    y = _load_rows(y_ptr, tt, c, m2, syt, syc, POLICY)
    xs = ()
    for j in tl.static_range(N):
        xs = xs + (_load_rows(x_ptr + j * sxn, tt, c, m2, sxt, sxc, POLICY),)  # type: ignore[assignment]  # see _stream_coefficients
    return y, xs


@triton.jit
def _block_start(x_ptr, y_ptr, xo_ptr, hp_ptr, hr_ptr, b, T, sxt, syt, sot,
                 N: tl.constexpr, BT: tl.constexpr, UPDATE: tl.constexpr):
    """A stream pass's block ``b``: ``(row0, tt, tm, x_ptr, y_ptr, xo_ptr, coefs)``, its first row,
    its rows and their mask, the pointers advanced to the block (block-local offsets then stay in
    int32; the int64 base is in the pointers) and, for an update, its ``_block_coefficients``."""
    row0 = b.to(tl.int64) * BT
    tt = tl.arange(0, BT)
    tm = row0 + tt < T
    coefs = ()
    if UPDATE:
        y_ptr += row0 * syt
        xo_ptr += row0 * sot
        coefs = _block_coefficients(hp_ptr + row0 * N, hr_ptr + row0 * (N * N), tt, tm, N)
    return row0, tt, tm, x_ptr + row0 * sxt, y_ptr, xo_ptr, coefs

