"""The MHC update + read at prefill sizes: persistent clusters with phi resident (CuTe DSL, Hopper
sm_90a; imports ``cutlass``, load through ``cluster_ops``).

Same arithmetic and exchanges as ``cute_cluster`` (read its docstring first), rearranged for many
blocks: clusters of 16 CTAs, one CTA an SM, as many as the GPU holds at once, each taking 16-token
blocks ``cid, cid + clusters, ...``. What changes (PERFORMANCE-history.md, eighth to tenth passes):

- **Instructions.** A warp owns 32-column groups of every stream: each x and y element is loaded,
  unpacked and mixed once, and the sums of squares of x' come out of two extra mma.sync a stream
  and k-step (``cute_ptx.mma_bf16_sq``).
- **L1 requests.** The kernel is bound by its L1 wavefronts (ncu: 90 % of the active cycles with
  16-column chunks). A group's rows are 64-byte segments, so its x and y copies and its x' stores
  (16 bytes a lane: k-step c of a group gives lane q columns ``8 q + 4 c .. + 3``) touch half as many
  lines a byte as 32-byte segments did.
- **phi from L2 every block.** Each CTA keeps its slice of phi's fragments in shared memory for
  the whole launch (144 KiB at n = 4, H = 4096), gathered at the start into the groups' lane order
  (``cluster_shape.resident_piece``).
- **Bytes in flight.** Each warp's x and y tiles of the next block go by cp.async into the warp's
  own slots as soon as it has read this block's (40 KiB an SM in flight; no CTA barrier a chunk).
  Loading them to registers instead cost 5,500 of an iteration's 14,000 cycles.
- **x' is not kept in shared memory.** The combination reads it back from L2 (``ld.global.cg``) an
  iteration after this CTA stored it, so the slots fit beside phi and one block's exchanges and
  combination still overlap the next block's stream pass.
- **Order of an iteration.** Warp 0 computes H_post, H_res and H_pre of this CTA's token of block
  ``it - 1`` (its partials were pushed an iteration ago) and sends H_pre to every CTA, while the
  other warps start streaming; stream block ``it``; normalize block ``it - 2`` (its sums were pushed
  an iteration ago); push block ``it``'s partials; combine block ``it - 1`` (x' loaded from L2 after
  the stream pass; its H_pre arrived while the CTAs streamed) and push its sums of squares. Warp 0
  computed the coefficients after its stream pass before, and every warp waited for it at the
  partials barrier: 341.0 against 309.8 µs at T = 8192 (PERFORMANCE.md, eleventh pass).

Exchange barriers: one per (exchange, parity of the block), each armed for the bytes it expects and
re-armed by its waiter; block ``b`` waits for phase ``(b // 2) % 2``. A push for block ``b + 2``
cannot reach a buffer before its receiver is done with block ``b``:

- partials: the sender pushes them after its normalization of block ``b``, which waits for every
  CTA's sums of block ``b``; the receiver's warp 0 sends its own after reading the partials;
- H_pre: the sender needs every CTA's partials of block ``b + 2``, which the receiver pushes an
  iteration after its combination of block ``b``;
- sums: the sender needs the receiver's H_pre of block ``b + 2``, sent an iteration after the
  receiver normalized block ``b``.

Summation orders (all fixed, so replays are bitwise): a warp's groups in order, each group's
streams in order, each stream's two k-steps in order; per-warp partials group by group (``wslots``
warps a group, the last group's first), then the slots in order; the 16 CTAs' partials and sums in
rank order.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64

from . import cute_ptx as P
from .cluster_shape import PersistentShape, resident_piece
from .cute_steps import ClusterSteps, compile_kernel


def _pick(vals: list, idx: Int32) -> Float32:
    """``vals[idx]`` for a runtime index over a short list of FP32 values."""
    v = vals[0]
    for k in range(1, len(vals)):
        v = P.sel(Int32(idx == k), vals[k], v)
    return v


class MhcPersistent(ClusterSteps):
    @cute.jit
    def __call__(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
                 phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
                 w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
                 tokens: Int32, blocks: Int32, clusters: Int32, sxt: Int32, sxn: Int32, syt: Int32, sot: Int32,
                 son: Int32, sit: Int32, eps: Float32, norm_eps: Float32, stream: cuda.CUstream):
        s = self.s
        self.kernel(x, y, hp, hr, xo, phf, alpha, bpre, bpost, bres, w32, out, hpo, hro, tokens, blocks,
                    sxt, sxn, syt, sot, son, sit, eps, norm_eps).launch(
            grid=[s.cl, clusters, 1], block=[s.threads, 1, 1], cluster=[s.cl, 1, 1], smem=s.smem, stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, y: cute.Pointer, hp: cute.Pointer, hr: cute.Pointer, xo: cute.Pointer,
               phf: cute.Pointer, alpha: cute.Pointer, bpre: cute.Pointer, bpost: cute.Pointer, bres: cute.Pointer,
               w32: cute.Pointer, out: cute.Pointer, hpo: cute.Pointer, hro: cute.Pointer,
               tokens: Int32, blocks: Int32,
               sxt: Int32, sxn: Int32, syt: Int32, sot: Int32, son: Int32, sit: Int32,
               eps: Float32, norm_eps: Float32):
        s = self.s
        n, bt, hs, kpad, nw = s.n, s.bt, s.hs, s.kpad, s.warps
        _, cid, _ = cute.arch.block_idx()
        _, ncl, _ = cute.arch.grid_dim()
        tid, rank, warp, lane, g, q, phi_s = self._start()
        slots = phi_s + s.phi_bytes  # per warp: x and y tiles of its chunks of the next block
        consts_s = slots + s.slot_bytes  # [6][lane]: what warp 0's coefficient step reads
        w_s = consts_s + s.consts_bytes  # FP32 norm weight (plus offset) of this CTA's columns
        mixed_s = w_s + s.w_bytes  # [(token, unit) pair][thread][2 x 16 bytes]: s between the passes
        coef = slots + s.slot_bytes + s.aux_bytes  # the block's H_post and H_res rows
        wp = coef + s.coef_bytes  # per-warp partials
        part0 = wp + s.wp_bytes  # [parity][CTA][K + 1]: the partials of this CTA's token
        hpre0 = part0 + 2 * s.part_bytes  # [parity][BT][n]
        hsq0 = hpre0 + 2 * s.hpre_bytes  # [parity][BT][CTA]
        mb = hsq0 + 2 * s.hsq_bytes  # barriers: partials, H_pre, sums; two parities each
        part_tx, hpre_tx, hsq_tx = s.cl * (kpad + 1) * 4, bt * n * 4, s.cl * bt * 4

        if tid == 0:
            for k in cutlass.range_constexpr(6):
                P.mbar_init(mb + 8 * k, 1)
            P.fence_mbar_init()
            for par in cutlass.range_constexpr(2):
                P.mbar_expect_tx(mb + 8 * par, part_tx)
                P.mbar_expect_tx(mb + 16 + 8 * par, hpre_tx)
                P.mbar_expect_tx(mb + 32 + 8 * par, hsq_tx)
        P.cluster_arrive_relaxed()

        col0 = rank * hs
        x_a, y_a, xo_a, phf_a = Int64(x.toint()), Int64(y.toint()), Int64(xo.toint()), Int64(phf.toint())
        hp_a, hr_a = Int64(hp.toint()), Int64(hr.toint())
        nloc = (blocks - cid + ncl - 1) // ncl
        slot = slots + warp * s.warp_slot
        fill = self._fill_plan(lane, warp, col0, x_a, y_a, sxt, sxn, syt)
        stash = mixed_s + tid * 16
        xol = xo_a + (Int64(g) * sot + Int64(col0 + 8 * q)) * 2
        # Where the combination reads x' back (from L2: this CTA stored it an iteration before).
        if cutlass.const_expr(s.update):
            src = (xo_a, sot, son)
        else:
            src = (x_a, sxt, sxn)

        # This CTA's slice of phi's fragments (chunks rank * nch ...), once, in the groups' lane
        # order (``resident_piece``); the first block's coefficients, x and y; the parameters warp
        # 0's coefficient step reads.
        self._gather_phi(tid, rank, phf_a, phi_s)
        w_a = Int64(w32.toint()) + Int64(col0) * 4
        for k in cutlass.range_constexpr((s.w_bytes // 16 + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            P.cp_async16_if(w_s + idx * 16, w_a + Int64(idx * 16), Int32(16), Int32(idx < s.w_bytes // 16))
        self._first_block(tid, cid, tokens, hp_a, hr_a, coef, fill, slot, warp, lane)
        if warp == 0:
            consts = self._coef_consts(lane, alpha, bpre, bpost, bres)
            for k in cutlass.range_constexpr(6):
                P.sts_f32(consts_s + (k * 32 + lane) * 4, consts[k])
        acc = cute.make_rmem_tensor((s.nt * 4,), Float32)
        sq = cute.make_rmem_tensor((8,), Float32)
        per_lane = (s.units + 31) // 32
        tpw = s.bt // nw
        xc = cute.make_rmem_tensor((tpw * per_lane * n * 4,), Int32)
        for it in cutlass.range(nloc + 2, unroll=1):
            par = it % 2
            blk = cid + it * ncl
            P.cp_async_wait_all()
            P.bar_sync(1, s.threads)
            if warp == 0:
                if it >= 1 and it <= nloc:
                    # ---- 1. the coefficients of this CTA's token of block it - 1, before warp 0's
                    # stream pass: H_pre then arrives while the CTAs stream, and the stream warps
                    # need not wait for this step at the partials barrier.
                    pv = (it - 1) % 2
                    self._token_coefficients(part0 + pv * s.part_bytes, hpre0 + pv * s.hpre_bytes, mb, pv, it - 1,
                                             (blk - ncl) * bt + rank, tokens, rank, lane,
                                             [P.lds_f32(consts_s + (k * 32 + lane) * 4) for k in range(6)], hpo,
                                             hro, eps)
            if it < nloc:
                # ---- 2. stream pass of block it; the slots refilled with block it + 1 -----------
                self._stream(slot, fill, blk, Int32(blk + ncl < blocks), ncl, tokens, phi_s, coef, xol, sot, son,
                             warp, g, q, acc, sq)
            if it >= 1 and it <= nloc:
                # ---- 3. block it - 1's x' (this warp's tokens of the combination) from L2, in
                # flight while block it - 2 is normalized and block it's partials are pushed.
                self._xp_load(xc, src, blk - ncl, tokens, col0, warp, lane)
            if it >= 2:
                # ---- 4b. block it - 2, normalized: its sums were pushed an iteration ago. Read
                # before this CTA pushes block it's partials (the sums' buffer is reused by
                # block it's, which need them).
                P.mbar_wait_rt(mb + 32 + 8 * par, ((it - 2) // 2) % 2)
                if tid == 0:
                    P.mbar_expect_tx(mb + 32 + 8 * par, hsq_tx)
                self._normalized(stash, hsq0 + par * s.hsq_bytes, w_s, out, blk - 2 * ncl, tokens, sit, col0,
                                 norm_eps, warp, lane)
            if it < nloc:
                self._partials(acc, sq, wp, part0 + par * s.part_bytes, mb + 8 * par, rank, tid, warp, g, q,
                               it == 0)
                if cutlass.const_expr(s.update):
                    # Every thread read this block's coefficients (two barriers ago).
                    self._coef_issue(tid, blk + ncl, tokens, hp_a, hr_a, coef)
            if it >= 1 and it <= nloc:
                # ---- 4a. block it - 1: s and its sums of squares, from the x' loaded at 3.
                P.mbar_wait_rt(mb + 16 + 8 * (1 - par), ((it - 1) // 2) % 2)
                if tid == 0:
                    P.mbar_expect_tx(mb + 16 + 8 * (1 - par), hpre_tx)
                self._norm_sums(stash, xc, hpre0 + (1 - par) * s.hpre_bytes, hsq0 + (1 - par) * s.hsq_bytes,
                                mb + 32 + 8 * (1 - par), rank, warp, lane)

    @cute.jit
    def _gather_phi(self, tid, rank, phf_a, phi_s):
        """cp.async of CTA ``rank``'s slice of phi's fragments into ``phi_s``, in the groups' lane order
        (``resident_piece``), committed."""
        s = self.s
        pieces = s.phi_bytes // 8
        for k in cutlass.range((pieces + s.threads - 1) // s.threads, unroll=1):
            idx = tid + k * s.threads
            piece = Int64(resident_piece(idx, s.n * 3 * s.nt))
            P.cp_async8_if(phi_s + idx * 8, phf_a + Int64(rank) * s.phi_bytes + piece * 8, Int32(idx < pieces))
        P.cp_async_commit()

    @cute.jit
    def _first_block(self, tid, blk, tokens, hp_a, hr_a, coef, fill, slot, warp, lane):
        """cp.async of block ``blk``'s coefficient rows and of the warp's x and y tiles into its slots,
        committed: what the first stream pass reads."""
        s = self.s
        if cutlass.const_expr(s.update):
            self._coef_issue(tid, blk, tokens, hp_a, hr_a, coef)
        for k in cutlass.range_constexpr(s.gpw):
            self._fill(fill, k, slot + k * s.group_slot, blk, tokens, Int32(warp + k * s.warps < s.groups), warp,
                       lane)
        P.cp_async_commit()

    @cute.jit
    def _token_coefficients(self, part, hpre, mb, par, it, t, tokens, rank, lane, consts, hpo, hro, eps):
        """Warp 0: token ``t``'s (this CTA's of the block) partials summed in rank order once they
        arrived, its coefficients, and its H_pre pushed to every CTA."""
        s = self.s
        kpad = s.kpad
        P.mbar_wait_rt(mb + 8 * par, (it // 2) % 2)
        src = part + cutlass.min(lane, kpad) * 4
        tot = P.lds_f32(src)
        for cr in cutlass.range_constexpr(1, s.cl):
            tot = tot + P.lds_f32(src + cr * (kpad + 1) * 4)
        if lane == 0:
            P.mbar_expect_tx(mb + 8 * par, s.cl * (kpad + 1) * 4)
        h_pre, _ = self._coefficients(tot, Int64(t), Int32(t < tokens), lane, None, None, None, None, hpo, hro, eps,
                                      consts)
        # Lane l sends H_pre[l % n] to CTA l // n (and so on a round later): two rounds of sends at
        # n = 4 instead of 16 from the n lanes that hold a value.
        sends = s.cl * s.n
        for k in cutlass.range_constexpr((sends + 31) // 32):
            idx = lane + 32 * k
            v = P.shfl_idx(h_pre, idx % s.n)
            if idx < sends:
                self._send(hpre + (rank * s.n + idx % s.n) * 4, idx // s.n, v, mb + 16 + 8 * par)

    @cute.jit
    def _coef_issue(self, tid, blk, tokens, hp_a, hr_a, coef):
        """cp.async of block ``blk``'s H_post and H_res rows (zeros past the last token), one group:
        at n = 4 five 16-byte copies a token (``cluster_ops.launch`` hands over 16-byte aligned
        rows), otherwise 4-byte copies."""
        s = self.s
        n, nc = s.n, s.ncoef
        vec = n == 4
        per = nc // 4 if vec else nc  # copies a token
        items = s.bt * per
        for k in cutlass.range_constexpr((items + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            t = idx // per
            e = idx - t * per
            row = blk * s.bt + t
            live = Int32(row < tokens) * Int32(idx < items)
            r64 = Int64(row * live)
            post = Int32(e < (1 if vec else n))
            if cutlass.const_expr(vec):
                src = (hp_a + r64 * 16) * Int64(post) + (hr_a + r64 * 64 + Int64(e - 1) * 16) * Int64(1 - post)
                P.cp_async16_if(coef + t * s.coef_row + e * 16, src, live * 16, Int32(idx < items))
            else:
                src = (hp_a + (r64 * n + Int64(e)) * 4) * Int64(post) + \
                    (hr_a + (r64 * (n * n) + Int64(e - n)) * 4) * Int64(1 - post)
                P.cp_async4_if(coef + t * s.coef_row + e * 4, src, live * 4, Int32(idx < items))
        P.cp_async_commit()

    @cute.jit
    def _fill_plan(self, lane, warp, col0, x_a, y_a, sxt, sxn, syt) -> tuple:
        """This lane's cp.async sources, worked out once: (x at block 0 and the CTA's group 0, y
        likewise, a block's step of each, a stream's step, 8 rows' step of x and of y). A group's slot
        holds its tiles (the n streams, then y) of 16 rows of 64 bytes; lane l copies 16-byte piece
        l % 4 of rows l // 4 and l // 4 + 8 of every tile."""
        s = self.s
        col = Int64(col0 + 8 * (lane % 4))
        r = Int64(lane // 4)
        return (x_a + (r * sxt + col) * 2, y_a + (r * syt + col) * 2, Int64(s.bt) * sxt * 2, Int64(s.bt) * syt * 2,
                Int64(sxn) * 2, Int64(8) * sxt * 2, Int64(8) * syt * 2)

    @cute.jit
    def _fill(self, plan, k: int, dst, blk, tokens, ok, warp, lane):
        """cp.async of the warp's group k of block ``blk`` into its slot at ``dst`` (``_fill_plan``),
        where ``ok``; rows past the last token arrive as zeros. No commit."""
        s = self.s
        x0, y0, xstep, ystep, nstep, x8, y8 = plan
        r = lane // 4
        # Group warp + k W (callers pass ``ok`` false past the CTA's last group).
        gcol = Int64(64 * cutlass.min(warp + k * s.warps, s.groups - 1))
        for h in cutlass.range_constexpr(2):
            live = Int32(blk * s.bt + r + 8 * h < tokens)
            at = dst + (r + 8 * h) * 64 + (lane % 4) * 16
            xs = x0 + (Int64(blk) * xstep + gcol + x8 * h) * Int64(live)
            for a in cutlass.range_constexpr(s.n):
                self._load16(at + a * 16 * 64, xs + Int64(a) * nstep, live * 16, ok)
            if cutlass.const_expr(s.update):
                ys = y0 + (Int64(blk) * ystep + gcol + y8 * h) * Int64(live)
                self._load16(at + s.n * 16 * 64, ys, live * 16, ok)

    @cute.jit
    def _load16(self, dst, src, nbytes, ok):
        """One 16-byte cp.async of x or y."""
        P.cp_async16_if(dst, src, nbytes, ok)

    @cute.jit
    def _stream(self, slot, fill, blk, ok_next, ncl, tokens, phi_s, coef, xol, sot, son, warp, g, q, acc, sq):
        """The warp's groups of block ``blk`` from its slots (each refilled with block
        ``blk + ncl`` once read, where ``ok_next``): x' of every stream (mixed, rounded once) to HBM,
        and its projection on phi and sums of squares into ``acc`` and ``sq``."""
        s = self.s
        n, bt = s.n, s.bt
        row0 = blk * bt
        r0 = g
        r1 = g + 8
        lv = (Int32(row0 + r0 < tokens), Int32(row0 + r1 < tokens))
        acc.fill(0.0)
        sq.fill(0.0)
        tiles = n + 1 if s.update else n
        for k in cutlass.range_constexpr(s.gpw):
            grp = warp + k * s.warps
            if grp < s.groups:
                base = slot + k * s.group_slot
                # Columns 8 q .. 8 q + 7 of rows g, g + 8 of each stream and y, unpacked once:
                # [ri][j] -> 8 values; then the slot is free for the next block.
                words = [[P.lds_v4(base + (j * 16 + r) * 64 + q * 16) for j in range(tiles)] for r in (r0, r1)]
                vals = [[P.unpack(w[0]) + P.unpack(w[1]) + P.unpack(w[2]) + P.unpack(w[3]) for w in per_r]
                        for per_r in words]
                cute.arch.sync_warp()
                self._fill(fill, k, base, blk + ncl, tokens, ok_next, warp, g * 4 + q)
                for i in cutlass.range_constexpr(n):
                    cfs = [self._coef_row(coef + r * s.coef_row, i) for r in (r0, r1)] if s.update else []
                    st = [[], []]  # [ri]: stream i's words of the row, both k-steps
                    for c in cutlass.range_constexpr(2):
                        # Stream i's phi fragments, loaded before the mix whose FMAs cover their latency.
                        fr = self._phi_frags(phi_s, 2 * grp + c, i, g * 4 + q)
                        wds = []  # [ri] -> 2 words of stream i: columns 8 q + 4 c .. + 3
                        for ri in cutlass.range_constexpr(2):
                            if cutlass.const_expr(s.update):
                                cf = cfs[ri]
                                mixed = []
                                for e in cutlass.range_constexpr(4 * c, 4 * c + 4):
                                    v = cf[0] * vals[ri][n][e]
                                    for j in cutlass.range_constexpr(n):
                                        v = P.fma(cf[1 + j], vals[ri][j][e], v)
                                    mixed.append(v)
                                wds.append((P.pack(mixed[0], mixed[1]), P.pack(mixed[2], mixed[3])))
                            else:
                                wds.append((words[ri][i][2 * c], words[ri][i][2 * c + 1]))
                            st[ri] += list(wds[ri])
                        a = (wds[0][0], wds[1][0], wds[0][1], wds[1][1])
                        for p in cutlass.range_constexpr(3):
                            for nt in cutlass.range_constexpr(s.nt):
                                b = fr[p * s.nt + nt]
                                d = P.mma_bf16(a, (b[0], b[1]), [acc[nt * 4 + e] for e in range(4)])
                                for e in cutlass.range_constexpr(4):
                                    acc[nt * 4 + e] = d[e]
                        d = P.mma_bf16_sq(a, [sq[e] for e in range(8)])
                        for e in cutlass.range_constexpr(8):
                            sq[e] = d[e]
                    if cutlass.const_expr(s.update):
                        # 16 bytes of a row a store: 8 rows of 64 bytes an instruction, where 16-column
                        # chunks stored 8 rows of 32 (PERFORMANCE-history.md, tenth pass).
                        for ri in cutlass.range_constexpr(2):
                            at = xol + (Int64(row0 + 8 * ri) * sot + Int64(i) * son) * 2 + Int64(grp * 64)
                            P.stg_v4(at, *st[ri], lv[ri])
        P.cp_async_commit()

    @cute.jit
    def _xp_load(self, xc, src, blk, tokens, col0, warp, lane):
        """x' of block ``blk`` at this warp's tokens of the combination (warp w: tokens w, w + W,
        ...) and this lane's units (8 columns each, all n streams), from global memory (L2: this CTA
        stored it an iteration ago), into ``xc``."""
        s = self.s
        base, st, sn = src
        per_lane = (s.units + 31) // 32
        ragged = per_lane * 32 != s.units
        for e in cutlass.range_constexpr(s.bt // s.warps):
            row = blk * s.bt + warp + e * s.warps
            live = Int32(row < tokens)
            for f in cutlass.range_constexpr(per_lane):
                u = lane + 32 * f
                ok = live * Int32(u < s.units) if ragged else live
                for j in cutlass.range_constexpr(s.n):
                    w = P.ldg_v4_cg(base + (Int64(row) * st + Int64(j) * sn + Int64(col0 + 8 * u)) * 2, ok)
                    for v in cutlass.range_constexpr(4):
                        xc[((e * per_lane + f) * s.n + j) * 4 + v] = w[v]

    @cute.jit
    def _coef_row(self, row_a, i: int) -> list:
        """(H_post[i], H_res[i, 0..n-1]) of one token's coefficient row in shared memory."""
        n = self.s.n
        if cutlass.const_expr(n == 4):
            return [P.lds_f32(row_a + 4 * i)] + P.lds_v4_f32(row_a + 4 * (n + i * n))
        return [P.lds_f32(row_a + 4 * i)] + [P.lds_f32(row_a + 4 * (n + i * n + j)) for j in range(n)]

    @cute.jit
    def _phi_frags(self, phi_s, ch, i: int, lane) -> list:
        """Stream i's phi fragments of chunk ``ch`` (``phi_fragments``: part, n-tile; lane ``lane``) in
        the order of use, the smallest part first: two words each."""
        s = self.s
        frag = phi_s + ((ch * s.n + i) * 3) * s.nt * 256 + lane * 8
        return [tuple(P.lds_v2(frag + ((2 - p) * s.nt + nt) * 256)) for p in range(3) for nt in range(s.nt)]

    @cute.jit
    def _partials(self, acc, sq, wp, part, mbar, rank, tid, warp, g, q, first, sink=None):
        """The warps' partials summed (group by group of ``wslots`` warps, the last group's stored, each
        earlier group's added in place in turn, then the slots in order) and each token's row pushed
        to its owner, CTA t (one token a CTA); or, with ``sink`` (a global address: the split
        variant), stored there as ``[token][K + 1]``."""
        s = self.s
        kpad = s.kpad
        ws = s.wslots
        groups = s.warps // ws
        row_bytes = (kpad + 1) * 4
        slot = wp + (warp % ws) * 16 * row_bytes
        grp = warp // ws
        # Token g's sum of squares sits in lane (g, g // 2) of the first n-tile, token g + 8's in the
        # same lane of the second.
        diag = Int32(q == g // 2)
        d0 = P.sel(Int32(g % 2 == 0), sq[0], sq[1])
        d1 = P.sel(Int32(g % 2 == 0), sq[6], sq[7])
        vals = []  # (offset, value) of this lane's cells
        for nt in cutlass.range_constexpr(s.nt):
            col = 8 * nt + 2 * q
            vals += [(g * row_bytes + col * 4, acc[nt * 4]), (g * row_bytes + (col + 1) * 4, acc[nt * 4 + 1]),
                     ((g + 8) * row_bytes + col * 4, acc[nt * 4 + 2]),
                     ((g + 8) * row_bytes + (col + 1) * 4, acc[nt * 4 + 3])]
        sums = [(g * row_bytes + kpad * 4, d0), ((g + 8) * row_bytes + kpad * 4, d1)]
        if grp == groups - 1:
            for off, v in vals:
                P.sts_f32(slot + off, v)
            if diag != 0:
                for off, v in sums:
                    P.sts_f32(slot + off, v)
        for gi in cutlass.range_constexpr(groups - 2, -1, -1):
            P.bar_sync(1, s.threads)
            if grp == gi:
                for off, v in vals:
                    P.sts_f32(slot + off, v + P.lds_f32(slot + off))
                if diag != 0:
                    for off, v in sums:
                        P.sts_f32(slot + off, v + P.lds_f32(slot + off))
        P.bar_sync(1, s.threads)
        if cutlass.const_expr(sink is None):
            if first:
                P.cluster_wait()  # every CTA's barriers initialized (arrived at the start)
        cells = s.bt * (kpad + 1)
        for k in cutlass.range_constexpr((cells + s.threads - 1) // s.threads):
            idx = tid + k * s.threads
            if idx < cells:
                t = idx // (kpad + 1)
                col = idx - t * (kpad + 1)
                src = wp + t * row_bytes + col * 4
                tot = P.lds_f32(src)
                for kk in cutlass.range_constexpr(1, ws):
                    tot = tot + P.lds_f32(src + kk * 16 * row_bytes)
                if cutlass.const_expr(sink is None):
                    self._send(part + (rank * (kpad + 1) + col) * 4, t, tot, mbar)
                else:
                    P.stg_f32(sink + Int64(idx) * 4, tot, Int32(1))

    @cute.jit
    def _norm_sums(self, stash, xc, hpre, hsq, mbar, rank, warp, lane):
        """First combination pass of a block: s = sum_j H_pre[j] x'_j from the x' words in ``xc``
        (``_xp_load``) to this thread's ``stash`` in shared memory (for the second pass), and each
        token's sum of squares of s over this CTA's columns, pushed to every CTA (row t, column
        rank)."""
        s = self.s
        n = s.n
        per_lane = (s.units + 31) // 32
        tpw = s.bt // s.warps
        ts = [warp + e * s.warps for e in range(tpw)]
        coefs = [[P.lds_f32(hpre + (t * n + j) * 4) for j in range(n)] for t in ts]
        words = [[[[xc[((e * per_lane + f) * n + j) * 4 + v] for v in range(4)] for j in range(n)]
                  for f in range(per_lane)] for e in range(tpw)]
        hs_ = self._mix_words(coefs, words)
        for e in cutlass.range_constexpr(tpw):
            for f in cutlass.range_constexpr(per_lane):
                for h in cutlass.range_constexpr(2):
                    P.sts_v4_f32(stash + ((e * per_lane + f) * 2 + h) * s.threads * 16, *hs_[e][f][4 * h:4 * h + 4])
        sqs = self._square_sums(hs_, lane, per_lane)
        sends = tpw * s.cl
        for k in cutlass.range_constexpr((sends + 31) // 32):
            idx = lane + 32 * k
            if idx < sends:
                e = idx // s.cl
                self._send(hsq + ((warp + e * s.warps) * s.cl + rank) * 4, idx - e * s.cl, _pick(sqs, e), mbar)

    @cute.jit
    def _normalized(self, stash, hsq, w_s, out, blk, tokens, sit, col0, norm_eps, warp, lane):
        """Second combination pass of block ``blk``: s (``stash``, from the first) over the root mean
        square of the cluster's sums (in rank order), times the weight (``w_s``), rounded once, to
        ``out``."""
        s = self.s
        per_lane = (s.units + 31) // 32
        ragged = per_lane * 32 != s.units
        tpw = s.bt // s.warps
        ts = [warp + e * s.warps for e in range(tpw)]
        wvs = []
        for f in cutlass.range_constexpr(per_lane):
            u_s = w_s + cutlass.min(lane + 32 * f, s.units - 1) * 32
            wvs.append(P.lds_v4_f32(u_s) + P.lds_v4_f32(u_s + 16))
        tots = []
        for t in ts:
            parts = []
            for v in cutlass.range_constexpr(s.cl // 4):
                parts += P.lds_v4_f32(hsq + (t * s.cl + 4 * v) * 4)
            tot = parts[0]
            for cr in cutlass.range_constexpr(1, s.cl):
                tot = tot + parts[cr]
            tots.append(tot)
        for e in cutlass.range_constexpr(tpw):
            row = blk * s.bt + ts[e]
            live = Int32(row < tokens)
            r2 = P.rsqrt(tots[e] / Float32(s.c) + norm_eps)
            for f in cutlass.range_constexpr(per_lane):
                u = lane + 32 * f
                h = (P.lds_v4_f32(stash + ((e * per_lane + f) * 2) * s.threads * 16)
                     + P.lds_v4_f32(stash + ((e * per_lane + f) * 2 + 1) * s.threads * 16))
                wv = wvs[f]
                o = [P.pack((h[2 * k] * r2) * wv[2 * k], (h[2 * k + 1] * r2) * wv[2 * k + 1]) for k in range(4)]
                dst = Int64(out.toint()) + (Int64(row) * sit + Int64(col0 + 8 * u)) * 2
                ok = live * Int32(u < s.units) if ragged else live
                P.stg_v4(dst, o[0], o[1], o[2], o[3], ok)


def compile_persistent(shape: PersistentShape, ptx_dir: str = ""):
    """Compile one variant ahead of time (no GPU needed, with ``CUTE_DSL_ARCH=sm_90a``). Called as
    ``compile_cluster``'s result, with the number of clusters after ``blocks``."""
    return compile_kernel(MhcPersistent(shape), 9, ptx_dir)
