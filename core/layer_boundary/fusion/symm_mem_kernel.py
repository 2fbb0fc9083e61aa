"""Triton kernel: one-shot all-reduce over symmetric memory + residual add + RMSNorm, fused.

Each rank copies its partial rows into its own peer-visible buffer, meets its peers at a
per-program barrier, then every rank reads all ranks' rows (peers over NVLink), sums them in
rank order, adds the residual and normalizes, in one launch. Peers' memory is reached through
the pointers symmetric-memory rendezvous hands out, never through NVLink multicast.

Numerics match the unfused path: the rank sum is accumulated in FP32 in rank order (the same
order on every rank, so all ranks hold identical results) and rounded once to the activation
dtype, as an all-reduce output is; the residual add and the norm then follow the torch reference
(FP32 sum normalized before the stored residual is rounded).

Barrier protocol: program ``p`` of every rank owns flag slots ``[p * world, (p + 1) * world)``
in each rank's flag buffer. To signal, a program compare-and-swaps 0 -> 1 into its slot in each
peer's buffer (spinning while the peer has not yet consumed the previous signal); to wait, it
swaps 1 -> 0 on the slots its peers write into its own buffer. Program ``p`` handles the same
rows on every rank and only reads rows its peers' program ``p`` wrote, so a barrier per program
suffices; the closing barrier keeps a fast rank from overwriting rows a slow peer still reads.
Peers' row buffers are reached as element offsets from this rank's own buffer (symmetric
allocations are page aligned, so the offsets are multiples of 16 elements); pointers made from
raw integers would carry no alignment and the loads would not vectorize.
Every program must be resident at once (a waiting program holds its SM): the grid is capped at
the device's SM count.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["allreduce_add_rmsnorm_kernel"]


@triton.jit
def _barrier(flag_ptrs, pid, RANK: tl.constexpr, WORLD: tl.constexpr):
    # Every thread's earlier stores (or loads) are ordered before the signal by the CTA barrier
    # plus the releasing atomic; the acquiring atomic plus the CTA barrier order the peers'
    # writes before every thread's later loads.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer + pid * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != RANK:
            while tl.atomic_cas(mine + pid * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def allreduce_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    buf_ptr, buf_offsets, flag_ptrs,
    n_rows, hidden, x_stride, eps, weight_offset,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty

    for row in range(pid, n_rows, nprog):
        v = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        tl.store(buf_ptr + row * hidden + cols, v, mask=mask)
    _barrier(flag_ptrs, pid, RANK, WORLD)

    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    for row in range(pid, n_rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            # Peers' buffers are addressed from this rank's (an aligned kernel argument) by an
            # element offset that is a multiple of 16, so the loads stay vectorized.
            src = buf_ptr + tl.multiple_of(tl.load(buf_offsets + p), 16)
            # .cg: served from the owner's memory, never from a line this SM cached earlier.
            acc += tl.load(src + row * hidden + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        total = acc.to(dtype).to(tl.float32)  # an all-reduce output is in the activation dtype
        r = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        s = total + r
        tl.store(res_ptr + row * hidden + cols, s.to(res_ptr.dtype.element_ty), mask=mask)
        var = tl.sum(s * s, axis=0) / hidden
        y = s * tl.rsqrt(var + eps) * w
        tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    _barrier(flag_ptrs, pid, RANK, WORLD)
