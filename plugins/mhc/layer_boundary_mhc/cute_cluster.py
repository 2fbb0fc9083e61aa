"""The MHC update + read with x' kept on chip: one thread-block cluster per token block (CuTe DSL,
Hopper sm_90a; imports ``cutlass``, load through ``cluster_ops``).

The Triton kernels write x' and read it back in a second pass (the finishes), 112 KiB a token at
n = 4, H = 4096 against the 80 KiB roofline: at most about 68 % of it. Here a cluster of ``CL``
CTAs owns ``BT`` tokens; CTA ``r`` owns hidden columns ``[r HS, (r + 1) HS)`` of all n streams, and
keeps its x' slice in shared memory (``BT x n x HS`` bf16, at most 128 KiB) between the projection
and the combination. What crosses CTAs is small and goes through distributed shared memory (with
``push``, as st.async stores that complete the receiver's mbarrier; otherwise plain stores and
loads between cluster barriers):

    1. stream     x'[t, i, c] = H_post[t, i] y[t, c] + sum_j H_res[t, i, j] x[t, j, c]   FP32, rounded
                  once, stored to HBM and to shared memory; partial x' @ phi (bf16 parts of phi,
                  mma.sync, products exact in FP32) and partial sum x'^2 over the CTA's columns
    2. cluster    each CTA sums the CL partials of BT / CL tokens (in rank order), computes rstd,
                  H_pre, H_post and H_res (Sinkhorn; or, ``sinkhorn`` off, its logits, for a
                  Sinkhorn after the kernel) for them, stores H_post and H_res, and sends H_pre to
                  every CTA
    3. combine    s = sum_j H_pre[j] x'_j from shared memory; partial sum s^2 to every CTA; then
                  input = s rsqrt(sum s^2 / C + eps) (w + offset), rounded once

Every CTA sums the same partials in the same order, so all agree on each token's coefficients and
norm, and replays are bitwise. The arithmetic is that of ``triton_mhc`` (the same formulas and
instruction choices: FMA mixes, one rounding, approximate rsqrt and exp, true divisions in
Sinkhorn); the summation orders differ, so the two kernels agree within the check, not in bits.

Layouts. A stream pass chunk is 16 hidden columns: per stage, the n stream tiles and y (``[BT, 16]``
bf16, 32-byte rows, cp.async with zero fill past the last token; each thread's copies are planned
once). phi's fragments for those columns come with the stage. Warp
``w`` takes m-tile ``w // KH`` (16 tokens) and streams ``i = w % KH (mod KH)``; lane
``(g, q) = (lane / 4, lane % 4)`` computes rows ``g, g + 8`` of the tile at columns ``4q .. 4q + 3``.
Those four columns are the lane's A-fragment values for one k16 step: the MMA's k slots
``2q, 2q + 1, 2q + 8, 2q + 9`` are mapped to columns ``4q .. 4q + 3`` (any permutation of k is
free if phi's rows follow it), so the rounded x' words feed the MMA, the HBM store and the
shared-memory copy unchanged. ``cluster_ops.phi_fragments`` lays phi's bf16 parts out per
(chunk, stream, part, n-tile, lane). The resident x' is ``[n, BT, HS]`` with 16-byte units XOR-
swizzled by ``token % 8``: the stream pass's stores and the combination's 16-byte row reads are
both free of bank conflicts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import cute_ptx as P
from .cluster_shape import ClusterShape
from .cute_steps import ClusterSteps, compile_kernel


class MhcCluster(ClusterSteps):
    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
                 phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
                 w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
                 tokens: Int32, blocks: Int32, sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32,
                 sit: Int32, eps: Float32, norm_eps: Float32, stream: cuda.CUstream):
        s = self.s
        self.kernel(x, y, hp, hr, xo, phf, alpha, bpre, bpost, bres, w32, out, hpo, hro, tokens,
                    sxt, sxn, syt, sot, son, sit, eps, norm_eps).launch(
            grid=[s.cl, blocks, 1], block=[s.threads, 1, 1], cluster=[s.cl, 1, 1], smem=s.smem, stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
               phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
               w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
               tokens: Int32,
               sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32,
               eps: Float32, norm_eps: Float32):
        s = self.s
        n, bt, hs, kpad, kh_n = s.n, s.bt, s.hs, s.kpad, s.kh
        _, blk, _ = cute.arch.block_idx()
        tid, rank, warp, lane, g, q, xr = self._start()
        stage0 = xr + s.xr_bytes
        part = stage0 + s.stages * s.stage_bytes
        hpre = part + s.part_bytes
        hsq = hpre + s.hpre_bytes
        wp = stage0  # per-warp partials, after the last stage is consumed
        mb = hsq + s.hsq_bytes  # push: the mbarriers of the partials, H_pre and the norms' sums

        if cutlass.const_expr(s.push):
            # Every incoming byte of an exchange completes the receiver's barrier; the one cluster
            # barrier, waited for before the first store, publishes the barriers' initialization.
            if tid == 0:
                for k in cutlass.range_constexpr(3):
                    P.mbar_init(mb + 8 * k, 1)
                P.fence_mbar_init()
                P.mbar_expect_tx(mb, bt * (kpad + 1) * 4)
                P.mbar_expect_tx(mb + 8, bt * n * 4)
                P.mbar_expect_tx(mb + 16, s.cl * bt * 4)
            P.cluster_arrive_relaxed()

        row0 = blk * bt
        col0 = rank * hs
        x_a, y_a, xo_a, phf_a = Int64(x.toint()), Int64(y.toint()), Int64(xo.toint()), Int64(phf.toint())

        # ---- 1. stream pass ----------------------------------------------------------------
        mt = warp // kh_n
        kh = warp % kh_n
        r0 = 16 * mt + g
        r1 = r0 + 8
        live0 = Int32(row0 + r0 < tokens)
        live1 = Int32(row0 + r1 < tokens)
        ls = (n + kh_n - 1) // kh_n  # streams a warp computes (some warps fewer)

        # This warp's streams' coefficients for its two rows, loaded once.
        coef = []
        for si in cutlass.range_constexpr(ls):
            i = kh + si * kh_n
            ok = Int32(i < n)
            per_row = []
            for r, live in ((r0, live0), (r1, live1)):
                t64 = Int64(row0 + r)
                vals = []
                if cutlass.const_expr(s.update):
                    vals.append(P.ldg_f32(Int64(hp.toint()) + (t64 * n + i) * 4, live * ok))
                    for j in cutlass.range_constexpr(n):
                        vals.append(P.ldg_f32(Int64(hr.toint()) + ((t64 * n + i) * n + j) * 4, live * ok))
                per_row.append(vals)
            coef.append(per_row)
        xo_rows = [[xo_a + (Int64(row0 + r) * sot + Int64(kh + si * kh_n) * son + Int64(col0 + 4 * q)) * 2
                    for r in (r0, r1)] for si in range(ls)]

        plan = self._issue_plan(tid, col0, row0, tokens, x_a, y_a, sxt, sxn, syt, phf_a, rank)
        for c in cutlass.range_constexpr(s.stages - 1):
            if c < s.nch:
                self._issue(plan, Int32(c), stage0 + c * s.stage_bytes)
            else:
                P.cp_async_commit()
        # Stage indices of the chunk read and of the chunk issued, carried rather than computed as
        # ch % stages (a multiply-shift sequence each time at 3 stages). x' goes to HBM at
        # xo_row[ri] + 32 ch: the rows' addresses are computed once.
        stg = cute.make_rmem_tensor((2,), Int32)
        stg[0] = Int32(0)
        stg[1] = Int32(s.stages - 1)

        # phi's fragments of this warp's streams come with the stages (from L2 straight to registers a
        # chunk ahead was slower, and removed: PERFORMANCE-history.md, "Sixth pass").
        nfrag = ls * 3 * s.nt
        pfs = (cute.make_rmem_tensor((nfrag * 2,), Int32), cute.make_rmem_tensor((nfrag * 2,), Int32))
        acc = cute.make_rmem_tensor((s.nt * 4,), Float32)
        acc.fill(0.0)
        ssq = cute.make_rmem_tensor((2,), Float32)
        ssq.fill(0.0)
        # Two chunks an iteration, so that the fragments loaded for the next chunk land in the other
        # buffer and feed its MMAs as loaded (one buffer would be copied at the end of each chunk,
        # waiting there for the loads' L2 round trip).
        for ch2 in cutlass.range(s.nch // 2, unroll=1):
            for half in cutlass.range_constexpr(2):
                ch = ch2 * 2 + half
                P.cp_async_wait(s.stages - 2)
                cute.arch.sync_threads()
                nxt = ch + s.stages - 1
                rd = stg[0]
                wr = stg[1]
                if nxt < s.nch:
                    self._issue(plan, nxt, stage0 + wr * s.stage_bytes)
                else:
                    P.cp_async_commit()
                stg[0] = rd + 1 - s.stages * Int32(rd + 1 >= s.stages)
                stg[1] = wr + 1 - s.stages * Int32(wr + 1 >= s.stages)
                base = stage0 + rd * s.stage_bytes
                cur = pfs[half]
                # Every fragment of this warp's streams from the stage, before the MMAs need them.
                self._phi_stage_load(cur, base + s.sx + s.sy, kh, lane)
                # Rows r0, r1 at columns 4q .. 4q + 3 of every stream and of y: two words a row.
                xs = []
                if cutlass.const_expr(s.update):
                    for j in cutlass.range_constexpr(n):
                        xs.append((P.lds_v2(base + (j * bt + r0) * 32 + q * 8),
                                   P.lds_v2(base + (j * bt + r1) * 32 + q * 8)))
                    ys = (P.lds_v2(base + s.sx + r0 * 32 + q * 8), P.lds_v2(base + s.sx + r1 * 32 + q * 8))
                for si in cutlass.range_constexpr(ls):
                    i = kh + si * kh_n
                    if i < n:
                        words = []  # [row][2 words]
                        for ri in cutlass.range_constexpr(2):
                            if cutlass.const_expr(s.update):
                                vals = coef[si][ri]
                                yv = P.unpack(ys[ri][0]) + P.unpack(ys[ri][1])
                                xv = [P.unpack(xs[j][ri][0]) + P.unpack(xs[j][ri][1]) for j in range(n)]
                                mixed = []
                                for e in cutlass.range_constexpr(4):
                                    v = vals[0] * yv[e]
                                    for j in cutlass.range_constexpr(n):
                                        v = P.fma(vals[1 + j], xv[j][e], v)
                                    mixed.append(v)
                                row_words = [P.pack(mixed[0], mixed[1]), P.pack(mixed[2], mixed[3])]
                            else:
                                rr = r0 if ri == 0 else r1
                                row_words = P.lds_v2(base + (i * bt + rr) * 32 + q * 8)
                            words.append(row_words)
                            for wv in row_words:
                                lo, hi = P.unpack(wv)
                                ssq[ri] = P.fma(hi, hi, P.fma(lo, lo, ssq[ri]))
                        r_pairs = ((r0, live0), (r1, live1))
                        for ri in cutlass.range_constexpr(2):
                            r, live = r_pairs[ri]
                            if cutlass.const_expr(s.update):
                                P.stg_v2(xo_rows[si][ri] + Int64(ch * 32), words[ri][0], words[ri][1], live)
                            unit = (2 * ch + q // 2) ^ (r % 8)
                            P.sts_v2(xr + (i * bt + r) * (hs * 2) + unit * 16 + (q % 2) * 8, words[ri][0], words[ri][1])
                        a = (words[0][0], words[1][0], words[0][1], words[1][1])
                        for p in cutlass.range_constexpr(3):
                            part_idx = 2 - p  # the smallest part first
                            for nt in cutlass.range_constexpr(s.nt):
                                f = ((si * 3 + part_idx) * s.nt + nt) * 2
                                d = P.mma_bf16(a, (cur[f], cur[f + 1]), [acc[nt * 4 + e] for e in range(4)])
                                for e in cutlass.range_constexpr(4):
                                    acc[nt * 4 + e] = d[e]
        P.cp_async_wait(0)
        cute.arch.sync_threads()

        # Per-warp partials -> shared memory, then summed over the warps of each m-tile in order.
        ssq0 = ssq[0] + P.shfl_xor(ssq[0], 1)
        ssq0 = ssq0 + P.shfl_xor(ssq0, 2)
        ssq1 = ssq[1] + P.shfl_xor(ssq[1], 1)
        ssq1 = ssq1 + P.shfl_xor(ssq1, 2)
        row_bytes = (kpad + 1) * 4
        wbase = wp + warp * 16 * row_bytes
        for nt in cutlass.range_constexpr(s.nt):
            col = 8 * nt + 2 * q
            P.sts_f32(wbase + g * row_bytes + col * 4, acc[nt * 4])
            P.sts_f32(wbase + g * row_bytes + (col + 1) * 4, acc[nt * 4 + 1])
            P.sts_f32(wbase + (g + 8) * row_bytes + col * 4, acc[nt * 4 + 2])
            P.sts_f32(wbase + (g + 8) * row_bytes + (col + 1) * 4, acc[nt * 4 + 3])
        if q == 0:
            P.sts_f32(wbase + g * row_bytes + kpad * 4, ssq0)
            P.sts_f32(wbase + (g + 8) * row_bytes + kpad * 4, ssq1)
        cute.arch.sync_threads()
        if cutlass.const_expr(s.push):
            P.cluster_wait()  # every CTA's barriers initialized (arrived at the start)
        cells = bt * (kpad + 1)
        for k in cutlass.range_constexpr((cells + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            if idx < cells:
                t = idx // (kpad + 1)
                col = idx - t * (kpad + 1)
                src = wp + ((t // 16) * kh_n * 16 + t % 16) * row_bytes + col * 4
                tot = P.lds_f32(src)
                for kk in cutlass.range_constexpr(1, kh_n):
                    tot = tot + P.lds_f32(src + kk * 16 * row_bytes)
                if cutlass.const_expr(s.push):
                    # To token t's owner, row (rank, t % tpc) of its partials.
                    dst = part + ((rank * s.tpc + t % s.tpc) * (kpad + 1) + col) * 4
                    self._send(dst, t // s.tpc, tot, mb)
                else:
                    P.sts_f32(part + idx * 4, tot)
        if cutlass.const_expr(not s.push):
            self._received(mb)

        # ---- 2. coefficients of this CTA's tokens ---------------------------------------------
        if warp < s.tpc:
            t = rank * s.tpc + warp
            live = Int32(row0 + t < tokens)
            # Lanes past kpad read column kpad again; nothing uses their values. Either way the
            # CTAs' partials are summed in rank order.
            if cutlass.const_expr(s.push):
                P.mbar_wait(mb, 0)
                src = part + (warp * (kpad + 1) + cutlass.min(lane, kpad)) * 4
                tot = P.lds_f32(src)
                for cr in cutlass.range_constexpr(1, s.cl):
                    tot = tot + P.lds_f32(src + cr * s.tpc * (kpad + 1) * 4)
            else:
                src = part + (t * (kpad + 1) + cutlass.min(lane, kpad)) * 4
                tot = P.ld_cluster_f32(P.mapa(src, Int32(0)))
                for cr in cutlass.range_constexpr(1, s.cl):
                    tot = tot + P.ld_cluster_f32(P.mapa(src, Int32(cr)))
            h_pre, is_pre = self._coefficients(tot, Int64(row0 + t), live, lane, alpha, bpre, bpost, bres, hpo,
                                               hro, eps)
            if is_pre != 0:
                for cr in cutlass.range_constexpr(s.cl):
                    self._send(hpre + (t * n + lane) * 4, Int32(cr), h_pre, mb + 8)
        self._received(mb + 8)

        # ---- 3. combination and norm over the CTA's columns ---------------------------------
        # Warp w takes tokens w, w + warps, ...; lane l units l, l + 32, ... (8 columns each). Tokens
        # go GROUP at a time, every load of a group issued before its arithmetic (the loads are
        # inline assembly the compiler keeps in order).
        per_lane = (s.units + 31) // 32
        ragged = per_lane * 32 != s.units
        tpw = bt // s.warps
        group = min(4, tpw)
        w_a = Int64(w32.toint()) + Int64(col0) * 4
        wvs = []
        for f in cutlass.range_constexpr(per_lane):
            u_a = w_a + Int64(cutlass.min(lane + 32 * f, s.units - 1)) * 32
            wvs.append(P.ldg_v4_f32(u_a) + P.ldg_v4_f32(u_a + 16))
        for e0 in cutlass.range_constexpr(0, tpw, group):
            ts = [warp + (e0 + e) * s.warps for e in range(group)]
            hs_ = self._mix_group(xr, hpre, ts, lane, per_lane)
            sqs = self._square_sums(hs_, lane, per_lane)
            if lane == 0:
                for e in cutlass.range_constexpr(group):
                    for cr in cutlass.range_constexpr(s.cl):
                        self._send(hsq + (rank * bt + ts[e]) * 4, Int32(cr), sqs[e], mb + 16)
        self._received(mb + 16)
        for e0 in cutlass.range_constexpr(0, tpw, group):
            ts = [warp + (e0 + e) * s.warps for e in range(group)]
            tots = [P.lds_f32(hsq + t * 4) for t in ts]
            for cr in cutlass.range_constexpr(1, s.cl):
                tots = [tots[e] + P.lds_f32(hsq + (cr * bt + ts[e]) * 4) for e in range(group)]
            hs_ = self._mix_group(xr, hpre, ts, lane, per_lane)
            for e in cutlass.range_constexpr(group):
                t = ts[e]
                live = Int32(row0 + t < tokens)
                r2 = P.rsqrt(tots[e] / Float32(s.c) + norm_eps)
                for f in cutlass.range_constexpr(per_lane):
                    u = lane + 32 * f
                    h = hs_[e][f]
                    wv = wvs[f]
                    o = [P.pack((h[2 * k] * r2) * wv[2 * k], (h[2 * k + 1] * r2) * wv[2 * k + 1]) for k in range(4)]
                    dst = Int64(out.toint()) + (Int64(row0 + t) * sit + Int64(col0 + 8 * u)) * 2
                    ok = live * Int32(u < s.units) if ragged else live
                    P.stg_v4(dst, o[0], o[1], o[2], o[3], ok)

    @cute.jit
    def _phi_stage_load(self, pf: cute.Tensor, stage_phi: Int32, kh: Int32, lane: Int32):
        """This warp's streams' phi fragments of one chunk, from the stage's copy: (stream, part,
        n-tile) x 2 words."""
        s = self.s
        for si in cutlass.range_constexpr((s.n + s.kh - 1) // s.kh):
            i = cutlass.min(kh + si * s.kh, s.n - 1)  # streams past n: loaded, never used
            for part in cutlass.range_constexpr(3):
                for nt in cutlass.range_constexpr(s.nt):
                    w = P.lds_v2(stage_phi + ((i * 3 + part) * s.nt + nt) * 256 + lane * 8)
                    f = ((si * 3 + part) * s.nt + nt) * 2
                    pf[f] = w[0]
                    pf[f + 1] = w[1]

    @cute.jit
    def _issue_plan(self, tid, col0, row0, tokens, x_a, y_a, sxt, sxn, syt, phf_a, rank):
        """This thread's cp.async of every chunk, worked out once: per copy (offset in a stage,
        source at chunk 0, source step a chunk, bytes, whether it copies). A stage holds the chunk's
        stream tiles and y tile (16 columns: two 16-byte halves a row; rows past the last token
        arrive as zeros) and this CTA's phi fragments of the chunk."""
        s = self.s
        n, bt = s.n, s.bt
        px = n * bt * 2
        py = bt * 2 if s.update else 0
        total = px + py + s.phi_chunk // 16
        plan = []
        for k in cutlass.range_constexpr((total + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            is_x = Int32(idx < px)
            is_y = Int32(idx >= px) * Int32(idx < px + py)
            is_p = Int32(idx >= px + py) * Int32(idx < total)
            # x: copy idx = (stream j, row, half); y: (row, half); phi: 16-byte piece pi
            j = idx // (2 * bt)
            rem = idx - j * (2 * bt)
            row_x, half_x = rem // 2, rem % 2
            rem_y = cutlass.max(idx - px, Int32(0))
            row_y, half_y = rem_y // 2, rem_y % 2
            live_x = is_x * Int32(row0 + row_x < tokens)
            live_y = is_y * Int32(row0 + row_y < tokens)
            off_x = (Int64(row0 + row_x) * sxt + Int64(j) * sxn + Int64(col0 + 8 * half_x)) * 2
            off_y = (Int64(row0 + row_y) * syt + Int64(col0 + 8 * half_y)) * 2
            pi = cutlass.max(idx - px - py, Int32(0))
            off_p = Int64(rank * s.nch) * s.phi_chunk + Int64(pi * 16)
            src = (x_a + off_x * Int64(live_x)) * Int64(is_x) + (y_a + off_y * Int64(live_y)) * Int64(is_y) \
                + (phf_a + off_p) * Int64(is_p)
            dst = is_x * ((j * bt + row_x) * 32 + half_x * 16) + is_y * (s.sx + row_y * 32 + half_y * 16) \
                + is_p * (s.sx + s.sy + pi * 16)
            step = (live_x + live_y) * 32 + is_p * s.phi_chunk
            nbytes = (live_x + live_y + is_p) * 16
            plan.append((dst, src, step, nbytes, is_x + is_y + is_p, (k + 1) * s.threads <= total))
        return plan

    @cute.jit
    def _issue(self, plan, chunk, stage_a):
        """cp.async of chunk ``chunk`` into the stage at ``stage_a``, as ``plan`` says, one group."""
        for dst, src, step, nbytes, ok, every in plan:
            if cutlass.const_expr(every):
                P.cp_async16(stage_a + dst, src + Int64(chunk * step), nbytes)
            else:
                P.cp_async16_if(stage_a + dst, src + Int64(chunk * step), nbytes, ok)
        P.cp_async_commit()

def compile_cluster(shape: ClusterShape, ptx_dir: str = ""):
    """Compile one variant ahead of time from placeholder pointers and stream (no GPU needed, with
    ``CUTE_DSL_ARCH=sm_90a``). Called as ``f(x, y, hp, hr, xo, phf, alpha, bpre, bpost, bres, w32, out,
    hpo, hro, tokens, blocks, sxt, sxn, syt, sot, son, sit, eps, norm_eps, stream)`` with pointers from
    ``cutlass.cute.runtime.make_ptr`` (bf16 streams, FP32 coefficients, parameters and weight)."""
    return compile_kernel(MhcCluster(shape), 8, ptx_dir)
