"""The MHC update + read at prefill sizes with split roles (CuTe DSL, Hopper sm_90a; imports
``cutlass``, load through ``cluster_ops``).

The persistent variant (``cute_persistent``) runs everything on one CTA an SM: its stream pass, its
share of the exchanges and the combination. Its floor is about 60 % of the byte roofline
(PERFORMANCE.md, eleventh pass): the combination, the exchanges' barriers and waits cannot overlap
the stream pass on the same SM, whose L1 the stream pass keeps busy. Here the roles sit on
different SMs of one launch (no clusters):

- **Stream CTAs** (``sets`` sets of 16; CTA ``16 g + r`` owns columns ``[r C/16, (r + 1) C/16)`` of
  the blocks ``g, g + sets, ...``). Each runs the persistent variant's stream pass unchanged (phi's
  slice resident, x and y a block ahead by cp.async, coefficient rows two blocks ahead, x' stored).
  It then writes the block's summed partials to global memory (``[block][CTA][token][K + 1]``) and,
  after the next block's top barrier, counts it ready (thread 0's release add). It never waits for
  another CTA, so it never waits for a finisher.
- **Finisher CTAs** (the SMs the sets leave: 36 on an H200), tokens ``f, f + F, ...`` each, through
  a ring of x' rows in shared memory (``fslots`` rows of n x C bf16, an mbarrier pair a row):
  - producer warps (``producers``, ``pdepth`` tokens a step): once a token's block count reaches 16
    (an acquire read), the warp sums the 16 CTAs' partials in rank order, the persistent variant's
    order (so H_post and H_res's logits are its bits), computes the coefficients and leaves H_pre
    in its own small ring; then, as soon as the token's row is free, lane 0 starts one bulk copy a
    stream of its x' (from L2: stored a few blocks ago) into the row. The warp also gathers its
    tokens' H_res logits, a token a lane, and runs their Sinkhorn in batches while its next count
    has not come;
  - consumer warps (the rest): each thread combines its 8-column units of the row, the warps' sums
    of squares meet in shared memory, and each thread normalizes and stores its units.

  The input's bits may differ from the other kernels' by the order of that sum, within the
  tolerance table.

The counts start from zero: the half of a buffer kept from launch to launch that the launch
before zeroed (``counts``; ``SplitShape.kept``): each launch
reads the buffer's phase, its finishers zero the other half, and its last CTA flips the phase once
every CTA has arrived. That drops the memset before the launch (and the gap after it).

A finisher spins only on blocks whose stream CTAs never wait, so the launch completes whenever its
stream CTAs get SMs. The grid is sized so that every CTA is resident on an idle GPU (one CTA an SM:
shared memory), and CTAs are dispatched in index order, stream CTAs first. A count or a ring row
that has not come 20 s into its wait traps (``cute_ptx.spin_until``, ``mbar_wait_bounded``): a bug
then fails the launch instead of hanging it. (A producer step deeper than the ring allows hung once,
on a ring wait without that bound: ``SplitShape.pdepth``.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import cute_ptx as P
from .cluster_shape import SplitShape
from .cute_persistent import MhcPersistent
from .cute_steps import compile_kernel

# Tokens a step of a consumer warp: their loads and arithmetic interleave, one barrier for all.
CONSUME_DEPTH = 2
# The producers' Sinkhorn: a batch this size or more runs when the warp's next count has not come.
SK_IDLE = 8


class MhcSplit(MhcPersistent):
    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
                 phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
                 w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
                 part: cute.Pointer, cnt: cute.Pointer, tokens: Int32, blocks: Int32, sets: Int32, finishers: Int32,
                 cap: Int32, sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32, eps: Float32,
                 norm_eps: Float32, stream: cuda.CUstream):
        s = self.s
        self.kernel(x, y, hp, hr, xo, phf, alpha, bpre, bpost, bres, w32, out, hpo, hro, part, cnt, tokens,
                    blocks, sets, cap, sxt, sxn, syt, sot, son, sit, eps, norm_eps).launch(
            grid=[sets * 16 + finishers, 1, 1], block=[s.threads, 1, 1], smem=s.smem, stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
               phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
               w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
               part: cute.Pointer, cnt: cute.Pointer, tokens: Int32, blocks: Int32, sets: Int32, cap: Int32,
               sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32,
               eps: Float32, norm_eps: Float32):
        s = self.s
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tid, _, warp, lane, g, q, base = self._start()
        part_a, cnt_a = Int64(part.toint()), Int64(cnt.toint())
        head = cnt_a
        # [phase, arrivals, -, -, counts[0][cap], counts[1][cap]] (``counts``): this launch's
        # counts are the phase's half; the CTA arrives once all its threads have read the phase.
        phase = P.ld_relaxed_u32(head)
        P.bar_sync(1, s.threads)
        if tid == 0:
            P.red_release_add(head + 4, Int32(1))
        cnt_a = head + 16 + Int64(phase) * Int64(cap) * 4
        if bid < sets * 16:
            self._streamer(bid, sets, x, y, hp, hr, xo, phf, part_a, cnt_a, tokens, blocks, sxt, sxn, syt, sot, son,
                           tid, warp, lane, g, q, base)
        else:
            if cutlass.const_expr(s.update):
                src = (Int64(xo.toint()), sot, son)
            else:
                src = (Int64(x.toint()), sxt, sxn)
            # The other half, the launch before's (complete by now), zeroed for the launch after.
            other = head + 16 + Int64(1 - phase) * Int64(cap) * 4
            for j in cutlass.range((bid - sets * 16) * s.threads + tid, cap, (nblk - sets * 16) * s.threads,
                                   unroll=1):
                P.st_relaxed_u32(other + Int64(j) * 4, Int32(0))
            self._finisher(bid - sets * 16, nblk - sets * 16, src, alpha, bpre, bpost, bres, w32, out, hpo, hro,
                           part_a, cnt_a, tokens, sit, eps, norm_eps, tid, warp, lane, base)
        if bid == nblk - 1 and tid == 0:
            # Every CTA has read the phase once all have arrived: the next launch takes the
            # other half (zeroed above), and finds the arrivals at zero.
            P.spin_until(head + 4, Int32(nblk))
            P.st_relaxed_u32(head + 4, Int32(0))
            P.st_relaxed_u32(head, 1 - phase)

    @cute.jit
    def _streamer(self, sid, sets, x, y, hp, hr, xo, phf, part_a, cnt_a, tokens, blocks, sxt, sxn, syt, sot, son,
                  tid, warp, lane, g, q, phi_s):
        """Stream CTA ``sid``: the persistent variant's stream pass over its blocks, each block's
        partials to global memory and the block counted ready."""
        s = self.s
        kpad = s.kpad
        rank = sid % 16
        first = sid // 16
        slots = phi_s + s.phi_bytes
        coef = slots + s.slot_bytes
        wp = coef + s.coef_bytes
        col0 = rank * s.hs
        x_a, y_a, xo_a, phf_a = Int64(x.toint()), Int64(y.toint()), Int64(xo.toint()), Int64(phf.toint())
        hp_a, hr_a = Int64(hp.toint()), Int64(hr.toint())
        nloc = (blocks - first + sets - 1) // sets
        slot = slots + warp * s.warp_slot
        fill = self._fill_plan(lane, warp, col0, x_a, y_a, sxt, sxn, syt)
        xol = xo_a + (Int64(g) * sot + Int64(col0 + 8 * q)) * 2
        self._gather_phi(tid, rank, phf_a, phi_s)
        # Coefficient rows two blocks ahead, in two buffers (the second after the partials): issued
        # one block ahead, right before the top wait, their round trip to memory was that wait.
        coef_alt = wp + s.wp_bytes - coef
        self._first_block(tid, first, tokens, hp_a, hr_a, coef, fill, slot, warp, lane)
        if cutlass.const_expr(s.update):
            self._coef_issue(tid, first + sets, tokens, hp_a, hr_a, coef + coef_alt)
        acc = cute.make_rmem_tensor((s.nt * 4,), Float32)
        sq = cute.make_rmem_tensor((8,), Float32)
        row = s.bt * (kpad + 1)  # a CTA's partials of one block
        for it in cutlass.range(nloc, unroll=1):
            blk = first + it * sets
            if cutlass.const_expr(s.update):
                P.cp_async_wait(1)  # all but the coefficient rows of block blk + sets
            else:
                P.cp_async_wait_all()
            P.bar_sync(1, s.threads)
            cb = coef + (it % 2) * coef_alt
            # The previous block counted ready now, behind the barrier every thread passed after its
            # x' and partials of it: thread 0's release covers them (cumulative), and their stores
            # have long drained. A fence and count right after the block stalled every warp on its
            # own stores: 483.7 against 365.0 µs (H200, T = 8192, the first finisher form).
            # (Its fence holds thread 0 for a third of its stream pass, ncu; no other placement
            # measured faster: PERFORMANCE.md, fourteenth pass.)
            if tid == 0 and it > 0:
                P.red_release_add(cnt_a + Int64(blk - sets) * 4, Int32(1))
            self._stream(slot, fill, blk, Int32(blk + sets < blocks), sets, tokens, phi_s, cb, xol, sot, son,
                         warp, g, q, acc, sq)
            self._partials(acc, sq, wp, Int32(0), Int32(0), rank, tid, warp, g, q, False,
                           sink=part_a + (Int64(blk) * 16 + Int64(rank)) * row * 4)
            if cutlass.const_expr(s.update):
                self._coef_issue(tid, blk + 2 * sets, tokens, hp_a, hr_a, cb)
        P.bar_sync(1, s.threads)
        if tid == 0 and nloc > 0:
            P.red_release_add(cnt_a + Int64(first + (nloc - 1) * sets) * 4, Int32(1))
        P.cp_async_wait_all()  # the last iteration's copies (zeros past the last block) land before exit
        return nloc

    @cute.jit
    def _finisher(self, fid, nfin, src, alpha, bpre, bpost, bres, w32, out, hpo, hro, part_a, cnt_a, tokens, sit,
                  eps, norm_eps, tid, warp, lane, base):
        """Finisher CTA ``fid`` of ``nfin``: tokens ``fid, fid + nfin, ...`` (the CTA's token i) through
        a ring of ``fslots`` rows in shared memory. Producer warps (``producers``; token i on warp i
        % producers, ``pdepth`` tokens a step so that their round trips overlap): once a token's
        block is ready, the warp computes its coefficients, then starts the copy engine on its x'
        row as soon as the row is free. Consumer warps (the rest, ``CONSUME_DEPTH`` tokens a step)
        take the ring in order: each thread combines its 8-column units of the row, the warps' sums of
        squares meet in shared memory, and each thread normalizes and stores its units."""
        s = self.s
        ring = base
        hpre_s = ring + s.fslots * s.fslot  # H_pre a token, hrows of them (token i's at i % hrows)
        full = hpre_s + s.hrows * 16  # a row's bytes landed, its H_pre written before: 1 arrival + bytes
        empty = full + s.fslots * 8  # every consumer warp done reading a row
        red = empty + s.fslots * 8  # [step parity][token of the step][consumer warp] sums of squares
        if tid == 0:
            for k in cutlass.range_constexpr(s.fslots):
                P.mbar_init(full + k * 8, 1)
                P.mbar_init(empty + k * 8, s.warps - s.producers)
            P.fence_mbar_init()
        P.bar_sync(1, s.threads)
        mine = (tokens - fid + nfin - 1) // nfin
        if warp < s.producers:
            self._produce(fid, nfin, mine, src, alpha, bpre, bpost, bres, hpo, hro, part_a, cnt_a, eps, warp, lane,
                          ring, hpre_s, full, empty)
        else:
            self._consume(fid, nfin, mine, w32, out, sit, norm_eps, tid, warp, lane, ring, hpre_s, full, empty, red)
        return mine

    @cute.jit
    def _produce(self, fid, nfin, mine, src, alpha, bpre, bpost, bres, hpo, hro, part_a, cnt_a, eps, warp, lane,
                 ring, hpre_s, full, empty):
        s = self.s
        n, kpad, depth, npro = s.n, s.kpad, s.pdepth, s.producers
        row_a, st, sn = src
        consts = self._coef_consts(lane, alpha, bpre, bpost, bres)
        col = cutlass.min(lane, kpad)
        count = cutlass.max(mine - warp + npro - 1, 0) // npro  # this warp's tokens
        # H_res's Sinkhorn in the producers: lane b holds the logits of the warp's batch token b (skm)
        # and its index (skt[1]); skt[0] counts the batch, the same in every lane.
        skm = cute.make_rmem_tensor((n * n,), Float32)
        skt = cute.make_rmem_tensor((2,), Int32)
        skt[0] = Int32(0)
        skt[1] = Int32(0)
        for k in cutlass.range((count + depth - 1) // depth, unroll=1):
            # A batch of SK_IDLE or more while the step's first count has not come: time the
            # warp would wait anyway.
            if skt[0] >= SK_IDLE:
                t_first = fid + cutlass.min(warp + npro * k * depth, mine - 1) * nfin
                if P.count_lane0(cnt_a + Int64(t_first // s.bt) * 4, lane) < 16:
                    self._sinkhorn_lanes(skm, skt[1], Int32(lane < skt[0]), hro)
                    skt[0] = Int32(0)
            toks = []
            for d in cutlass.range_constexpr(depth):
                i = warp + npro * (k * depth + d)
                live = Int32(i < mine)
                t = fid + cutlass.min(i, mine - 1) * nfin
                toks.append((live, i, t, t // s.bt))
                if live != 0:
                    # Every lane's acquire: lane 0's with the warp's barrier after it ran slower
                    # (246.6 against 237.3 µs, H200, T = 8192).
                    P.spin_until(cnt_a + Int64(t // s.bt) * 4, Int32(16))
            # Each token's 16 CTAs' partials, summed in rank order (the persistent variant's), every
            # token's loads issued before any sum.
            vals = []
            for d in cutlass.range_constexpr(depth):
                live, _, t, blk = toks[d]
                at = part_a + (Int64(blk) * 16 * s.bt + Int64(t - blk * s.bt)) * (kpad + 1) * 4 + Int64(col) * 4
                vals.append([P.ldg_f32_cg(at + cr * s.bt * (kpad + 1) * 4, live) for cr in range(16)])
            for d in cutlass.range_constexpr(depth):
                live, i, t, _ = toks[d]
                tot = vals[d][0]
                for cr in cutlass.range_constexpr(1, 16):
                    tot = tot + vals[d][cr]
                res = []
                h_pre, _ = self._coefficients(tot, Int64(t), live, lane, None, None, None, None, hpo, hro, eps,
                                              consts, res_out=res)
                if live != 0:
                    mine_ = Int32(lane == skt[0])
                    for e in cutlass.range_constexpr(n * n):
                        skm[e] = P.sel(mine_, P.shfl_idx(res[0], Int32(2 * n + e)), skm[e])
                    skt[1] = skt[1] + mine_ * (t - skt[1])
                    skt[0] = skt[0] + 1
                if live != 0 and lane < n:
                    P.sts_f32(hpre_s + (i % s.hrows) * 16 + lane * 4, h_pre)
            cute.arch.sync_warp()
            # Only now a ring row each: the coefficients (a round trip for the partials) no longer sit
            # between a row's release and its refill, which is then the copy alone. H_pre has its own rows (hrows, twice the ring's), free by then:
            # the row of token i - hrows was read before the rows this warp took last step were
            # released.
            for d in cutlass.range_constexpr(depth):
                live, i, t, _ = toks[d]
                sl = i % s.fslots
                rnd = i // s.fslots
                if live != 0:
                    if rnd > 0:
                        P.mbar_wait_bounded(empty + sl * 8, (rnd - 1) & 1)
                    if lane == 0:
                        # The arrival (with the row's bytes to come) also publishes H_pre, written
                        # by the warp's lanes before the sync above.
                        self._row_copy(row_a, st, sn, t, ring + sl * s.fslot, full + sl * 8)
            if skt[0] > 32 - depth:  # no room for another step's tokens
                self._sinkhorn_lanes(skm, skt[1], Int32(lane < skt[0]), hro)
                skt[0] = Int32(0)
        if skt[0] > 0:
            self._sinkhorn_lanes(skm, skt[1], Int32(lane < skt[0]), hro)

    @cute.jit
    def _row_copy(self, row_a, st, sn, t, dst, mbar):
        """Lane 0: token ``t``'s x' row (n streams of C bf16, from L2) into the ring row at ``dst`` by
        the copy engine, counted on ``mbar`` (one arrival with the bytes to come)."""
        s = self.s
        P.fence_proxy_async_global()
        P.mbar_expect_tx(mbar, s.n * s.c * 2)
        for j in cutlass.range_constexpr(s.n):
            src = row_a + (Int64(t) * st + Int64(j) * sn) * 2
            P.bulk_g2s(dst + j * s.c * 2, src, s.c * 2, mbar)

    @cute.jit
    def _sinkhorn_lanes(self, skm, tok, live, hro):
        """The Sinkhorn of one token a lane (logits in ``skm``; lanes where ``live`` is 0 compute but
        store nothing), stored to H_res: ``_sinkhorn``'s operations in its order, except that a
        sum's reciprocal is taken once and multiplied (``div.full`` is that product for these
        operands; n divisions a sum held a warp on its sub-partition's 4 special-function units a
        cycle: all of a warp's tokens after its last one took 18 µs at T = 8192)."""
        n = self.s.n
        nn = n * n
        top = skm[0]
        for e in cutlass.range_constexpr(1, nn):
            top = P.fmax(top, skm[e])
        for e in cutlass.range_constexpr(nn):
            skm[e] = P.fmax(P.exp(skm[e] - top), Float32(1.1754943508222875e-38))
        cols = [[i2 * n + j for i2 in range(n)] for j in range(n)]
        rows = [[i2 * n + j for j in range(n)] for i2 in range(n)]
        for _ in cutlass.range(self.s.iters, unroll=1):
            for lines in (cols, rows):  # columns, then rows: each summed in order, then scaled
                for line in lines:
                    tot = skm[line[0]]
                    for e in line[1:]:
                        tot = tot + skm[e]
                    rc = P.rcp(tot)
                    for e in line:
                        skm[e] = skm[e] * rc
        base = Int64(hro.toint()) + Int64(tok) * (nn * 4)
        for e in cutlass.range_constexpr(nn):
            P.stg_f32(base + e * 4, skm[e], live)

    @cute.jit
    def _consume(self, fid, nfin, mine, w32, out, sit, norm_eps, tid, warp, lane, ring, hpre_s, full, empty, red):
        s = self.s
        n, depth = s.n, CONSUME_DEPTH
        ncon = s.warps - s.producers
        ct = tid - 32 * s.producers
        cw = warp - s.producers
        nu = (s.units_row + 32 * ncon - 1) // (32 * ncon)  # 8-column units a consumer thread
        units = [cutlass.min(ct + 32 * ncon * u, s.units_row - 1) for u in range(nu)]
        live_u = [Int32(ct + 32 * ncon * u < s.units_row) for u in range(nu)]
        w_a = Int64(w32.toint())
        wv = [P.ldg_v4_f32(w_a + Int64(units[u]) * 32) + P.ldg_v4_f32(w_a + Int64(units[u]) * 32 + 16)
              for u in range(nu)]
        out_a = Int64(out.toint())
        for k in cutlass.range((mine + depth - 1) // depth, unroll=1):
            toks = []
            for d in cutlass.range_constexpr(depth):
                i = k * depth + d
                live = Int32(i < mine)
                sl = cutlass.min(i, mine - 1) % s.fslots
                toks.append((live, fid + i * nfin, sl, i % s.hrows))
                if live != 0:
                    P.mbar_wait_bounded(full + sl * 8, (i // s.fslots) & 1)
            coefs = [[P.lds_f32(hpre_s + hr_ * 16 + 4 * j) for j in range(n)] for _, _, _, hr_ in toks]
            words = [[[P.lds_v4(ring + sl * s.fslot + j * s.c * 2 + units[u] * 16) for j in range(n)]
                      for u in range(nu)] for _, _, sl, _ in toks]
            hs_ = self._mix_words(coefs, words)  # [token][unit] -> 8 values
            cute.arch.sync_warp()
            for d in cutlass.range_constexpr(depth):
                live, _, sl, _ = toks[d]
                if live != 0:
                    if lane == 0:
                        P.mbar_arrive(empty + sl * 8)
            rb = red + (k % 2) * depth * 32
            for d in cutlass.range_constexpr(depth):
                ssq = Float32(0.0)
                for u in cutlass.range_constexpr(nu):
                    part_sq = Float32(0.0)
                    for v in hs_[d][u]:
                        part_sq = P.fma(v, v, part_sq)
                    if cutlass.const_expr(s.units_row % (32 * ncon)):
                        part_sq = P.sel(live_u[u], part_sq, Float32(0.0))
                    ssq = ssq + part_sq
                for m_ in (16, 8, 4, 2, 1):
                    ssq = ssq + P.shfl_xor(ssq, m_)
                if lane == 0:
                    P.sts_f32(rb + (d * 8 + cw) * 4, ssq)
            P.bar_sync(2, 32 * ncon)
            for d in cutlass.range_constexpr(depth):
                live, t, _, _ = toks[d]
                ssq = P.lds_f32(rb + d * 32)
                for c in cutlass.range_constexpr(1, ncon):
                    ssq = ssq + P.lds_f32(rb + (d * 8 + c) * 4)
                r2 = P.rsqrt(ssq / Float32(s.c) + norm_eps)
                for u in cutlass.range_constexpr(nu):
                    h, w_ = hs_[d][u], wv[u]
                    o = [P.pack((h[2 * e] * r2) * w_[2 * e], (h[2 * e + 1] * r2) * w_[2 * e + 1]) for e in range(4)]
                    P.stg_v4(out_a + (Int64(t) * sit + Int64(8 * units[u])) * 2, o[0], o[1], o[2], o[3],
                             live_u[u] * live)


def compile_split(shape: SplitShape, ptx_dir: str = ""):
    """Compile the split variant ahead of time (no GPU needed, with ``CUTE_DSL_ARCH=sm_90a``). Called
    with the persistent variant's arguments, then the partials workspace and the blocks' ready
    counts (a ``counts`` buffer), then tokens, blocks, the stream sets, the finisher CTAs and the
    kept buffer's counts a half."""
    return compile_kernel(MhcSplit(shape), 11, ptx_dir, extra=(Float32, Int32))
