"""Triton kernel: one-shot all-reduce over symmetric memory + residual add + RMSNorm, fused.

The same kernel serves a MoE finalize handoff (``TOPK > 0``): each rank first combines its
top-k expert outputs with their router weights plus the shared expert, and that row is what it
pushes. On one rank (``WORLD == 1``) it is the finalize + add + norm alone.

Each rank pushes its partial rows into its slot of every rank's peer-visible buffer (stores over
NVLink, which need no reply), meets its peers at a per-program barrier, then reads all ranks'
rows from its own memory, sums them in rank order, adds the residual and normalizes, in one
launch. Pushing instead of pulling saves an NVLink round trip per call. Peers' memory is reached through
the addresses symmetric-memory rendezvous hands out, never through NVLink multicast.

Numerics match the unfused path: the rank sum is accumulated in FP32 in rank order (the same
order on every rank, so all ranks hold identical results) and rounded once to the activation
dtype, as an all-reduce output is; the residual add and the norm then follow the torch reference
(FP32 sum normalized before the stored residual is rounded).

Synchronization: one barrier per call and program, with epochs instead of a closing barrier.
Program ``p`` keeps its call count (epoch ``e``) in local memory, writes its rows into buffer
half ``e % 2`` (of every rank) and stores ``e`` into its flag slot in every peer's flag buffer
(releasing), then waits until each peer's slot in its own buffer reaches ``e`` (acquiring). A
fast rank's next call writes the other half; the call after that can only start once this rank
has signalled that next call, which it does after its reads of this call, so no rank overwrites
rows a peer still reads.
That needs program ``p`` to handle the same rows in every call: the grid is always the whole
(SM-count) set of programs and row ``r`` belongs to program ``r % programs``. Every program must
also be resident at once (a waiting program holds its SM), which that grid size guarantees.

Peers' row buffers are reached as element offsets from this rank's own buffer (symmetric
allocations are page aligned, so the offsets are multiples of 16 elements); pointers made from
raw integers would carry no alignment and the loads would not vectorize.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["allreduce_add_rmsnorm_kernel"]


@triton.jit
def _barrier(flag_ptrs, pid, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    # The CTA barrier plus the releasing store order every thread's earlier accesses before the
    # signal; the acquiring read plus the CTA barrier order the peers' rows before later loads.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != RANK:
            # A peer may already be one call ahead; the wrapping difference keeps the comparison
            # right when the int32 epoch overflows.
            while (tl.atomic_add(mine + pid * WORLD + p, 0, sem="acquire", scope="sys") - epoch) < 0:
                pass
    tl.debug_barrier()


@triton.jit
def _partial_row(x_ptr, tw_ptr, sh_ptr, row, n_rows, cols, mask, x_stride, k_stride, tw_stride,
                 sh_stride, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr):
    """This rank's contribution to row ``row``, in the activation dtype.

    ``TOPK == 0``: the contribution is given (``x`` is ``[T, H]``). ``TOPK > 0``: a MoE finalize
    handoff: ``x`` is ``[T, TOPK, H]`` expert outputs, combined with their router weights
    (``tw``, ``[T, TOPK]``) plus the shared expert (``sh``, ``[T, H]``) in FP32 and rounded once,
    as an unfused finalize output is before its all-reduce.
    """
    dtype = x_ptr.dtype.element_ty
    if TOPK == 0:
        return tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wj = tl.load(tw_ptr + row * tw_stride + j, mask=row < n_rows, other=0.0).to(tl.float32)
        acc += wj * tl.load(x_ptr + row * x_stride + j * k_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(sh_ptr + row * sh_stride + cols, mask=mask, other=0.0).to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _add_norm_row(total, res_ptr, w, out_ptr, row, cols, mask, hidden, eps):
    # The residual add and the norm as the torch reference runs them: the FP32 sum is
    # normalized before the stored residual is rounded.
    r = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    s = total + r
    tl.store(res_ptr + row * hidden + cols, s.to(res_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(s * s, axis=0) / hidden
    y = s * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def allreduce_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    buf_ptr, buf_offsets, flag_ptrs, epoch_ptr,
    n_rows, hidden, x_stride, slot_stride, eps, weight_offset,
    tw_ptr, sh_ptr, k_stride, tw_stride, sh_stride, nprog,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr = 0, HAS_SHARED: tl.constexpr = False,
):
    # nprog: the grid size (with peers), passed in; rows are visited as row0 + pid under a row mask.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    if WORLD == 1:
        # Nothing to sum over ranks (a finalize handoff on one rank): no buffer, no barrier, and
        # one program per row (the grid is the row count).
        row = pid
        v = _partial_row(x_ptr, tw_ptr, sh_ptr, row, n_rows, cols, mask, x_stride, k_stride,
                         tw_stride, sh_stride, TOPK, HAS_SHARED)
        _add_norm_row(v.to(tl.float32), res_ptr, w, out_ptr, row, cols, mask, hidden, eps)
    else:
        epoch = tl.load(epoch_ptr + pid) + 1
        half = (epoch % 2).to(tl.int64) * slot_stride * WORLD
        mine = buf_ptr + half

        # Push: this rank's rows go into its slot of every rank's buffer (peers over NVLink), so
        # after the barrier every rank reads all partial rows from its own memory.
        for row0 in tl.range(0, n_rows, nprog):
            row = row0 + pid
            rmask = mask & (row < n_rows)
            v = _partial_row(x_ptr, tw_ptr, sh_ptr, row, n_rows, cols, rmask, x_stride, k_stride,
                             tw_stride, sh_stride, TOPK, HAS_SHARED)
            for p in tl.static_range(WORLD):
                dst = mine + tl.multiple_of(tl.load(buf_offsets + p), 16) + RANK * slot_stride
                tl.store(dst + row * hidden + cols, v, mask=rmask)
        _barrier(flag_ptrs, pid, epoch, RANK, WORLD)

        for row0 in tl.range(0, n_rows, nprog):
            row = row0 + pid
            rmask = mask & (row < n_rows)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):
                # .cg: the peers wrote these lines; never serve them from this SM's L1.
                acc += tl.load(mine + p * slot_stride + row * hidden + cols, mask=rmask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            total = acc.to(dtype).to(tl.float32)  # an all-reduce output is in the activation dtype
            _add_norm_row(total, res_ptr, w, out_ptr, row, cols, rmask, hidden, eps)
        tl.store(epoch_ptr + pid, epoch)
