"""Compile-time shape of the MHC cluster kernel (``cute_cluster``): sizes, shared-memory plan and
why a shape does not fit. No ``cutlass`` import, so eligibility is decided anywhere."""

from __future__ import annotations

# Shared memory an SM gives its CTAs (228 KiB on Hopper, 1 KiB of it reserved per CTA), and the
# most one CTA may take.
SM_SMEM = 228 * 1024
SMEM_LIMIT = 227 * 1024
# Chunks a CTA has in flight (one is being computed): what it streams at is about the bytes in
# flight over the loaded latency of HBM (about 3 µs at full load on an H200: with 3 chunks of
# 10 KiB in flight a CTA streamed at 18 GB/s, against the 36 it needs).
MAX_STAGES = 10


class _Sized:
    """The sizes ``_sizes`` sets on both kernels' shapes (declared only: no class attributes, so a
    shape's ``vars``, its kernel's key, holds what its ``__init__`` set)."""

    warps: int
    threads: int
    hs: int
    nch: int
    k: int
    nt: int
    kpad: int
    tpc: int
    units: int
    phi_chunk: int
    xr_bytes: int
    hpre_bytes: int
    hsq_bytes: int


def _sizes(shape: _Sized, n: int, hidden: int, cluster: int, block_tokens: int, warps: int) -> None:
    """The sizes both kernels' shapes derive alike: columns and 16-column chunks a CTA, the
    coefficient count K and its 8-wide n-tiles, tokens a CTA owns, 16-byte units a row, phi's
    fragment bytes a chunk, x' bytes of a block, H_pre and norm-sum exchange bytes."""
    shape.warps, shape.threads = warps, 32 * warps
    shape.hs = hidden // cluster
    shape.nch = shape.hs // 16
    shape.k = n * n + 2 * n
    shape.nt = (shape.k + 7) // 8
    shape.kpad = 8 * shape.nt
    shape.tpc = block_tokens // cluster
    shape.units = shape.hs // 8
    shape.phi_chunk = n * 3 * shape.nt * 256
    shape.xr_bytes = n * block_tokens * shape.hs * 2
    shape.hpre_bytes = block_tokens * n * 4
    shape.hsq_bytes = cluster * block_tokens * 4


def resident_piece(idx, per: int):
    """The 8-byte piece of ``cluster_ops.phi_fragments``' layout (``per`` 256-byte blocks of 32 lanes
    a 16-column chunk) that piece ``idx`` of the persistent variant's resident copy holds. Its chunk
    ``2 u + c`` is k-step c of 32-column group u, where lane (g, q) holds columns ``8 q + 4 c .. + 3``
    of the group, so that after both steps a lane has 8 adjacent columns of a row for one 16-byte
    store; ``phi_fragments`` has those in chunk ``2 u + q // 2``, lane ``(g, 2 (q % 2) + c)``. Plain
    arithmetic: the kernel calls it on registers, the tests on tensors."""
    blk = idx // 32
    ln = idx - blk * 32
    ch = blk // per
    q = ln % 4
    return (blk + (2 * (ch // 2) + q // 2 - ch) * per) * 32 + (ln - q) + 2 * (q % 2) + ch % 2


def _streams_problem(n: int) -> str:
    # n = 1 would compile, but neither kernel has run it on a GPU.
    return f"n = {n} streams (2 to 4)"


def _frozen_key(shape: _Sized) -> tuple:
    """Every attribute of a finished shape (all compile-time: sizes, plan, settings), the key of its
    compiled kernel: no two variants share one (a key of chosen fields once missed the persistent
    variant's settings). Computed once, as the calls look it up each time."""
    return (type(shape).__name__,) + tuple(sorted(vars(shape).items()))


class ClusterShape(_Sized):
    """Compile-time shape of one variant: n streams, hidden size C, ``cluster`` CTAs a block of
    ``block_tokens``, ``warps`` a CTA, shared memory sized for ``ctas`` CTAs an SM (two let one CTA's
    cluster exchanges overlap another's stream pass), ``stages`` chunks in flight (0: as many as fit,
    at most MAX_STAGES); phi's fragments travel in the stages (cp.async, one copy a CTA; from L2 to
    each warp's registers was slower: 552.1 against 444.5 µs at T = 8192, removed); ``sinkhorn``: H_res's Sinkhorn in the kernel, or (off) its logits
    stored for a Sinkhorn after it; ``push``: the three exchanges are stores into the receiving
    CTAs' shared memory that complete their mbarriers (``st.async``), one cluster barrier at the
    start, rather than three cluster barriers around stores and loads."""

    persistent = False  # which kernel: cute_cluster (False) or cute_persistent
    split = False
    sinkhorn_lanes = False  # the split variant's Sinkhorn in its producers (SplitShape)

    def __init__(self, n: int, hidden: int, cluster: int, block_tokens: int, update: bool, iters: int,
                 stages: int = 0, warps: int = 8, ctas: int = 1, sinkhorn: bool = True, push: bool = True) -> None:
        self.n, self.c, self.cl, self.bt, self.update, self.iters = n, hidden, cluster, block_tokens, update, iters
        self.ctas = ctas
        self.sinkhorn, self.push = sinkhorn, push
        _sizes(self, n, hidden, cluster, block_tokens, warps)
        self.mt = block_tokens // 16
        self.kh = max(1, warps // self.mt)
        self.sx = n * block_tokens * 32
        self.sy = block_tokens * 32 if update else 0
        self.stage_bytes = self.sx + self.sy + self.phi_chunk
        self.part_bytes = block_tokens * (self.kpad + 1) * 4
        self.wp_bytes = warps * 16 * (self.kpad + 1) * 4
        fixed = self.xr_bytes + self.part_bytes + self.hpre_bytes + self.hsq_bytes + 32 + 1024
        self.budget = budget = min(SMEM_LIMIT, SM_SMEM // ctas - 1024)
        self.stages = stages or max(2, min(MAX_STAGES, (budget - fixed) // self.stage_bytes))
        self.smem = fixed + self.stages * self.stage_bytes
        self.problem = self._problem()
        self.key = _frozen_key(self)

    def _problem(self) -> str:
        if not 2 <= self.n <= 4:
            return _streams_problem(self.n)
        if self.c % (self.cl * 16):
            return f"hidden size {self.c} is not a multiple of {self.cl * 16} (cluster of {self.cl} x 16 columns)"
        if self.hs % 64 or self.nch % 2:
            return f"{self.hs} columns a CTA (a multiple of 64: the resident x' is swizzled in 8-unit groups)"
        if (self.bt % 16 or self.warps % self.mt or self.bt % self.cl or not 1 <= self.tpc <= self.warps
                or self.bt % self.warps):
            return f"block of {self.bt} tokens does not fit a cluster of {self.cl} CTAs of {self.warps} warps"
        budget = self.budget
        if self.smem > budget or self.stages * self.stage_bytes < self.wp_bytes:
            return f"{self.smem} bytes of shared memory a CTA (at most {budget} for {self.ctas} an SM)"
        return ""


class PersistentShape(_Sized):
    """Compile-time shape of the persistent variant (``cute_persistent``): clusters of 16 CTAs, one
    CTA an SM, that stay resident and take blocks of 16 tokens in turn. Each CTA keeps its slice of
    phi's fragments in shared memory for the whole launch (``phi_bytes``: 144 KiB at n = 4,
    H = 4096). ``warps`` warps each own ``gpw`` groups of 32 adjacent columns of every stream (warp w:
    groups w, w + warps, ...), whose x and y tiles of the next block go by cp.async into the warp's
    slots (``group_slot`` bytes a group) as soon as it has read this block's. 64-byte row segments
    rather than 32: every global access a warp makes then touches half as many lines a byte, and
    the kernel is bound by its L1 wavefronts (PERFORMANCE-history.md, tenth pass). x' is not kept: the
    combination reads it back from L2 an iteration later, so one block's exchanges and
    combination overlap the next block's stream pass without x' buffers in shared memory. Warp 0
    also computes the CTA's token's coefficients of each block, at the start of the next iteration
    (before its own stream pass). H_res leaves as its logits (the Sinkhorn runs after the kernel)."""

    persistent = True
    split = False
    sinkhorn_lanes = False
    cl = 16
    bt = 16
    push = True
    sinkhorn = False

    def __init__(self, n: int, hidden: int, update: bool, iters: int, warps: int = 8) -> None:
        self.n, self.c, self.update, self.iters = n, hidden, update, iters
        _sizes(self, n, hidden, self.cl, self.bt, warps)
        self.ctas = 1
        self.groups = self.nch // 2
        self.gpw = -(-self.groups // warps)
        self.phi_bytes = self.nch * self.phi_chunk
        self.ncoef = n + n * n if update else 0  # H_post then H_res, a token
        # Coefficient rows padded to an odd number of 16-byte units: 8 rows' 16-byte reads, conflict-free.
        self.coef_row = (-(-self.ncoef // 4) | 1) * 16 if update else 0
        self.coef_bytes = self.bt * self.coef_row
        # Per-warp partials of one group of ``wslots`` warps; the groups add theirs in place in turn.
        self.wslots = warps // 2 if warps <= 8 else 4
        self.wp_bytes = self.wslots * 16 * (self.kpad + 1) * 4
        self.part_bytes = self.cl * (self.kpad + 1) * 4  # a parity's: the 16 CTAs' rows of one token
        self.group_slot = (n + 1 if update else n) * 16 * 64  # the n stream tiles and y: 16 rows of 64 bytes
        self.warp_slot = self.gpw * self.group_slot
        self.slot_bytes = min(warps, self.groups) * self.warp_slot  # warps past the groups stream nothing
        # Kept in shared memory rather than registers held across the loop by every warp: the
        # parameters warp 0's coefficient step reads (6 a lane), this CTA's columns of the norm
        # weight (FP32), and each thread's combination of a block between its two passes.
        self.consts_bytes = 6 * 32 * 4
        self.w_bytes = self.hs * 4
        self.mixed_bytes = self.threads * (self.bt // warps) * (-(-self.units // 32)) * 32
        self.aux_bytes = self.consts_bytes + self.w_bytes + self.mixed_bytes
        self.smem = (self.phi_bytes + self.slot_bytes + self.aux_bytes + self.coef_bytes + self.wp_bytes
                     + 2 * (self.part_bytes + self.hpre_bytes + self.hsq_bytes) + 6 * 8 + 1024)
        self.stages = 0
        self.problem = self._problem()
        self.key = _frozen_key(self)

    def _problem(self) -> str:
        if not 2 <= self.n <= 4:
            return _streams_problem(self.n)
        if self.c % (self.cl * 64):
            return f"hidden size {self.c} is not a multiple of {self.cl * 64} (16 CTAs of 64-column groups)"
        if self.warps % 2 or not 2 <= self.warps <= 16 or self.gpw > 2 or self.warps % self.wslots:
            return (f"{self.warps} warps for {self.groups} groups of 32 columns a CTA (even, 2 to 16, at most 2 "
                    "groups a warp)")
        if self.smem > SMEM_LIMIT:
            return (f"{self.smem} bytes of shared memory a CTA (at most {SMEM_LIMIT}): phi's slice alone is "
                    f"{self.phi_bytes}")
        return ""


PRODUCE_DEPTH = 2


class SplitShape(PersistentShape):
    """Compile-time shape of the split variant (``cute_split``): the persistent variant's stream
    pass on ``sets`` sets of 16 CTAs (no clusters), and finisher CTAs on the SMs the sets leave. A
    stream CTA writes each block's partials to global memory and counts the block ready. A finisher
    CTA takes whole tokens once their block is ready: a producer warp sums the 16 CTAs' partials in
    rank order and computes the coefficients while the copy engine brings the token's x' row (from
    L2) into a ring in shared memory; consumer warps combine and normalize it.
    The exchanges between CTAs then leave the stream CTAs' path, and the combination leaves their
    SMs, whose L1 the stream pass needs (PERFORMANCE.md, eleventh pass). Sizes that depend on the
    GPU (sets, finishers) are launch arguments, not compile-time."""

    split = True
    # H_res's Sinkhorn in the producer warps, a token a lane, in batches of up to 32 (logits gathered
    # as they are computed) run while the warp's next count has not come or the batch is full: faster
    # than a launch after the kernel (PERFORMANCE.md, fifteenth pass; that form removed).
    sinkhorn_lanes = True
    # The counts live in a buffer kept from launch to launch (``counts``) with two halves: a launch
    # takes the half its phase word names and zeroes the other, which the launch before used; its
    # last CTA flips the phase once every CTA has read it. No memset (counts zeroed per call were
    # slower: 231.5-233.7 against 227.0-227.6 µs at T = 8192; removed).
    kept = True

    def __init__(self, n: int, hidden: int, update: bool, iters: int, warps: int = 8, producers: int = 2,
                 produce_depth: int = PRODUCE_DEPTH) -> None:
        super().__init__(n, hidden, update, iters, warps=warps)
        self.producers = producers
        # The stream role's plan (phi, slots, coefficient rows, per-warp partials, then a second
        # buffer of coefficient rows) without the
        # exchange buffers; the finisher role's ring of x' rows (n x C bf16 each, as many as fit, at
        # most 8) with two barriers each, H_pre for twice as many tokens (computed before a token
        # has a row), and the consumers' sums of squares.
        self.units_row = hidden // 8  # 16-byte units of a row
        self.fslot = n * hidden * 2
        self.hrows = 16
        stream = self.phi_bytes + self.slot_bytes + 2 * self.coef_bytes + self.wp_bytes
        self.fslots = min(8, max(2, (SMEM_LIMIT - 1024 - 256 - 16 * self.hrows) // (self.fslot + 16)))
        finish = self.fslots * (self.fslot + 16) + 16 * self.hrows + 256
        # Tokens a step of a producer warp (their ready waits, partials' loads and coefficients
        # overlap), at most the ring's rows over the producers: a step waits for the rows of the
        # steps before it, never for one that waits on it (3 producers of 4 tokens on 7 rows hung). Polling
        # all of a step's counts at once, at depth 3, was slower: 407.2 against 342.5 µs (H200, T = 8192).
        self.pdepth = max(1, min(produce_depth, self.fslots // producers))
        self.smem = max(stream, finish) + 1024
        self.problem = self._problem() or ("" if warps == 8 and 1 <= producers <= 7 else
                                           f"{warps} warps a CTA, {producers} of them producers (the split "
                                           "variant runs 8, 1 to 7 of them producers)")
        self.key = _frozen_key(self)
