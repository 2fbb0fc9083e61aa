"""PTX one-liners for ``cute_cluster``: the CuTe DSL kernel is written as SIMT code over raw
addresses (shared-memory addresses as 32-bit integers, global ones as 64-bit), and these wrap the
instructions it needs that have no plain DSL spelling: cp.async with zero fill, vector loads and
stores, ``mma.sync`` on bf16, the distributed-shared-memory accesses of a cluster, and the
bit tricks between bf16 pairs and FP32. Imports ``cutlass``: load through ``cute_cluster`` only.
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def _v(a):
    return a.ir_value() if hasattr(a, "ir_value") else a


def asm(ret, args, text: str, cons: str, side: bool = True):
    return llvm.inline_asm(ret, [_v(a) for a in args], text, cons, has_side_effects=side, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def _fields(res, kind, count: int):
    return [llvm.extractvalue(kind, res, [i]) for i in range(count)]


def _struct(kind, count: int):
    return llvm.StructType.get_literal([kind] * count)


# --- shared memory (32-bit addresses) -------------------------------------------------------

def lds_v2(addr):
    r = asm(_struct(T.i32(), 2), [addr], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r")
    return [Int32(v) for v in _fields(r, T.i32(), 2)]


def lds_v4(addr):
    r = asm(_struct(T.i32(), 4), [addr], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r")
    return [Int32(v) for v in _fields(r, T.i32(), 4)]


def lds_v4_f32(addr):
    r = asm(_struct(T.f32(), 4), [addr], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r")
    return [Float32(v) for v in _fields(r, T.f32(), 4)]


def lds_f32(addr):
    return Float32(asm(T.f32(), [addr], "ld.shared.f32 $0, [$1];", "=f,r"))


def sts_v2(addr, a, b):
    asm(None, [addr, a, b], "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r")


def sts_v4_f32(addr, a, b, c, d):
    asm(None, [addr, a, b, c, d], "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f")


def sts_f32(addr, v):
    asm(None, [addr, v], "st.shared.f32 [$0], $1;", "r,f")


def cp_async16(dst, src, nbytes):
    # nbytes < 16 zero-fills the rest: masked rows arrive as zeros.
    asm(None, [dst, src, nbytes], "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r")


def cp_async16_if(dst, src, nbytes, ok):
    asm(None, [dst, src, nbytes, ok],
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.cg.shared.global [$0], [$1], 16, $2; }", "r,l,r,r")


def cp_async_commit():
    asm(None, [], "cp.async.commit_group;", "")


def cp_async_wait(pending: int):
    asm(None, [], f"cp.async.wait_group {pending};", "")


# --- the cluster's distributed shared memory ----------------------------------------------

def mapa(addr, rank):
    return Int32(asm(T.i32(), [addr, rank], "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", side=False))


def ld_cluster_f32(addr):
    return Float32(asm(T.f32(), [addr], "ld.shared::cluster.f32 $0, [$1];", "=f,r"))


def st_cluster_f32(addr, v):
    asm(None, [addr, v], "st.shared::cluster.f32 [$0], $1;", "r,f")


# Exchanges signalled through mbarriers (``push``): a CTA's incoming bytes complete its barrier's
# transaction count, so no exchange needs barrier.cluster (whose arrive compiles to a GPU-scope
# MEMBAR on sm_90a, waiting for every outstanding x' store).

def mbar_init(addr, count: int):
    asm(None, [addr], f"mbarrier.init.shared::cta.b64 [$0], {count};", "r")


def fence_mbar_init():
    asm(None, [], "fence.mbarrier_init.release.cluster;", "")


def mbar_expect_tx(addr, nbytes: int):
    asm(None, [addr], f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {nbytes};", "r")


def mbar_wait(addr, parity: int):
    asm(None, [addr], "{ .reg .pred p; LB_WAIT_${:uid}: "
        f"mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], {parity}; "
        "@!p bra LB_WAIT_${:uid}; }", "r")


def st_async_f32(addr, v, mbar):
    """``v`` to another CTA's shared memory (``addr``, ``mbar``: mapa addresses), counted as 4 bytes
    of that CTA's barrier ``mbar``'s transaction."""
    asm(None, [addr, v, mbar], "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$0], $1, [$2];", "r,f,r")


def cluster_arrive_relaxed():
    asm(None, [], "barrier.cluster.arrive.relaxed.aligned;", "")


def cluster_wait():
    asm(None, [], "barrier.cluster.wait.aligned;", "")


# --- global memory (64-bit addresses), predicated ---------------------------------------

def ldg_f32(addr, live):
    return Float32(asm(T.f32(), [addr, live],
                       "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.f32 $0, [$1]; }",
                       "=f,l,r"))


def ldg_v2(addr, live):
    """Two words from L2 (read-only path), zeros where ``live`` is 0."""
    r = asm(_struct(T.i32(), 2), [addr, live],
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; mov.b32 $1, 0; "
            "@p ld.global.nc.v2.b32 {$0, $1}, [$2]; }", "=r,=r,l,r")
    return [Int32(v) for v in _fields(r, T.i32(), 2)]


def ldg_v4_cg(addr, live):
    """Four words from L2 (not L1: written by this kernel), zeros where ``live`` is 0."""
    r = asm(_struct(T.i32(), 4), [addr, live],
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
            "@p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4]; }", "=r,=r,=r,=r,l,r")
    return [Int32(v) for v in _fields(r, T.i32(), 4)]


def ldg_v4_f32(addr):
    r = asm(_struct(T.f32(), 4), [addr], "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l")
    return [Float32(v) for v in _fields(r, T.f32(), 4)]


def stg_v2(addr, a, b, live):
    asm(None, [addr, a, b, live],
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.v2.b32 [$0], {$1, $2}; }", "l,r,r,r")


def stg_v4(addr, a, b, c, d, live):
    asm(None, [addr, a, b, c, d, live],
        "{ .reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.v4.b32 [$0], {$1, $2, $3, $4}; }", "l,r,r,r,r,r")


def stg_f32(addr, v, live):
    asm(None, [addr, v, live], "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.f32 [$0], $1; }", "l,f,r")


# --- bf16 pairs and FP32 ------------------------------------------------------------------

def unpack(word):
    """A bf16x2 word -> (low element, high element) as FP32, exactly."""
    r = asm(_struct(T.f32(), 2), [word], "shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xffff0000;", "=f,=f,r", side=False)
    lo, hi = _fields(r, T.f32(), 2)
    return Float32(lo), Float32(hi)


def pack(lo, hi):
    """Two FP32 values rounded to nearest even into one bf16x2 word (``lo`` in the low half)."""
    return Int32(asm(T.i32(), [hi, lo], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", side=False))


def mma_bf16(a, b, c):
    """``mma.sync.m16n8k16`` bf16 x bf16 + FP32: ``a`` 4 words, ``b`` 2 words, ``c`` 4 FP32."""
    r = asm(_struct(T.f32(), 4), list(a) + list(b) + list(c),
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side=False)
    return [Float32(v) for v in _fields(r, T.f32(), 4)]


def shfl_xor(v, mask: int):
    return Float32(asm(T.f32(), [v], f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=f,f"))


def shfl_idx(v, lane):
    return Float32(asm(T.f32(), [v, lane], "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r"))


def fmax(a, b):
    return Float32(asm(T.f32(), [a, b], "max.f32 $0, $1, $2;", "=f,f,f", side=False))


def rsqrt(v):
    # What Triton's tl.rsqrt emits on sm_90, so both kernels normalize alike.
    return Float32(asm(T.f32(), [v], "rsqrt.approx.ftz.f32 $0, $1;", "=f,f", side=False))


def exp(v):
    # exp(v) = 2^(v log2 e), as Triton's tl.exp on FP32.
    return Float32(asm(T.f32(), [v], "{ .reg .f32 t; mul.f32 t, $1, 0f3FB8AA3B; ex2.approx.f32 $0, t; }", "=f,f",
                       side=False))


def div(a, b):
    # What Triton's "/" on FP32 emits (div.full: within 2 ulp, a fraction of div.rn's latency, which
    # the Sinkhorn iterations wait on one after another).
    return Float32(asm(T.f32(), [a, b], "div.full.f32 $0, $1, $2;", "=f,f,f", side=False))


def sigmoid(v):
    return div(Float32(1.0), Float32(1.0) + exp(-v))


def fma(a, b, c):
    return Float32(asm(T.f32(), [a, b, c], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", side=False))


def sel(cond, a, b):
    """``a`` where the Int32 ``cond`` is nonzero, else ``b`` (FP32)."""
    return Float32(asm(T.f32(), [cond, a, b], "{ .reg .pred p; setp.ne.b32 p, $1, 0; selp.f32 $0, $2, $3, p; }",
                       "=f,r,f,f", side=False))


def mbar_wait_rt(addr, parity):
    """As ``mbar_wait``, the phase parity a register (a barrier reused block after block)."""
    asm(None, [addr, parity], "{ .reg .pred p; LB_WAIT_${:uid}: "
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1; "
        "@!p bra LB_WAIT_${:uid}; }", "r,r")


def mbar_wait_bounded(addr, parity):
    """As ``mbar_wait_rt``, trapping 20 s into the wait (``%globaltimer``), as ``spin_until``: a ring
    whose rows never arrive (a scheduling bug between warps) fails the launch instead of hanging it."""
    asm(None, [addr, parity], "{ .reg .pred p; .reg .u64 t0, t1; mov.u64 t0, %globaltimer; LB_WAIT_${:uid}: "
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1; @p bra LB_DONE_${:uid}; "
        "mov.u64 t1, %globaltimer; sub.u64 t1, t1, t0; setp.gt.u64 p, t1, 20000000000; @p trap; "
        "bra LB_WAIT_${:uid}; LB_DONE_${:uid}: }", "r,r")


def cp_async4_if(dst, src, nbytes, ok):
    # 4 bytes (nbytes 0: a zero), through L1: the coefficients of a block, 4-byte aligned rows.
    asm(None, [dst, src, nbytes, ok],
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.ca.shared.global [$0], [$1], 4, $2; }", "r,l,r,r")


def cp_async8_if(dst, src, ok):
    # 8 bytes through L1: phi's fragments gathered into another lane order at a launch's start.
    asm(None, [dst, src, ok],
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.ca.shared.global [$0], [$1], 8; }", "r,l,r")


def bar_sync(barrier: int, threads: int):
    """Named barrier ``barrier`` (not 0: __syncthreads') among ``threads`` threads of the CTA."""
    asm(None, [], f"bar.sync {barrier}, {threads};", "")


def cp_async_wait_all():
    asm(None, [], "cp.async.wait_all;", "")


def mma_bf16_sq(a, c):
    """x'_m . x'_n over one k16 step for the n-tiles of tokens 0-7 and 8-15 (B = the A fragment's
    own rows): the diagonal of both, each token's sum of squares, lands in one lane and register."""
    lo = mma_bf16(a, (a[0], a[2]), c[0:4])
    hi = mma_bf16(a, (a[1], a[3]), c[4:8])
    return lo + hi


# --- flags between CTAs of one grid (the split variant: no cluster) --------------------------

def red_release_add(addr, v):
    """Add ``v`` to the u32 at ``addr`` with release semantics at GPU scope: a block's ready count."""
    asm(None, [addr, v], "red.release.gpu.global.add.u32 [$0], $1;", "l,r")


def ld_relaxed_u32(addr):
    """The u32 at ``addr``, read at GPU scope (not from a stale L1 line)."""
    return Int32(asm(T.i32(), [addr], "ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l"))


def st_relaxed_u32(addr, v):
    asm(None, [addr, v], "st.relaxed.gpu.global.u32 [$0], $1;", "l,r")


def rcp(v):
    """1 / v, approximate (what ``div.full.f32`` multiplies by for operands in the normal range)."""
    return Float32(asm(T.f32(), [v], "rcp.approx.f32 $0, $1;", "=f,f", side=False))


def count_lane0(addr, lane):
    """The u32 at ``addr`` read by lane 0 (relaxed, GPU scope) and given to every lane of the warp."""
    return Int32(asm(T.i32(), [addr, lane],
                     "{ .reg .pred p; .reg .b32 v; setp.eq.u32 p, $2, 0; mov.b32 v, 0; "
                     "@p ld.relaxed.gpu.global.u32 v, [$1]; shfl.sync.idx.b32 $0, v, 0, 0x1f, 0xffffffff; }",
                     "=r,l,r"))


def ldg_f32_cg(addr, live):
    """One FP32 value from L2 (written by another CTA of this kernel), zero where ``live`` is 0."""
    return Float32(asm(T.f32(), [addr, live],
                       "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.cg.f32 $0, [$1]; }",
                       "=f,l,r"))


def spin_until(addr, target):
    """Until the u32 at ``addr`` (read with acquire semantics at GPU scope) reaches ``target``,
    sleeping briefly between reads. 20 s into the wait (``%globaltimer``) the kernel traps: a count
    that never arrives is a bug to report as an error, not a hang (a real wait is microseconds)."""
    asm(None, [addr, target], "{ .reg .pred p; .reg .u32 v; .reg .u64 t0, t1; mov.u64 t0, %globaltimer; "
        "LB_SPIN_${:uid}: ld.acquire.gpu.global.u32 v, [$0]; setp.ge.u32 p, v, $1; @p bra LB_DONE_${:uid}; "
        "nanosleep.u32 64; mov.u64 t1, %globaltimer; sub.u64 t1, t1, t0; setp.gt.u64 p, t1, 20000000000; "
        "@p trap; bra LB_SPIN_${:uid}; LB_DONE_${:uid}: }", "l,r")


def fence_proxy_async_global():
    """Global memory this thread has observed (another CTA's x', acquired) ordered before its later
    async-proxy reads of it (bulk copies)."""
    asm(None, [], "fence.proxy.async.global;", "")


def bulk_g2s(dst, src, nbytes: int, mbar):
    """``nbytes`` (a multiple of 16) from global ``src`` to this CTA's shared ``dst`` by the copy engine,
    counted on barrier ``mbar``'s transaction (16-byte aligned both ends)."""
    asm(None, [dst, src, mbar],
        f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {nbytes}, [$2];", "r,l,r")


def mbar_arrive(addr):
    """One arrival on barrier ``addr`` (release at CTA scope: this thread's earlier shared-memory
    writes and reads come before the phase completes)."""
    asm(None, [addr], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r")
