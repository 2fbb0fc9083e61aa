"""The MHC update + read at prefill sizes with split roles (CuTe DSL, Hopper sm_90a; imports
``cutlass``, load through ``cluster_ops``).

The persistent variant (``cute_persistent``) runs everything on one CTA an SM: its stream pass, its
share of the exchanges and the combination. Its floor is about 60 % of the byte roofline
(PERFORMANCE.md, eleventh pass): the combination, the exchanges' barriers and waits cannot overlap
the stream pass on the same SM, whose L1 the stream pass keeps busy. Here the roles sit on
different SMs of one launch (no clusters):

- **Stream CTAs** (``sets`` sets of 16; CTA ``16 g + r`` owns columns ``[r C/16, (r + 1) C/16)`` of
  the blocks ``g, g + sets, ...``). Each runs the persistent variant's stream pass unchanged (phi's
  slice resident, x and y a block ahead by cp.async, x' stored). It then writes the block's summed
  partials to global memory (``[block][CTA][token][K + 1]``) and counts the block ready (a release
  add). It never waits for another CTA, so it never waits for a finisher.
- **Finisher CTAs** (the SMs the sets leave: 20 on an H200). Warp ``w`` takes tokens ``w, w + W, ...``
  (W finisher warps in all). For each, once its block's count reaches 16 (an acquire read), it:
  - sums the 16 CTAs' partials in rank order, the persistent variant's order, so H_post and H_res's
    logits are its bits;
  - computes the coefficients;
  - combines the token's x' (from L2: stored a few blocks ago) into s and its sum of squares;
  - normalizes s from a per-warp stash in shared memory.

  The input's bits may differ from the other kernels' by the order of that sum, within the
  tolerance table.

A finisher spins only on blocks whose stream CTAs never wait, so the launch completes whenever its
stream CTAs get SMs. The grid is sized so that every CTA is resident on an idle GPU (one CTA an SM:
shared memory), and CTAs are dispatched in index order, stream CTAs first. A count that has not come
20 s into the wait traps (``cute_ptx.spin_until``): a bug then fails the launch instead of hanging it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import cute_ptx as P
from .cluster_shape import SplitShape
from .cute_persistent import MhcPersistent
from .cute_steps import compile_kernel

# 8-column units a finisher lane loads before it combines them (4 words of each stream a unit):
# two L2 round trips a token at H = 4096, 128 registers of loads in flight.
FINISH_BATCH = 8


class MhcSplit(MhcPersistent):
    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
                 phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
                 w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer, prof: cute.Pointer,
                 part: cute.Pointer, cnt: cute.Pointer, tokens: Int32, blocks: Int32, sets: Int32, finishers: Int32,
                 sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32, eps: Float32,
                 norm_eps: Float32, stream: cuda.CUstream):
        s = self.s
        self.kernel(x, y, hp, hr, xo, phf, alpha, bpre, bpost, bres, w32, out, hpo, hro, part, cnt, tokens, blocks,
                    sets, sxt, sxn, syt, sot, son, sit, eps, norm_eps).launch(
            grid=[sets * 16 + finishers, 1, 1], block=[s.threads, 1, 1], smem=s.smem, stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
               phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
               w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer, part: cute.Pointer,
               cnt: cute.Pointer, tokens: Int32, blocks: Int32, sets: Int32,
               sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32,
               eps: Float32, norm_eps: Float32):
        s = self.s
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tid, _, warp, lane, g, q, base = self._start()
        part_a, cnt_a = Int64(part.toint()), Int64(cnt.toint())
        if bid < sets * 16:
            self._streamer(bid, sets, x, y, hp, hr, xo, phf, part_a, cnt_a, tokens, blocks, sxt, sxn, syt, sot, son,
                           tid, warp, lane, g, q, base)
        else:
            if cutlass.const_expr(s.update):
                src = (Int64(xo.toint()), sot, son)
            else:
                src = (Int64(x.toint()), sxt, sxn)
            self._finisher(bid - sets * 16, nblk - sets * 16, src, alpha, bpre, bpost, bres, w32, out, hpo, hro,
                           part_a, cnt_a, tokens, sit, eps, norm_eps, tid, warp, lane, base)

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
        self._first_block(tid, first, tokens, hp_a, hr_a, coef, fill, slot, warp, lane)
        acc = cute.make_rmem_tensor((s.nt * 4,), Float32)
        sq = cute.make_rmem_tensor((8,), Float32)
        row = s.bt * (kpad + 1)  # a CTA's partials of one block
        for it in cutlass.range(nloc, unroll=1):
            blk = first + it * sets
            P.cp_async_wait_all()
            P.bar_sync(1, s.threads)
            self._stream(slot, fill, blk, Int32(blk + sets < blocks), sets, tokens, phi_s, coef, xol, sot, son,
                         warp, g, q, acc, sq)
            self._partials(acc, sq, wp, Int32(0), Int32(0), rank, tid, warp, g, q, False,
                           sink=part_a + (Int64(blk) * 16 + Int64(rank)) * row * 4)
            # Every thread's x' and partials before the count: its own fence, then the barrier that
            # the count's release follows.
            P.fence_gpu()
            P.bar_sync(1, s.threads)
            if tid == 0:
                P.red_release_add(cnt_a + Int64(blk) * 4, Int32(1))
            if cutlass.const_expr(s.update):
                self._coef_issue(tid, blk + sets, tokens, hp_a, hr_a, coef)
        P.cp_async_wait_all()  # the last iteration's copies (zeros past the last block) land before exit

    @cute.jit
    def _finisher(self, fid, nfin, src, alpha, bpre, bpost, bres, w32, out, hpo, hro, part_a, cnt_a, tokens, sit,
                  eps, norm_eps, tid, warp, lane, w_s):
        """Finisher CTA ``fid`` of ``nfin``: its warps' tokens, each once its block is ready."""
        s = self.s
        n, kpad = s.n, s.kpad
        consts_s = w_s + s.wfull_bytes
        stash = consts_s + s.consts_bytes + warp * (s.c * 4)
        per = s.units_row // 32  # units a lane
        batch = math.gcd(per, FINISH_BATCH)  # batches that tile a lane's units (12 at H = 3072: 3 of 4)
        w_a = Int64(w32.toint())
        chunks = s.wfull_bytes // 16
        for k in cutlass.range_constexpr((chunks + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            P.cp_async16_if(w_s + idx * 16, w_a + Int64(idx * 16), Int32(16), Int32(idx < chunks))
        P.cp_async_commit()
        if warp == 0:
            cs = self._coef_consts(lane, alpha, bpre, bpost, bres)
            for k in cutlass.range_constexpr(6):
                P.sts_f32(consts_s + (k * 32 + lane) * 4, cs[k])
        P.cp_async_wait_all()
        P.bar_sync(1, s.threads)
        consts = [P.lds_f32(consts_s + (k * 32 + lane) * 4) for k in range(6)]
        base, st, sn = src
        gw = fid * s.warps + warp
        stride = nfin * s.warps
        mine = (tokens - gw + stride - 1) // stride
        out_a = Int64(out.toint())
        col = cutlass.min(lane, kpad)
        for i in cutlass.range(mine, unroll=1):
            t = gw + i * stride
            blk = t // s.bt
            P.spin_until(cnt_a + Int64(blk) * 4, Int32(16))
            row = base + Int64(t) * st * 2
            # The first batch of x' in flight while the coefficients are computed.
            words = self._xp_batch(row, sn, lane, 0, batch)
            # The 16 CTAs' partials of token t, summed in rank order (the persistent variant's).
            at = part_a + (Int64(blk) * 16 * s.bt + Int64(t - blk * s.bt)) * (kpad + 1) * 4 + Int64(col) * 4
            tot = P.ldg_f32_cg(at, Int32(1))
            for cr in cutlass.range_constexpr(1, 16):
                tot = tot + P.ldg_f32_cg(at + cr * s.bt * (kpad + 1) * 4, Int32(1))
            h_pre, _ = self._coefficients(tot, Int64(t), Int32(1), lane, None, None, None, None, hpo, hro, eps,
                                          consts)
            coefs = [[P.shfl_idx(h_pre, Int32(j)) for j in range(n)]]
            ssq = Float32(0.0)
            for b in cutlass.range_constexpr(per // batch):
                if cutlass.const_expr(b > 0):
                    words = self._xp_batch(row, sn, lane, b, batch)
                hs_ = self._mix_words(coefs, [words])[0]
                for k in cutlass.range_constexpr(batch):
                    for h in cutlass.range_constexpr(2):
                        P.sts_v4_f32(stash + (((b * batch + k) * 2 + h) * 32 + lane) * 16, *hs_[k][4 * h:4 * h + 4])
                    part_sq = Float32(0.0)
                    for v in hs_[k]:
                        part_sq = P.fma(v, v, part_sq)
                    ssq = ssq + part_sq
            for m_ in (16, 8, 4, 2, 1):
                ssq = ssq + P.shfl_xor(ssq, m_)
            r2 = P.rsqrt(ssq / Float32(s.c) + norm_eps)
            for u in cutlass.range_constexpr(per):
                h = (P.lds_v4_f32(stash + ((u * 2) * 32 + lane) * 16)
                     + P.lds_v4_f32(stash + ((u * 2 + 1) * 32 + lane) * 16))
                unit = lane + 32 * u
                wv = P.lds_v4_f32(w_s + unit * 32) + P.lds_v4_f32(w_s + unit * 32 + 16)
                o = [P.pack((h[2 * k] * r2) * wv[2 * k], (h[2 * k + 1] * r2) * wv[2 * k + 1]) for k in range(4)]
                P.stg_v4(out_a + (Int64(t) * sit + Int64(8 * unit)) * 2, o[0], o[1], o[2], o[3], Int32(1))


    @cute.jit
    def _xp_batch(self, row, sn, lane, b: int, batch: int) -> list:
        """x' of one token (``row``: its address) at this lane's units ``b * batch ..`` of the batch:
        ``[unit][stream] -> 4 words`` (8 bf16 columns), from L2."""
        return [[P.ldg_v4_cg(row + (Int64(j) * sn + Int64(8 * (lane + 32 * (b * batch + k)))) * 2, Int32(1))
                 for j in range(self.s.n)] for k in range(batch)]


def compile_split(shape: SplitShape, ptx_dir: str = ""):
    """Compile the split variant ahead of time (no GPU needed, with ``CUTE_DSL_ARCH=sm_90a``). Called
    with the persistent variant's arguments, then the partials workspace and the blocks' ready
    counts (zeroed), then tokens, blocks, the stream sets and the finisher CTAs."""
    return compile_kernel(MhcSplit(shape), 10, ptx_dir, extra=(Float32, Int32))
