"""The stream pass for bf16 streams with the n streams joined into one MMA operand.

``triton_mhc._stream_pass`` projects each stream's ``[BT, BC]`` tile on its own (n dots a chunk
and part of phi, each with its own trip to the MMA's layout, barriers and wait; on sm_90 at
n = 4, BT = 64: 714 SASS instructions a chunk, 14 barriers, 8 waits on the tensor cores). Here
the n rounded tiles are interleaved into one ``[BT, NP BC]`` tile, column ``c NP + i`` holding
stream ``i``'s column ``c``, and projected by one dot a part on rows of phi laid out in that
order (``projection.bf16_parts``: ``[3, C NP, KP]``, phi cut into three bf16 parts, split once
per parameter version), so a chunk's B operands are contiguous tiles that the pipeliner copies
straight into shared memory: no split, no register trip for phi, one operand conversion a chunk.

The arithmetic: bf16 x bf16 products exact in the FP32 accumulator, the smallest part first
(``projection``); the sum of squares is kept per column and reduced once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import _block_start, _mixed_stream, _store_cast, _stream_inputs


@triton.jit
def _interleave(ts, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # NP [BT, BC] tiles -> [BT, BC * NP], column c * NP + i for tile i. A join adds a last axis of
    # 2, so the innermost joins pick the highest bit of i and the outermost the lowest.
    if NP == 2:
        j = tl.join(ts[0], ts[1])
    elif NP == 4:
        j = tl.join(tl.join(ts[0], ts[2]), tl.join(ts[1], ts[3]))
    else:
        j = tl.join(tl.join(tl.join(ts[0], ts[4]), tl.join(ts[2], ts[6])),
                    tl.join(tl.join(ts[1], ts[5]), tl.join(ts[3], ts[7])))
    return tl.reshape(j, [BT, BC * NP])


@triton.jit
def _dot_part(a, part, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        # Triton 3.6's interpreter multiplies bf16 tiles as their bit patterns: take the exact FP32
        # values (products of two bf16 values are exact in FP32 as well).
        return tl.dot(a.to(tl.float32), part.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, part, acc)


@triton.jit
def stream_pass_joined(
    x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, ph3_ptr, part_ptr, b, s, T,
    sxt, sxn, sxc, syt, syc, sot, son, soc,
    N: tl.constexpr, NP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
    S: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr,
    UPDATE: tl.constexpr, CASTS: tl.constexpr, LOADS: tl.constexpr, KEEP: tl.constexpr,
):
    """``triton_mhc._stream_pass`` for bf16 streams (same partials: ``x' @ phi`` and, in column K,
    ``sum x'^2`` over the slice, for block ``b`` and slice ``s``). ``LOADS`` and ``KEEP``: the L2
    eviction hints of the stream inputs (read once) and of x' (read again by the block's finishes)."""
    row0, tt, tm, x_ptr, y_ptr, xo_ptr, coefs = _block_start(x_ptr, y_ptr, xo_ptr, hp_ptr, hr_ptr, b, T,
                                                             sxt, syt, sot, N, BT, UPDATE)
    cc = tl.arange(0, BC)
    kk = tl.arange(0, KP)
    rows = tl.arange(0, BC * NP)
    acc = tl.zeros([BT, KP], dtype=tl.float32)
    ssq = tl.zeros([BT, BC], dtype=tl.float32)
    part_stride = C * NP * KP
    for ci in tl.range(0, CS // BC, num_stages=STAGES):
        c0 = s * CS + ci * BC
        c = c0 + cc
        cm = c < C
        m2 = tm[:, None] & cm[None, :]
        if UPDATE:
            y, xs = _stream_inputs(y_ptr, x_ptr, tt, c, m2, syt, syc, sxt, sxn, sxc, N, LOADS)
        ts = ()
        for i in tl.static_range(N):
            if UPDATE:
                v = _mixed_stream(y, xs, coefs[i][0], coefs[i][1], N)
                a = _store_cast(xo_ptr + i * son + tt[:, None] * sot + c[None, :] * soc, v, m2, CASTS, KEEP)
            else:
                a = tl.load(x_ptr + i * sxn + tt[:, None] * sxt + c[None, :] * sxc, mask=m2, other=0.0)
            f = a.to(tl.float32)
            ssq += f * f
            # Triton source, checked as Python: mypy types `()` as an empty tuple, which Triton grows by
            # `+` (an annotation would not do: Triton's code generator evaluates it, and has no `tuple`).
            ts = ts + (a,)  # type: ignore[assignment]
        for _ in tl.static_range(NP - N):
            ts = ts + (tl.zeros([BT, BC], dtype=tl.bfloat16),)  # type: ignore[assignment]  # (as above)
        a = _interleave(ts, NP, BT, BC)
        # Rows c0 NP .. (c0 + BC) NP of each part; rows past the last column are zeros.
        r = c0 * NP + rows
        rm = (r < C * NP)[:, None]
        src = ph3_ptr + r[:, None] * KP + kk[None, :]
        acc = _dot_part(a, tl.load(src + 2 * part_stride, mask=rm, other=0.0), acc, CASTS == 1)
        acc = _dot_part(a, tl.load(src + part_stride, mask=rm, other=0.0), acc, CASTS == 1)
        acc = _dot_part(a, tl.load(src, mask=rm, other=0.0), acc, CASTS == 1)
    acc = tl.where(kk[None, :] == K, tl.sum(ssq, axis=1)[:, None], acc)
    dst = part_ptr + (row0 + tt)[:, None] * (S * KP) + s * KP + kk[None, :]
    tl.store(dst, acc, mask=tm[:, None])
