"""The steps both MHC CuTe DSL kernels share (``cute_cluster``, ``cute_persistent``; imports
``cutlass``): thread and shared-memory start, a token's coefficients from its summed partials (and
the Sinkhorn), the exchanges' sends, the combination's arithmetic and its sums of squares, and
the placeholder compile."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import cute_ptx as P


class ClusterSteps:
    """Base of both kernels: ``self.s`` is the compile-time shape (``cluster_shape``)."""

    def __init__(self, shape) -> None:
        assert not shape.problem, shape.problem
        self.s = shape

    @cute.jit
    def _start(self):
        """(thread, CTA rank in the cluster, warp, lane, lane // 4, lane % 4, shared-memory base)."""
        tid, _, _ = cute.arch.thread_idx()
        rank = Int32(cute.arch.block_idx_in_cluster())
        lane = tid % 32
        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((self.s.smem - 1024,)), byte_alignment=1024)
        return tid, rank, tid // 32, lane, lane // 4, lane % 4, Int32(raw.iterator.toint())

    @cute.jit
    def _coef_consts(self, lane: Int32, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer,
                     bres: cute.Pointer) -> tuple:
        """What ``_coefficients`` reads of the parameters at lane ``lane`` (the three alphas, then the
        lane's bias of H_pre, H_post or H_res): loaded once by a kernel that computes many blocks."""
        n = self.s.n
        al = Int64(alpha.toint())
        is_pre = Int32(lane < n)
        is_post = Int32((lane >= n) & (lane < 2 * n))
        is_res = Int32((lane >= 2 * n) & (lane < self.s.k))
        return (P.ldg_f32(al, Int32(1)), P.ldg_f32(al + 4, Int32(1)), P.ldg_f32(al + 8, Int32(1)),
                P.ldg_f32(Int64(bpre.toint()) + Int64(lane) * 4, is_pre),
                P.ldg_f32(Int64(bpost.toint()) + Int64(lane - n) * 4, is_post),
                P.ldg_f32(Int64(bres.toint()) + Int64(lane - 2 * n) * 4, is_res))

    @cute.jit
    def _coefficients(self, tot: Float32, tg: Int64, live: Int32, lane: Int32, alpha: cute.Pointer,
                      bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer, hpo: cute.Pointer,
                      hro: cute.Pointer, eps: Float32, consts=None, res_out=None):
        """Token ``tg``'s coefficients from its summed partials (lane l holds column l; column K the
        sum of squares): stores H_post and H_res (or, ``sinkhorn`` off, H_res's logits) where
        ``live``, and returns (H_pre of lane l < n, whether lane l holds one). ``consts``: what
        ``_coef_consts`` returned, or None to read the parameters here. ``res_out``: a list that
        receives H_res's logit (lane 2n + i n + j: [i, j]) instead of its store."""
        s = self.s
        n, kpad = s.n, s.kpad
        rstd = P.rsqrt(P.shfl_idx(tot, Int32(kpad)) / Float32(n * s.c) + eps)
        v = tot * rstd
        is_pre = Int32(lane < n)
        is_post = Int32((lane >= n) & (lane < 2 * n))
        is_res = Int32((lane >= 2 * n) & (lane < s.k))
        if cutlass.const_expr(consts is None):
            consts = self._coef_consts(lane, alpha, bpre, bpost, bres)
        a_pre, a_post, a_res, b_pre, b_post, b_res = consts
        h_pre = P.sigmoid(P.fma(a_pre, v, b_pre))
        h_post = Float32(2.0) * P.sigmoid(P.fma(a_post, v, b_post))
        lg = P.fma(a_res, v, b_res)
        if cutlass.const_expr(s.sinkhorn):
            lg = self._sinkhorn(lg, is_res, lane)
        # else H_res leaves as its logits and the Sinkhorn runs after the kernel on every token at
        # once (cluster_ops.launch): its 20 dependent iterations on two warps, while the CTA's
        # others wait, took 4 of this phase's 6 µs a block (H200, T = 8192).
        P.stg_f32(Int64(hpo.toint()) + (tg * n + lane - n) * 4, h_post, live * is_post)
        if cutlass.const_expr(res_out is None):
            P.stg_f32(Int64(hro.toint()) + (tg * (n * n) + lane - 2 * n) * 4, lg, live * is_res)
        else:
            res_out.append(lg)
        return h_pre, is_pre

    @cute.jit
    def _send(self, addr: Int32, rank: Int32, v: Float32, mbar: Int32):
        """``v`` to CTA ``rank``'s shared memory at ``addr``: an st.async counted on its barrier
        ``mbar`` (``push``), or a plain store the next cluster barrier publishes."""
        if cutlass.const_expr(self.s.push):
            P.st_async_f32(P.mapa(addr, rank), v, P.mapa(mbar, rank))
        else:
            P.st_cluster_f32(P.mapa(addr, rank), v)

    @cute.jit
    def _received(self, mbar: Int32):
        """Until every store of an exchange has arrived: this CTA's barrier ``mbar`` (``push``; one
        use a launch, phase 0), or a cluster barrier."""
        if cutlass.const_expr(self.s.push):
            P.mbar_wait(mbar, 0)
        else:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _sinkhorn(self, lg: Float32, is_res: Int32, lane: Int32) -> Float32:
        """H_res from its logits, one lane a matrix entry (lane 2n + i n + j holds [i, j]; the
        other lanes read valid lanes and keep 0): as ``finish._sinkhorn``."""
        n = self.s.n
        lg = P.sel(is_res, lg, Float32(-float("inf")))
        top = lg
        for m_ in (16, 8, 4, 2, 1):
            top = P.fmax(top, P.shfl_xor(top, m_))
        zero = Float32(0.0)
        m = P.sel(is_res, P.fmax(P.exp(lg - top), Float32(1.1754943508222875e-38)), zero)
        cell = (lane - 2 * n) * is_res
        ri = cell // n
        cj = cell - ri * n
        for _ in cutlass.range(self.s.iters, unroll=1):
            csum = P.shfl_idx(m, 2 * n + cj)
            for i2 in cutlass.range_constexpr(1, n):
                csum = csum + P.shfl_idx(m, 2 * n + i2 * n + cj)
            m = P.sel(is_res, P.div(m, csum), zero)
            rsum = P.shfl_idx(m, 2 * n + ri * n)
            for j2 in cutlass.range_constexpr(1, n):
                rsum = rsum + P.shfl_idx(m, 2 * n + ri * n + j2)
            m = P.sel(is_res, P.div(m, rsum), zero)
        return m

    @cute.jit
    def _square_sums(self, hs_: list, lane: Int32, per_lane: int) -> list:
        """Each token's sum of s^2 over the CTA's columns (``hs_`` as ``_mix_group`` returns it),
        the same in every lane."""
        s = self.s
        ragged = per_lane * 32 != s.units
        sqs = []
        for e in cutlass.range_constexpr(len(hs_)):
            sq = Float32(0.0)
            for f in cutlass.range_constexpr(per_lane):
                part_sq = Float32(0.0)
                for v in hs_[e][f]:
                    part_sq = P.fma(v, v, part_sq)
                if cutlass.const_expr(ragged):
                    part_sq = P.sel(Int32(lane + 32 * f < s.units), part_sq, Float32(0.0))
                sq = sq + part_sq
            sqs.append(sq)
        for m_ in (16, 8, 4, 2, 1):
            sqs = [v + P.shfl_xor(v, m_) for v in sqs]
        return sqs

    @cute.jit
    def _mix_group(self, xr: Int32, hpre: Int32, ts: list, lane: Int32, per_lane: int):
        """s = sum_j H_pre[t, j] x'_j, FP32, for tokens ``ts`` at this lane's units (8 columns each),
        from the resident x' (``[n, BT, HS]``, swizzled): ``[token][unit] -> 8 values``. Every
        shared-memory load first, then the FMAs."""
        s = self.s
        coefs, words = [], []
        for t in ts:
            coefs.append([P.lds_f32(hpre + (t * s.n + j) * 4) for j in range(s.n)])
            per_t = []
            for f in cutlass.range_constexpr(per_lane):
                u = lane + 32 * f
                per_t.append([P.lds_v4(xr + (j * s.bt + t) * (s.hs * 2) + (u ^ (t % 8)) * 16) for j in range(s.n)])
            words.append(per_t)
        return self._mix_words(coefs, words)

    @cute.jit
    def _mix_words(self, coefs: list, words: list) -> list:
        """The combination's arithmetic: ``coefs[token][j]`` (H_pre) and ``words[token][unit][j]``
        (4 words: 8 bf16 values of stream j) -> ``[token][unit] -> 8 values``."""
        out = []
        for e in cutlass.range_constexpr(len(words)):
            per_t = []
            for f in cutlass.range_constexpr(len(words[e])):
                h = [Float32(0.0)] * 8
                for j in cutlass.range_constexpr(self.s.n):
                    vals = []
                    for wv in words[e][f][j]:
                        lo, hi = P.unpack(wv)
                        vals += [lo, hi]
                    h = [P.fma(coefs[e][j], vals[k], h[k]) for k in range(8)]
                per_t.append(h)
            out.append(per_t)
        return out

def compile_kernel(kernel, ints: int, ptx_dir: str = "", extra: tuple = ()):
    """``cute.compile`` of a kernel object called as ``compile_cluster``'s result, with ``ints`` Int32
    arguments after the pointers (and after ``extra``: more pointers, by element type)."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def ptr(dtype, align=16):
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)

    bf, f32 = cutlass.BFloat16, Float32
    args = [ptr(bf), ptr(bf), ptr(f32, 4), ptr(f32, 4), ptr(bf), ptr(bf), ptr(f32, 4), ptr(f32, 4), ptr(f32, 4),
            ptr(f32, 4), ptr(f32), ptr(bf), ptr(f32, 4), ptr(f32, 4)]
    args += [ptr(el, 4) for el in extra]
    options = f"--keep-ptx --dump-dir={ptx_dir}" if ptx_dir else None
    return cute.compile(kernel, *args, *[Int32(1)] * ints, Float32(1e-6), Float32(1e-6), make_fake_stream(),
                        options=options)
