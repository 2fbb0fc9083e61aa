"""Triton kernels of the MHC read and update, FP32 accumulation throughout.

``mhc_boundary_kernel`` is the read (``UPDATE=False``) and the producer's update fused with the
next read (``UPDATE=True``). Its programs work on blocks of ``BT`` tokens, in two kinds:

    stream pass  (one per token block and column slice of ``CS`` columns, ``S`` slices)
        x'[t, i, c] = H_post[t, i] y[t, c] + sum_j H_res[t, i, j] x[t, j, c]
                      FP32, rounded once to the stream dtype and stored          (UPDATE only)
        partial sum_c x'^2 and partial x' @ phi over the slice, FP32          -> workspace
    finish       (one per ``TB`` tokens, after every stream pass of its block)
        sum the slices' partials -> rstd = rsqrt(sum x'^2 / (n C) + eps),
        H_pre = sigmoid(a_pre rstd (x' phi_pre) + b_pre), H_post' = 2 sigmoid(...),
        H_res' = Sinkhorn(a_res rstd mat(x' phi_res) + b_res)             -> stored (the update)
        input = s * rsqrt(mean(s^2) + norm_eps) * (w + offset), s = sum_j H_pre[j] x'_j

the operation order of ``layer_boundary_mhc.reference`` (the projection of the normalized
streams is ``rstd`` times the projection of the streams). ``phi`` is FP32: the projection runs on
tensor cores as TF32 products of ``phi``'s high and low parts (``projection``), about 2^-21 of
each term, near the accuracy of an FP32 product; 16-bit streams are exact in TF32. Blocks of up
to ``MhcKernelConfig.presplit_tokens`` tokens (``mma.sync``) take the parts split once, transposed (``phi_parts``,
[2, K, n C]: the MMA's B operand K-major, loaded by 16-byte cp.async): split in the stream pass,
every chunk paid a mask, a subtraction and the register-to-shared trip for each element of phi
(sm_90, n = 4: 806 -> 470 instructions a chunk at BT = 32, 173 -> 128 registers). Larger blocks
split phi in the stream pass: on wgmma the pre-split parts compiled to as many instructions
(675 -> 685 at BT = 64), for twice the bytes of phi read from L2.

Why the mix is written once and projected from registers: the x' tile that is stored is the A
operand of the MMA, so x' is never re-read in a stream pass. The rounding to the stream dtype is
an opaque instruction on NVIDIA GPUs (``_store_cast``): Triton then moves the rounded tile into
the MMA's layout through shared memory instead of recomputing the mix, loads and FMAs, in each
layout (which took half the stream pass's instructions and 245 registers at n = 4, BT = 64).

Why slices: ``phi`` ([n C, n^2 + 2n] FP32, 1.5 MiB at n = 4, C = 4096) is read from L2 once per
stream pass, so a pass covers ``BT`` tokens to amortize it (24 KiB a token at BT = 64), and the
columns are split so that a block's stream passes are small and many: few tokens lie between a
block's stream pass and its finish, and the finish re-reads x' from L2, not HBM.

Cooperative launch (``MODE = 0``, one grid): each program takes a ticket from an atomic counter
when it starts. Tickets are read as rounds of ``S + RB``: the stream passes of block ``r``, then
the ``RB`` finishes of block ``r - LAG``. A finish waits (acquire) until the ``S`` stream passes
of its block have arrived (release). Those hold lower tickets, so they started before it and wait
for nothing: no deadlock, whatever number of programs is resident; and under the interpreter,
which runs programs one at a time in ticket order, no finish ever waits. ``MODE = 1`` / ``2`` are
the same code as two launches (stream passes, then finishes, the last blocks first: part of their
x' is still in L2), without tickets or waiting. Two other one-launch forms were measured slower
than two launches on an H200 and removed: folded (each program a stream pass, then finishes of the
block ``LAG`` rounds back; 345 µs against 314 at T = 8192, n = 4, H = 4096; removed after 0c5f2f8
and 8e09787 measured it) and an arrival form (the last stream pass of a block finishes it: 453 µs
and more; removed in c8816b6): PERFORMANCE-history.md.

bf16 streams at prefill sizes take ``stream_joined``'s stream pass (``MhcKernelConfig.joined``): the n streams
one MMA operand against phi's bf16 parts (505 -> 218 µs of stream passes at T = 8192).

``mhc_update_kernel`` is the update alone (a stage whose streams are not read next).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .projection import project_tf32, split_tf32
from .config import DEFAULT_CONFIG, MhcKernelConfig
from .coefficients import MAX_STREAMS
from .finish import _finish
from .stream_joined import stream_pass_joined
from .triton_tiles import (CAST_EXACT, CAST_PLAIN, CAST_PTX, CAST_PTX_PURE, _block_start, _mixed_stream,
                           _store_cast, _stream_coefficients, _stream_inputs)

__all__ = [
    "mhc_boundary_kernel",
    "mhc_update_kernel",
    "BoundaryConfig",
    "boundary_config",
    "update_config",
    "coefficient_columns",
    "phi_parts",
    "padded_streams",
    "INTERPRETED",
    "MAX_STREAMS",
    "CASTS",
    "CAST_PLAIN",
    "CAST_EXACT",
    "CAST_PTX",
    "CAST_PTX_PURE",
    "CASTS_PURE",
    "COOPERATIVE",
    "STREAM_PASS",
    "FINISH",
]

COOPERATIVE, STREAM_PASS, FINISH = 0, 1, 2



@triton.jit
def _stream_pass(
    x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, part_ptr, b, s, T,
    sxt, sxn, sxc, syt, syc, sot, son, soc,
    N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
    S: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr,
    UPDATE: tl.constexpr, SPLIT_A: tl.constexpr, PRESPLIT: tl.constexpr, CASTS: tl.constexpr,
):
    row0, tt, tm, x_ptr, y_ptr, xo_ptr, coefs = _block_start(x_ptr, y_ptr, xo_ptr, hp_ptr, hr_ptr, b, T,
                                                             sxt, syt, sot, N, BT, UPDATE)
    cc = tl.arange(0, BC)
    kk = tl.arange(0, KP)
    km = kk < K
    acc = tl.zeros([BT, KP], dtype=tl.float32)
    ssq = tl.zeros([BT], dtype=tl.float32)
    # A fixed trip count: the last slice's chunks past C are masked out.
    for ci in tl.range(0, CS // BC, num_stages=STAGES):
        c = s * CS + ci * BC + cc
        cm = c < C
        m2 = tm[:, None] & cm[None, :]
        if UPDATE:
            y, xs = _stream_inputs(y_ptr, x_ptr, tt, c, m2, syt, syc, sxt, sxn, sxc, N, "")
        for i in tl.static_range(N):
            if UPDATE:
                v = _mixed_stream(y, xs, coefs[i][0], coefs[i][1], N)
                # The read sees the rounded streams, as the reference does.
                a = _store_cast(xo_ptr + i * son + tt[:, None] * sot + c[None, :] * soc, v, m2, CASTS, "")
            else:
                a = tl.load(x_ptr + i * sxn + tt[:, None] * sxt + c[None, :] * sxc, mask=m2, other=0.0)
            v = a.to(tl.float32)
            ssq += tl.sum(v * v, axis=1)
            pm = cm[:, None] & km[None, :]
            if PRESPLIT:
                src = phs_ptr + kk[None, :] * (N * C) + (i * C + c)[:, None]
                acc = project_tf32(v, tl.load(src, mask=pm, other=0.0), tl.load(src + N * C * K, mask=pm, other=0.0),
                                   acc, SPLIT_A)
            else:
                phi = tl.load(phi_ptr + (i * C + c)[:, None] * K + kk[None, :], mask=pm, other=0.0)
                phi_hi, phi_lo = split_tf32(phi)
                acc = project_tf32(v, phi_hi, phi_lo, acc, SPLIT_A)
    # Column K (never a coefficient) carries the sum of squares.
    acc = tl.where(kk[None, :] == K, ssq[:, None], acc)
    dst = part_ptr + (row0 + tt)[:, None] * (S * KP) + s * KP + kk[None, :]
    tl.store(dst, acc, mask=tm[:, None])


@triton.jit
def _any_stream_pass(
    x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, part_ptr, b, s, T,
    sxt, sxn, sxc, syt, syc, sot, son, soc,
    N: tl.constexpr, NP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
    S: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr,
    UPDATE: tl.constexpr, SPLIT_A: tl.constexpr, PRESPLIT: tl.constexpr, CASTS: tl.constexpr,
    JOINED: tl.constexpr, LOADS: tl.constexpr, KEEP: tl.constexpr,
):
    if JOINED:  # bf16 streams; phs_ptr holds projection.bf16_parts
        stream_pass_joined(x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phs_ptr, part_ptr, b, s, T,
                           sxt, sxn, sxc, syt, syc, sot, son, soc,
                           N, NP, K, KP, C, S, CS, BT, BC, STAGES, UPDATE, CASTS, LOADS, KEEP)
    else:
        _stream_pass(x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, part_ptr, b, s, T,
                     sxt, sxn, sxc, syt, syc, sot, son, soc,
                     N, K, KP, C, S, CS, BT, BC, STAGES, UPDATE, SPLIT_A, PRESPLIT, CASTS)


@triton.jit
def _arrive(cnt_ptr, blk):
    # Every thread's stores, then one release: what a finish of the block acquires.
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + 1 + blk, 1, sem="release", scope="gpu")


@triton.jit
def _await_block(cnt_ptr, blk, S: tl.constexpr):
    # Until the block's S stream passes have arrived (acquire: their stores are visible).
    while tl.atomic_add(cnt_ptr + 1 + blk, 0, sem="acquire", scope="gpu") < S:
        pass


@triton.jit
def mhc_boundary_kernel(
    x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, w_ptr,
    out_ptr, hpo_ptr, hro_ptr, part_ptr, cnt_ptr,
    T, NB, LAG,
    sxt, sxn, sxc, syt, syc, sot, son, soc, sw, sit, sic,
    eps, norm_eps, offset,
    N: tl.constexpr, NP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
    CP: tl.constexpr, S: tl.constexpr, SB: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, STAGES: tl.constexpr, TB: tl.constexpr, RB: tl.constexpr, ITERS: tl.constexpr,
    UPDATE: tl.constexpr, SPLIT_A: tl.constexpr, PRESPLIT: tl.constexpr, CHUNKED: tl.constexpr,
    MODE: tl.constexpr, CASTS: tl.constexpr, JOINED: tl.constexpr, FR: tl.constexpr,
    LOADS: tl.constexpr, KEEP: tl.constexpr, SKIP_TAIL: tl.constexpr,
):
    if MODE == 1:  # the stream passes launched on their own
        pid = tl.program_id(0)
        _any_stream_pass(x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, part_ptr, pid // S, pid % S, T,
                         sxt, sxn, sxc, syt, syc, sot, son, soc,
                         N, NP, K, KP, C, S, CS, BT, BC, STAGES, UPDATE, SPLIT_A, PRESPLIT, CASTS,
                         JOINED, LOADS, KEEP)
    elif MODE == 2:
        # The finishes launched on their own, last blocks first: the stream passes wrote them last,
        # and part of their x' is in L2.
        pid = tl.program_id(0)
        _finish(x_ptr, xo_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, w_ptr,
                out_ptr, hpo_ptr, hro_ptr, part_ptr, NB - 1 - pid // RB, pid % RB, T,
                sxt, sxn, sxc, sot, son, soc, sw, sit, sic, eps, norm_eps, offset,
                N, NP, K, KP, C, CP, S, SB, BT, TB, ITERS, UPDATE, CHUNKED, CASTS, FR, LOADS, SKIP_TAIL)
    else:
        # One launch, tickets in start order: a round is S stream passes of block r, then RB
        # finishes of block r - LAG.
        ticket = tl.atomic_add(cnt_ptr, 1)
        r = ticket // (S + RB)
        k = ticket % (S + RB)
        if (k < S) & (r < NB):
            _any_stream_pass(x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, phi_ptr, phs_ptr, part_ptr, r, k, T,
                             sxt, sxn, sxc, syt, syc, sot, son, soc,
                             N, NP, K, KP, C, S, CS, BT, BC, STAGES, UPDATE, SPLIT_A, PRESPLIT, CASTS,
                             JOINED, LOADS, KEEP)
            _arrive(cnt_ptr, r)
        if (k >= S) & (r >= LAG):
            blk = r - LAG
            _await_block(cnt_ptr, blk, S)
            _finish(x_ptr, xo_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, w_ptr,
                    out_ptr, hpo_ptr, hro_ptr, part_ptr, blk, k - S, T,
                    sxt, sxn, sxc, sot, son, soc, sw, sit, sic, eps, norm_eps, offset,
                    N, NP, K, KP, C, CP, S, SB, BT, TB, ITERS, UPDATE, CHUNKED, CASTS, FR, LOADS, SKIP_TAIL)


@triton.jit
def mhc_update_kernel(
    x_ptr, y_ptr, hp_ptr, hr_ptr, xo_ptr, T,
    sxt, sxn, sxc, syt, syc, sot, son, soc,
    N: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, CASTS: tl.constexpr,
):
    """``x' = H_res x + H_post^T y`` on a [BT tokens, BC columns] tile, rounded once."""
    row0 = tl.program_id(0).to(tl.int64) * BT
    tt = tl.arange(0, BT)
    tm = row0 + tt < T
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m2 = tm[:, None] & (c < C)[None, :]
    y, xs = _stream_inputs(y_ptr + row0 * syt, x_ptr + row0 * sxt, tt, c, m2, syt, syc, sxt, sxn, sxc, N, "")
    for i in tl.static_range(N):
        hp, hr = _stream_coefficients(hp_ptr + row0 * N, hr_ptr + row0 * (N * N), tt, tm, i, N)
        v = _mixed_stream(y, xs, hp, hr, N)
        _store_cast(xo_ptr + row0 * sot + i * son + tt[:, None] * sot + c[None, :] * soc, v, m2, CASTS, "")


# Decided when this module is imported: Triton 3.6 picks the interpreter in @triton.jit.
INTERPRETED = not isinstance(mhc_boundary_kernel, JITFunction)
# PTX only for NVIDIA; ROCm builds of torch report their GPUs as cuda devices too.
CASTS = CAST_EXACT if INTERPRETED else CAST_PLAIN if torch.version.hip else CAST_PTX
# For kernels whose rounded tiles feed one layout (the joined stream pass, the update alone): pure,
# so that torch.compile's analysis of which arguments a kernel writes can read it (impure inline
# assembly makes it assume every argument written, and copy each before the launch).
CASTS_PURE = CAST_EXACT if INTERPRETED else CAST_PLAIN if torch.version.hip else CAST_PTX_PURE


@dataclass(frozen=True, slots=True)
class BoundaryConfig:
    """Launch shape of ``mhc_boundary_kernel`` for one (token bucket, n, C, element size).

    ``block_tokens`` (BT) tokens a block, ``block_cols`` (BC) columns a chunk, ``slices`` (S) of
    ``slice_cols`` (CS) columns each, ``finish_tokens`` (TB) a finish, ``finishers`` (RB = BT / TB)
    finishes a block, ``lag`` rounds between a block's stream passes and its finishes,
    ``row_tile`` (CP) the finish's row tile, ``chunked`` when the row is wider than the config's ``max_tile``,
    ``stages`` the chunks a stream pass has in flight (Triton's software pipelining),
    ``presplit`` whether the stream passes read phi's TF32 parts split beforehand (``phi_parts``),
    ``joined`` whether
    bf16 streams take ``stream_joined``'s stream pass (which reads ``projection.bf16_parts``),
    ``finish_rows`` (FR) the tokens a finish normalizes at once,
    ``max_registers`` a cap on a thread's registers (0: ptxas decides), ``evict`` whether the joined stream pass's inputs and the finishes' x'
    loads are marked evict-first and the x' stores evict-last in L2, ``finish_warps`` the warps of
    a finish launched on its own (two launches; one launch shares the stream pass's), ``skip_tail``
    whether a finish of the last block stops at its last token (decode sizes).
    """

    block_tokens: int
    block_cols: int
    slices: int
    slice_cols: int
    finish_tokens: int
    finishers: int
    lag: int
    row_tile: int
    chunked: bool
    num_warps: int
    stages: int
    presplit: bool
    joined: bool = False
    finish_rows: int = 1
    max_registers: int = 0
    evict: bool = False
    skip_tail: bool = False
    finish_warps: int = 4

    def slice_batch(self, padded_columns: int) -> int:
        """Slices a finish sums per load: a [TB, SB, KP] tile of at most 4K values."""
        return max(1, min(triton.next_power_of_2(self.slices), 4096 // (self.finish_tokens * padded_columns)))

    def blocks(self, tokens: int) -> int:
        return triton.cdiv(tokens, self.block_tokens)

    def lag_for(self, tokens: int) -> int:
        return min(self.lag, self.blocks(tokens))

    def grid(self, tokens: int, mode: int) -> int:
        nb = self.blocks(tokens)
        if mode == COOPERATIVE:
            return (nb + self.lag_for(tokens)) * (self.slices + self.finishers)
        return nb * (self.finishers if mode == FINISH else self.slices)


# Launch shapes are derived from an ``MhcKernelConfig`` (its fields say why each setting exists and
# what it measured) and cached per (config, bucket, n, C, element size).
_CONFIGS: dict[tuple, BoundaryConfig] = {}


def boundary_config(tokens: int, n: int, hidden: int, itemsize: int, bf16: bool = False,
                    config: MhcKernelConfig = DEFAULT_CONFIG) -> BoundaryConfig:
    """The cached launch shape for ``tokens`` rows of ``n`` streams of ``hidden`` columns
    (``bf16``: the streams are bf16, which the joined stream pass needs) under ``config``."""
    bucket = config.bucket(tokens)
    key = (config, bucket, n, hidden, itemsize, bf16)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        joined = bf16 and bool(config.joined[bucket])
        bt = (config.joined_block_tokens if joined else config.block_tokens)[bucket]
        bc = 32 if n <= 4 else 16  # [BT, BC] tiles of the n streams and their mix stay in registers
        cs = max(config.slice_cols[bucket] // bc, 1) * bc
        slices = triton.cdiv(hidden, cs)
        tb = min(config.finish_tokens, bt)
        cp = triton.next_power_of_2(hidden)
        chunked = cp > config.max_tile
        presplit = bt <= config.presplit_tokens and not joined
        warps = (config.joined_warps if joined else config.num_warps)[bucket]
        kp = coefficient_columns(n)[1]
        # A chunk's loads: n + 1 stream tiles and phi, each stage buffered in shared memory: n
        # [BC, KP] FP32 tiles (two with presplit), or joined three bf16 [NP BC, KP] tiles; phi
        # dominates at large n (KP = 128 at n = 8).
        phi_bytes = 3 * padded_streams(n) * bc * kp * 2 if joined else n * (1 + presplit) * bc * kp * 4
        chunk_bytes = bt * bc * itemsize * (n + 1) + phi_bytes
        stages = max(1, min(3, config.stage_bytes // chunk_bytes))
        row_tile = config.chunk if chunked else cp
        cfg = _CONFIGS[key] = BoundaryConfig(
            block_tokens=bt, block_cols=bc, slices=slices, slice_cols=cs, finish_tokens=tb, finishers=bt // tb,
            lag=config.lag, row_tile=row_tile, chunked=chunked, num_warps=warps, stages=stages,
            presplit=presplit, joined=joined,
            finish_rows=max(1, min(config.finish_rows, tb)),
            max_registers=_register_cap(joined, warps, config.joined_programs),
            evict=joined and bool(config.evict[bucket]), skip_tail=bucket == 0,
            finish_warps=config.finish_warps or (4 if row_tile <= 4096 else 8),
        )
    return cfg


def _register_cap(joined: bool, warps: int, programs: int) -> int:
    # Two 8-warp joined programs an SM: 128 registers, where a one-launch form's finish, compiled into
    # the same kernel, would otherwise raise the count (sm_90: 144 at FR = 1, 190 at FR = 2; no
    # spills at 128); 4-warp programs need no cap for two (238; ptxas gives at most 255).
    if not joined or not programs:
        return 0
    cap = 65536 // (programs * 32 * warps) // 8 * 8
    return cap if cap < 255 else 0


def padded_streams(n: int) -> int:
    """NP: the streams padded to a power of two, at least 2 (the kernels' stream axis)."""
    return max(2, 1 << max(0, int(n) - 1).bit_length())


_UPDATE_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {}


def update_config(n: int, hidden: int, itemsize: int) -> tuple[int, int, int]:
    """``(BT, BC, num_warps)`` of ``mhc_update_kernel``: 8K values a tile, 16 bytes a thread a
    load along a row."""
    key = (n, hidden, itemsize)
    cfg = _UPDATE_CONFIGS.get(key)
    if cfg is None:
        bc = min(triton.next_power_of_2(hidden), 512)
        np_ = triton.next_power_of_2(n)
        bt = max(1, min(16, 8192 // (np_ * bc)))
        warps = max(1, min(8, bt * bc * itemsize // 512))
        cfg = _UPDATE_CONFIGS[key] = (bt, bc, warps)
    return cfg


def phi_parts(phi: torch.Tensor) -> torch.Tensor:
    """``[2, K, n C]``: phi's TF32 high part (11 leading significant bits, as ``_tf32_high``) and
    the rest, exact in FP32, transposed; their sum is phi bit for bit."""
    phi = phi.detach().t()
    high = (phi.view(torch.int32) & -8192).view(torch.float32)
    return torch.stack((high, phi - high))


def coefficient_columns(n: int) -> tuple[int, int]:
    """``(K, KP)``: the n^2 + 2n coefficient columns and their padded width, with one spare
    column for the sum of squares (at least 16: the smallest tensor-core tile)."""
    k = n * n + 2 * n
    return k, max(16, triton.next_power_of_2(k + 1))
