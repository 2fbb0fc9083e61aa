"""The finish of the MHC read (``triton_mhc``): the slices' partial sums -> coefficients, Sinkhorn
and the normalized combination of a block's tokens, ``TB`` at a time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tiles import _store_cast

_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # the reference's floor on exp(logits)


@triton.jit
def _sinkhorn(logits, valid, im, ITERS: tl.constexpr):
    """``[TB, NP, NP]`` logits -> doubly-stochastic matrices (padding rows and columns stay 0):
    exp after subtracting the maximum, floored at the smallest normal float, then ``ITERS`` times
    columns then rows, as ``coefficients.sinkhorn``."""
    lg = tl.where(valid[None, :, :], logits, float("-inf"))
    top = tl.max(tl.max(lg, axis=2), axis=1)
    m = tl.exp(lg - top[:, None, None])
    m = tl.where(valid[None, :, :], tl.maximum(m, _TINY), 0.0)
    for _ in range(ITERS):
        col = tl.where(im[None, :], tl.sum(m, axis=1), 1.0)
        m = m / col[:, None, :]
        row = tl.where(im[None, :], tl.sum(m, axis=2), 1.0)
        m = m / row[:, :, None]
    return m


@triton.jit
def sinkhorn_kernel(h_ptr, T, N: tl.constexpr, NP: tl.constexpr, TB: tl.constexpr, ITERS: tl.constexpr):
    """In place on ``[T, N, N]`` FP32: H_res's logits -> ``_sinkhorn`` of them, TB tokens a program
    (the cluster kernel's H_res, bit for bit what the finishes compute from the same logits)."""
    row0 = tl.program_id(0).to(tl.int64) * TB
    tt = row0 + tl.arange(0, TB)
    i = tl.arange(0, NP)
    im = i < N
    valid = im[:, None] & im[None, :]
    ptr = h_ptr + tt[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (tt < T)[:, None, None] & valid[None, :, :]
    lg = tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, _sinkhorn(lg, valid, im, ITERS), mask=mask)


@triton.jit
def _mix(src, rows, st, cols, m2, sn, sc, hp, i, N: tl.constexpr, POLICY: tl.constexpr):
    # The mixed input sum_j H_pre[:, j] x_j of FR tokens' rows over one chunk of columns, [FR, CP]
    # in FP32 (the norm's two passes each recompute it rather than hold a whole row).
    ptr = src + rows[:, None] * st + cols[None, :] * sc
    acc = tl.zeros(m2.shape, dtype=tl.float32)
    for j in tl.static_range(N):
        if POLICY == "":
            xj = tl.load(ptr + j * sn, mask=m2, other=0.0, cache_modifier=".cg")
        else:
            # PTX takes no L2 eviction hint with .cg; the finish's acquire (gpu scope) already
            # orders these loads after the block's stream passes.
            xj = tl.load(ptr + j * sn, mask=m2, other=0.0, eviction_policy=POLICY)
        acc += _pick(hp, i[None, :], j)[:, None] * xj.to(tl.float32)
    return acc


@triton.jit
def _pick(v, kk, col):
    # v[..., col] along the last axis, exactly (a sum of one value and zeros).
    return tl.sum(tl.where(kk == col, v, 0.0), axis=-1)


@triton.jit
def _finish(
    x_ptr, xo_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, w_ptr,
    out_ptr, hpo_ptr, hro_ptr, part_ptr, b, q, T,
    sxt, sxn, sxc, sot, son, soc, sw, sit, sic, eps, norm_eps, offset,
    N: tl.constexpr, NP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
    CP: tl.constexpr, S: tl.constexpr, SB: tl.constexpr, BT: tl.constexpr, TB: tl.constexpr,
    ITERS: tl.constexpr, UPDATE: tl.constexpr, CHUNKED: tl.constexpr, CASTS: tl.constexpr, FR: tl.constexpr,
    LOADS: tl.constexpr, SKIP_TAIL: tl.constexpr,
):
    row0 = b.to(tl.int64) * BT + q * TB
    tt = tl.arange(0, TB)
    tm = row0 + tt < T
    kk = tl.arange(0, KP)
    # Sum the slices' partials, SB slices a load, in a fixed order (replays are bitwise). .cg: the
    # workspace and x' were written by other programs of this launch; read them from L2.
    sb = tl.arange(0, SB)
    tot = tl.zeros([TB, KP], dtype=tl.float32)
    for s0 in tl.range(0, S, SB):
        sl = s0 + sb
        src = part_ptr + (row0 + tt)[:, None, None] * (S * KP) + sl[None, :, None] * KP + kk[None, None, :]
        tot += tl.sum(tl.load(src, mask=tm[:, None, None] & (sl < S)[None, :, None], other=0.0,
                              cache_modifier=".cg"), axis=1)
    rstd = tl.rsqrt(_pick(tot, kk[None, :], K) / (N * C) + eps)
    v = tot * rstd[:, None]
    i = tl.arange(0, NP)
    im = i < N
    k3 = kk[None, None, :]
    v3 = v[:, None, :]
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    b_pre = tl.load(bpre_ptr + i, mask=im, other=0.0)
    b_post = tl.load(bpost_ptr + i, mask=im, other=0.0)
    h_pre = tl.sigmoid(a_pre * _pick(v3, k3, i[None, :, None]) + b_pre[None, :])  # [TB, NP]
    h_post = 2.0 * tl.sigmoid(a_post * _pick(v3, k3, N + i[None, :, None]) + b_post[None, :])
    valid = im[:, None] & im[None, :]
    col = 2 * N + i[:, None] * N + i[None, :]  # [NP, NP]: the row-major res block
    b_res = tl.load(bres_ptr + i[:, None] * N + i[None, :], mask=valid, other=0.0)
    res = _pick(v[:, None, None, :], kk[None, None, None, :], col[None, :, :, None])  # [TB, NP, NP]
    h_res = _sinkhorn(a_res * res + b_res[None, :, :], valid, im, ITERS)
    t64 = row0 + tt
    tl.store(hpo_ptr + t64[:, None] * N + i[None, :], h_post, mask=tm[:, None] & im[None, :])
    tl.store(hro_ptr + t64[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :], h_res,
             mask=tm[:, None, None] & valid[None, :, :])

    # input = RMSNorm(sum_j H_pre[j] x_j), token by token over the whole row.
    if UPDATE:
        src = xo_ptr
        st = sot
        sn = son
        sc = soc
    else:
        src = x_ptr
        st = sxt
        sn = sxn
        sc = sxc
    c = tl.arange(0, CP)
    fr = tl.arange(0, FR)
    if CHUNKED:
        w = tl.zeros([CP], dtype=tl.float32)  # unused: the chunked rows load their weights by chunk
    else:
        w = tl.load(w_ptr + c * sw, mask=c < C, other=0.0).to(tl.float32) + offset
    # FR tokens a step: their rows' loads are in flight together (one token a step waits for
    # each row's L2 round trip and block-wide reduction in turn).
    if SKIP_TAIL:
        # A decode step's last block: no steps past its last token, which would otherwise wait for
        # up to TB - 1 masked rows' reductions (H200, T = 1: 16.8 -> 15.5 µs in one launch). Larger
        # blocks compile without this branch: with it, their finishes took more registers and ran
        # 10 % slower at T = 1024.
        if row0 + TB > T:
            p0 = 0
            while row0 + p0 < T:
                _normalize_rows(p0, row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr,
                                sit, sic, norm_eps, N, C, CP, FR, CHUNKED, CASTS, LOADS)
                p0 += FR
        else:
            _normalize_block(row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr, sit, sic,
                             norm_eps, N, C, CP, TB, FR, CHUNKED, CASTS, LOADS)
    else:
        _normalize_block(row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr, sit, sic,
                         norm_eps, N, C, CP, TB, FR, CHUNKED, CASTS, LOADS)


@triton.jit
def _normalize_block(row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr, sit, sic,
                     norm_eps, N: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, TB: tl.constexpr,
                     FR: tl.constexpr, CHUNKED: tl.constexpr, CASTS: tl.constexpr, LOADS: tl.constexpr):
    # The TB tokens FR at a time, unrolled: a step's loads are issued before the last step's
    # reductions end.
    for p0 in tl.static_range(0, TB, FR):
        _normalize_rows(p0, row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr, sit, sic,
                        norm_eps, N, C, CP, FR, CHUNKED, CASTS, LOADS)


@triton.jit
def _normalize_rows(p0, row0, T, tt, fr, h_pre, i, src, st, sn, sc, c, w, w_ptr, sw, offset, out_ptr, sit, sic,
                    norm_eps, N: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, FR: tl.constexpr,
                    CHUNKED: tl.constexpr, CASTS: tl.constexpr, LOADS: tl.constexpr):
    """input = RMSNorm(sum_j H_pre[j] x_j) of the block's tokens p0 .. p0 + FR - 1."""
    rows = row0 + p0 + fr
    live = rows < T
    sel = tt[:, None] == (p0 + fr)[None, :]  # [TB, FR]
    hp = tl.sum(tl.where(sel[:, :, None], h_pre[:, None, :], 0.0), axis=0)  # [FR, NP]
    dst = out_ptr + rows[:, None] * sit
    if not CHUNKED:
        m2 = live[:, None] & (c < C)[None, :]
        acc = _mix(src, rows, st, c, m2, sn, sc, hp, i, N, LOADS)
        r2 = tl.rsqrt(tl.sum(acc * acc, axis=1) / C + norm_eps)
        _store_cast(dst + c[None, :] * sic, acc * r2[:, None] * w[None, :], m2, CASTS, "")
    else:
        sq = tl.zeros([FR, CP], dtype=tl.float32)
        for c0 in tl.range(0, C, CP):
            m2 = live[:, None] & (c0 + c < C)[None, :]
            acc = _mix(src, rows, st, c0 + c, m2, sn, sc, hp, i, N, LOADS)
            sq += acc * acc
        r2 = tl.rsqrt(tl.sum(sq, axis=1) / C + norm_eps)
        for c0 in tl.range(0, C, CP):
            m2 = live[:, None] & (c0 + c < C)[None, :]
            acc = _mix(src, rows, st, c0 + c, m2, sn, sc, hp, i, N, LOADS)
            wc = tl.load(w_ptr + (c0 + c) * sw, mask=c0 + c < C, other=0.0).to(tl.float32) + offset
            _store_cast(dst + (c0 + c)[None, :] * sic, acc * r2[:, None] * wc[None, :], m2, CASTS, "")
