"""The cluster kernel (``cute_cluster``, CuTe DSL) as callables with the references' signatures.

| callable                   | reference               | returns                          |
| -------------------------- | ----------------------- | -------------------------------- |
| ``mhc_read_cluster``       | ``mhc_read_ref``        | (input, H_post, H_res)           |
| ``mhc_update_read_cluster``| ``mhc_update_read_ref`` | (x', input, H_post', H_res')     |

For bf16 streams ``[T, n, C]`` with ``2 <= n <= 4`` on Hopper (sm_90) GPUs where ``nvidia-cutlass-dsl``
imports; ``cluster_problem`` says why a call cannot take it (the Triton kernels then serve it).
Each (n, C, update) variant compiles once, on first use (about a second), never during CUDA-graph
capture: ``prepare_cluster`` compiles ahead. phi's bf16 fragments and the FP32 norm weight (with
its offset folded in, the sum the Triton finish computes per element) are made once per parameter
version, like the Triton kernels' phi split.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import counts
from .coefficients import SINKHORN_ITERS

__all__ = ["mhc_read_cluster", "mhc_update_read_cluster", "cluster_problem", "cluster_shape", "import_problem",
           "phi_fragments", "prepare_cluster", "launch", "takes", "CLUSTER", "BLOCK_TOKENS", "WARPS", "CTAS", "STAGES",
           "PHI_STAGED", "PUSH", "SINKHORN_AFTER_TOKENS", "UPDATE_READ_TOKENS", "READ_TOKENS", "PERSISTENT_TOKENS",
           "PERSISTENT_WARPS", "SPLIT_FINISHERS", "SPLIT_PRODUCERS", "SPLIT_TOKENS",
           "persistent_shape", "split_shape"]

# The preferred variant (``cluster_shape`` falls back to 64-, 32- and 16-token blocks with one CTA
# an SM, then to clusters of 8, where it does not fit): CLUSTER CTAs a block of BLOCK_TOKENS
# tokens, WARPS warps a CTA, shared memory sized for CTAS CTAs an SM. 16 CTAs (a non-portable size
# Hopper allows) split H = 4096 into 256-column slices. Two CTAs an SM (32 tokens x 4 streams x 256
# columns = 64 KiB of x' each) let one CTA's cluster exchanges overlap the other's stream pass:
# H200, T = 8192, update+read 557 µs against 589 for one CTA of 64 tokens, 627 with 16 warps, 727
# for clusters of 8 (benchmarks/results/2026-11-30-h200-session5.md).
CLUSTER = 16
BLOCK_TOKENS = 32
WARPS = 8
CTAS = 2
STAGES = 0  # chunks in flight a CTA (0: as many as shared memory holds, cluster_shape.MAX_STAGES at most)
# 1: phi's fragments travel in the stages (cp.async, one copy a CTA), loaded to registers before
# the MMAs; 0: from L2 to each warp's registers, a chunk ahead. H200, T = 8192: 444.5 against
# 552.1 µs (benchmarks/results/2026-11-30-h200-session6.md).
PHI_STAGED = 1
# 1: the cluster's three exchanges are st.async stores into the receivers' shared memory, each
# completing the receiver's mbarrier (one cluster barrier, at the start); 0: three barrier.cluster
# around plain distributed-shared-memory stores and loads, each arrive a GPU-scope MEMBAR that waits
# for the CTA's outstanding x' stores (5.7 % of the warps' stall samples, ncu). Same bits; H200,
# T = 8192: 370.1 against 380.5 µs, the exchanges 5.3 against 7.9 µs a block.
PUSH = 1
# Calls of at least SINKHORN_AFTER_TOKENS tokens (more blocks than one wave of clusters) leave
# H_res's logits to a Sinkhorn launched after the kernel on all tokens at once, SINKHORN_TOKENS a
# program: in the kernel, its dependent iterations held each block's cluster 4 µs of 25 (H200,
# T = 8192: 448.5 -> 382.8 µs with the cp.async plan). Below, one wave, the second launch costs
# more than it frees (update+read T = 128: 17.8 µs in the kernel, 20.4 after).
SINKHORN_AFTER_TOKENS = 512
# Its tokens a program and warps: 64 on 2 warps took 3.5 µs at T = 8192 and 5.7 at 32768, against
# 6.8 and 15.7 on 4 warps (H200; 32 on 1 and 128 on 4 were as fast;
# benchmarks/results/2026-11-30-h200-session12/call-overheads.log).
SINKHORN_TOKENS = 64
SINKHORN_WARPS = 2
# Calls of at least PERSISTENT_TOKENS tokens (0: none) run the persistent variant
# (``cute_persistent``: phi resident, clusters that take 16-token blocks in turn, as many as fit the
# GPU at once) where its shape fits (n = 4: H up to 4096), PERSISTENT_WARPS warps a CTA. Off: it ties
# the Triton two launches, which serve every shape (H200, n = 4, H = 4096, same run: T = 8192 309.8
# against 309.4 µs, T = 32768 1203.3 against 1194.5).
PERSISTENT_TOKENS = 0
PERSISTENT_WARPS = 8
# Calls of at least SPLIT_TOKENS tokens (0: none; before PERSISTENT_TOKENS) run the split variant
# where its shape fits (n = 2 to 4, H up to 4096): ``cute_split``, the persistent variant's stream
# pass on sets of 16 CTAs, and the exchanges, the coefficients and the combination on finisher CTAs
# on the other SMs. Open launch forms (``takes``) hand it update+reads and reads from this size:
# faster than the Triton two launches from 1024 tokens (H200, n = 4, H = 4096, bench mhc, same run,
# benchmarks/results/2026-12-01-h200-session16.md: update+read T = 1024 41.8 against 53.0 µs,
# 8192 227 / 311 (70.0 % of the roofline), 32768 879 / 1192; read T = 1024 31.7 / 35.4, 8192
# 198 / 223, 32768 766 / 858). Every MHC GPU test passed with the defaults (130, same session).
SPLIT_TOKENS = 1024
# The split variant's finisher CTAs: at least this many SMs are left to them (an H200's 132 SMs:
# 6 sets of 16 stream CTAs and 36 finishers; 7 sets left 20, too few to finish 8192 tokens as fast
# as they were streamed: 337.8 against 236.2 µs, the stream side alone 200). Their producer warps,
# and the tokens each takes a step: 3 warps of one token rather than 2 of two, whose first token
# waited for its second's block (about a wave later). Same run, three pairs (H200; results/
# 2026-12-01-h200-session13.md): T = 1024 45.0 against 46.3 µs, 8192 234.1 / 242.7, 32768
# 920.0 / 950.4 (averages). One producer: 319.3 µs at 8192.
SPLIT_FINISHERS = 36
SPLIT_PRODUCERS = 3
SPLIT_PRODUCE_DEPTH = 1
# With PROFILE set: the split variant writes only each CTA's start and end times (sweeps).
SPLIT_ENDS = 0
# H_res's Sinkhorn in the producer warps (a token a lane, batches run while the next count has not
# come) instead of a launch after the kernel: with 3 producers of one token, faster at every size
# measured (H200, interleaved with the launch-after form in one run: T = 1024 43.5-43.8 against
# 45.0-45.5 µs, 8192 231.0-232.1 against 233.5-235.9, 32768 902.4-905.6 against 901.5-959.0;
# PERFORMANCE.md, fifteenth pass). Not kept: a token's x' copy before its coefficients when its ring
# row is already free (with the Sinkhorn in the producers, no faster than without).
SPLIT_SINKHORN_LANES = 1
SPLIT_COPY_FIRST = 0
# Counts from a buffer kept from launch to launch, two halves and a phase (``counts``), instead of a
# memset before each launch: interleaved in one run (H200, n = 4, H = 4096; benchmarks/results/
# 2026-12-01-h200-session15.md), T = 8192 227.0 and 227.6 µs against 233.7 and 231.5 (70.1 % of the
# roofline), T = 1024 41.6 and 42.4 against 43.2 and 43.2. Not kept: a programmatic dependent
# launch (SPLIT_PDL) on top, 234.0 and 233.4 at T = 8192.
SPLIT_KEPT_COUNTS = 1
SPLIT_PDL = 0
# L2 eviction priorities in the split variant (``SplitShape.l2_hints``: 0 none, 1 x, y and the
# finishers' x' copies evict-first, 2 that and x' stored evict-last, 3 x' stored evict-last alone).
# Not kept: at T = 8192, 232-236 µs (1), 231 (2), 227-228 (3) against 226-228; ncu finds the
# default's DRAM bytes already at the ideal (every x' row found in L2), so there is nothing for
# priorities to save (benchmarks/results/2026-12-01-h200-session16.md).
SPLIT_L2_HINTS = 0
# An int64 CUDA tensor of at least blocks x cluster x 16 values: calls then run the profiled
# variant, each CTA writing (ns, SM id) at its phase boundaries (cluster_shape.PHASES), then warp 0's
# clock cycles in its chunk loop's wait, issue and compute sections and the chunk count (the split
# variant: ``SplitShape.profile_values`` of them). Sweeps only.
PROFILE: Optional[torch.Tensor] = None


def phi_fragments(phi: torch.Tensor, n: int) -> torch.Tensor:
    """``[C / 16, n, 3, NT, 8, 4, 4]`` bf16: FP32 phi (``[n C, K]``) cut by truncation into three bf16
    parts (high, middle, low; they sum to phi bit for bit, as ``projection.bf16_parts``), laid out as
    the cluster kernel's mma.sync B fragments: chunk of 16 columns, stream, part, n-tile of 8
    coefficients, lane ``4 g + q`` (coefficient ``8 nt + g``), and the lane's 4 values: columns
    ``4 q .. 4 q + 3`` of the chunk. Coefficient columns past K are zeros."""
    k = phi.shape[1]
    c = phi.shape[0] // n
    nt = (k + 7) // 8
    full = phi.new_zeros((n * c, 8 * nt), dtype=torch.float32)
    full[:, :k] = phi.detach()

    def high(v: torch.Tensor) -> torch.Tensor:
        return (v.view(torch.int32) & -65536).view(torch.float32)

    hi = high(full)
    rest = full - hi
    mid = high(rest)
    parts = torch.stack((hi, mid, rest - mid)).to(torch.bfloat16)  # [3, n C, 8 NT]
    # rows i C + 16 ch + 4 q + e, columns 8 nt + g  ->  (ch, i, part, nt, g, q, e)
    return parts.view(3, n, c // 16, 4, 4, nt, 8).permute(2, 1, 0, 5, 6, 3, 4).contiguous()


_SHAPES: dict[tuple, Any] = {}


def cluster_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS, sinkhorn: bool = True) -> Any:
    """The variant for these sizes (``cluster_shape.ClusterShape``; ``sinkhorn``: H_res's Sinkhorn in
    the kernel, else after it), or one whose ``problem`` says why none fits; planned once per sizes
    and settings (every launch asks)."""
    key = (n, hidden, update, iters, sinkhorn, CLUSTER, BLOCK_TOKENS, WARPS, CTAS, STAGES, PHI_STAGED, PUSH,
           PROFILE is not None)
    shape = _SHAPES.get(key)
    if shape is None:
        shape = _SHAPES[key] = _plan(n, hidden, update, iters, sinkhorn)
    return shape


def _plan(n: int, hidden: int, update: bool, iters: int, sinkhorn: bool) -> Any:
    from .cluster_shape import ClusterShape

    tries = [(CLUSTER, BLOCK_TOKENS, WARPS, CTAS, STAGES)]  # then fallbacks of the default form
    tries += [(cl, bt, 8, 1, 0) for cl in (CLUSTER, 8) for bt in (64, 32, 16)]
    shape = None
    for cl, bt, warps, ctas, stages in tries:
        shape = ClusterShape(n, hidden, cl, bt, update, iters, stages=stages, warps=warps, ctas=ctas,
                             profile=PROFILE is not None, phi_staged=bool(PHI_STAGED), sinkhorn=sinkhorn,
                             push=bool(PUSH))
        if not shape.problem:
            return shape
    return shape


def persistent_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS) -> Any:
    """The persistent variant's shape (``cluster_shape.PersistentShape``; its ``problem`` says why
    it does not fit)."""
    key = ("persistent", n, hidden, update, iters, PERSISTENT_WARPS, PROFILE is not None)
    shape = _SHAPES.get(key)
    if shape is None:
        from .cluster_shape import PersistentShape

        shape = _SHAPES[key] = PersistentShape(n, hidden, update, iters, warps=PERSISTENT_WARPS,
                                               profile=PROFILE is not None)
    return shape


def split_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS) -> Any:
    """The split variant's shape (``cluster_shape.SplitShape``; its ``problem`` says why it does not
    fit)."""
    key = ("split", n, hidden, update, iters, PERSISTENT_WARPS, SPLIT_PRODUCERS, SPLIT_PRODUCE_DEPTH, SPLIT_ENDS,
           SPLIT_SINKHORN_LANES, SPLIT_COPY_FIRST, SPLIT_KEPT_COUNTS, SPLIT_PDL, SPLIT_L2_HINTS, PROFILE is not None)
    shape = _SHAPES.get(key)
    if shape is None:
        from .cluster_shape import SplitShape

        shape = _SHAPES[key] = SplitShape(n, hidden, update, iters, warps=PERSISTENT_WARPS,
                                              profile=PROFILE is not None and not SPLIT_ENDS,
                                              producers=SPLIT_PRODUCERS, produce_depth=SPLIT_PRODUCE_DEPTH,
                                              ends=bool(SPLIT_ENDS) and PROFILE is not None,
                                              sinkhorn_lanes=bool(SPLIT_SINKHORN_LANES),
                                              copy_first=bool(SPLIT_COPY_FIRST), kept=bool(SPLIT_KEPT_COUNTS),
                                              pdl=bool(SPLIT_PDL), l2_hints=SPLIT_L2_HINTS)
    return shape


def _variant(t: int, n: int, hidden: int, update: bool, iters: int) -> Any:
    """The shape a call of ``t`` tokens runs."""
    for first, variant in ((SPLIT_TOKENS, split_shape), (PERSISTENT_TOKENS, persistent_shape)):
        if first and t >= first:
            shape = variant(n, hidden, update, iters)
            if not shape.problem:
                return shape
    return cluster_shape(n, hidden, update, iters, sinkhorn=t < SINKHORN_AFTER_TOKENS)


_CLUSTERS: dict[int, int] = {}


def _resident_clusters(device: torch.device) -> int:
    """How many clusters of 16 CTAs of one SM each the GPU runs at once (the driver's occupancy
    answer for a kernel taking all of an SM's shared memory; 7 on an H200)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _CLUSTERS.get(index)
    if got is None:
        if torch.cuda.is_current_stream_capturing():  # the query compiles and loads a probe kernel
            raise RuntimeError("the MHC persistent kernel's cluster count was not queried before CUDA-graph "
                               "capture; call layer_boundary_mhc.cluster_ops.prepare_cluster first")
        from cutlass.utils import HardwareInfo

        with torch.cuda.device(index):
            got = _CLUSTERS[index] = max(1, int(HardwareInfo(index).get_max_active_clusters(16)))
    return got


_SMS: dict[int, int] = {}


def _split_grid(device: torch.device, blocks: int) -> tuple[int, int]:
    """(sets of 16 stream CTAs, finisher CTAs) for the split variant: one CTA an SM, at least
    ``SPLIT_FINISHERS`` SMs left to the finishers, no more sets than blocks."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sets = max(1, min(blocks, (sms - SPLIT_FINISHERS) // 16))
    return sets, max(1, sms - 16 * sets)


def import_problem() -> str:
    try:
        import cutlass.cute  # noqa: F401
    except Exception as e:  # a broken install is a reason to stay on Triton, never a crash
        return f"the CuTe DSL does not import ({type(e).__name__}: {e}); pip install nvidia-cutlass-dsl"
    return ""


def _rows_ok(t: torch.Tensor) -> bool:
    # 16-byte cp.async and vector stores: unit column stride, row strides and base 16-byte aligned.
    return (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0)


def cluster_problem(x: torch.Tensor, *tensors: Optional[torch.Tensor], update: bool = True,
                    iters: int = SINKHORN_ITERS) -> str:
    """Why streams ``x`` (and the bf16 ``tensors``: y, destinations) cannot take the cluster kernel; ""
    when they can."""
    if not x.is_cuda or torch.version.hip:
        return "not an NVIDIA GPU tensor"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(x.device)} (the kernel is for sm_90)"
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        return f"{x.dtype} streams of shape {tuple(x.shape)} (bf16 [T, n, C] only)"
    shape = cluster_shape(x.shape[1], x.shape[2], update, iters)
    if shape.problem:
        return shape.problem
    if x.shape[0] > 65535 * shape.bt:
        return f"{x.shape[0]} tokens (at most {65535 * shape.bt}: one grid row a block)"
    if not all(_rows_ok(t) for t in (x, *tensors) if t is not None):
        return "a tensor whose rows are not 16-byte aligned with unit column stride"
    return import_problem()


_COMPILED: dict[tuple, Any] = {}


def _key(shape: Any) -> tuple:
    return shape.key  # cluster_shape._frozen_key


def _compiled(shape: Any) -> Any:
    key = _key(shape)
    fn = _COMPILED.get(key)
    if fn is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the MHC cluster kernel for this shape was not compiled before CUDA-graph capture; "
                               "call layer_boundary_mhc.cluster_ops.prepare_cluster first")
        if shape.split:
            from .cute_split import compile_split

            fn = _COMPILED[key] = compile_split(shape)
        elif shape.persistent:
            from .cute_persistent import compile_persistent

            fn = _COMPILED[key] = compile_persistent(shape)
        else:
            from .cute_cluster import compile_cluster

            fn = _COMPILED[key] = compile_cluster(shape)
    return fn


def prepare_cluster(n: int, hidden: int, *, iters: int = SINKHORN_ITERS) -> None:
    """Compile the read and update+read variants for (n, hidden) now (before CUDA-graph capture),
    with the Sinkhorn in the kernel and after it, and (on the current CUDA device) the Triton
    Sinkhorn that follows the latter; with ``PERSISTENT_TOKENS`` set, also the persistent variant
    where it fits, and the device's resident-cluster count it launches with; with ``SPLIT_TOKENS``
    set, the split variant where it fits."""
    for update in (False, True):
        for sinkhorn in (True, False):
            _compiled(cluster_shape(n, hidden, update, iters, sinkhorn))
        for first, variant in ((SPLIT_TOKENS, split_shape), (PERSISTENT_TOKENS, persistent_shape)):
            if first and not variant(n, hidden, update, iters).problem:
                _compiled(variant(n, hidden, update, iters))
    if torch.cuda.is_available():
        _sinkhorn_after(torch.zeros(1, n, n, device="cuda"), 1, n, iters)
        if SPLIT_TOKENS and SPLIT_KEPT_COUNTS:
            counts.reserve(torch.device("cuda", torch.cuda.current_device()))
        if PERSISTENT_TOKENS:
            _resident_clusters(torch.device("cuda"))


def launch(x: torch.Tensor, y: Optional[torch.Tensor], h_post: Optional[torch.Tensor], h_res: Optional[torch.Tensor],
           streams_out: Optional[torch.Tensor], phi: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor,
           b_post: torch.Tensor, b_res: torch.Tensor, norm_weight: torch.Tensor, out: torch.Tensor,
           h_post_out: torch.Tensor, h_res_out: torch.Tensor, eps: float, norm_eps: float, norm_offset: float,
           iters: int) -> None:
    """One launch on checked tensors (``cluster_problem`` is "" for them), on the current stream."""
    t, n, c = x.shape
    if t == 0:
        return
    update = y is not None
    shape = _variant(t, n, c, update, iters)
    fn = _compiled(shape)
    from .triton_ops import derived

    phf = derived(phi, ("fragments", n), lambda: phi_fragments(phi, n))
    w32 = derived(norm_weight, ("w32", norm_offset), lambda: (norm_weight.float() + norm_offset).contiguous())

    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    def ptr(v: Optional[torch.Tensor], like: torch.Tensor, align: int = 16) -> Any:
        v = like if v is None else v
        el = {torch.bfloat16: cutlass.BFloat16, torch.int64: cutlass.Int64, torch.int32: cutlass.Int32}.get(
            v.dtype, cutlass.Float32)
        return make_ptr(el, v.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    yy = y if update else x
    xo = streams_out if update else x
    if shape.persistent and update and n == 4:
        # The persistent variant copies these rows 16 bytes at a time (contiguous rows of 16 and
        # 64 bytes); a view that starts off a 16-byte boundary goes through an aligned copy.
        h_post = h_post if h_post.data_ptr() % 16 == 0 else h_post.clone()
        h_res = h_res if h_res.data_ptr() % 16 == 0 else h_res.clone()
    blocks = (t + shape.bt - 1) // shape.bt
    stream = torch.cuda.current_stream(x.device).cuda_stream  # the launch's, and its kept counts' key
    extra: list = []
    if shape.split:
        # Each block's partials ([block][CTA][token][K + 1]), per call, and its ready count: zeroed
        # per call, or from a buffer kept between launches (``counts``; cap: its half's counts).
        part = torch.empty(blocks * 16 * shape.bt * (shape.kpad + 1), dtype=torch.float32, device=x.device)
        cnt, cap = counts.counts(x.device, blocks, shape.kept, stream)
        grid = _split_grid(x.device, blocks)
        if PROFILE is not None and PROFILE.numel() < shape.profile_values(16 * grid[0] + grid[1], blocks, t):
            raise ValueError(f"cluster_ops.PROFILE holds {PROFILE.numel()} values; the profiled split variant "
                             f"writes SplitShape.profile_values(...) = "
                             f"{shape.profile_values(16 * grid[0] + grid[1], blocks, t)} for this call")
        extra = [ptr(part, part, 4), ptr(cnt, cnt, 4), t, blocks, *grid, cap]
    elif shape.persistent:
        extra = [t, blocks, min(blocks, _resident_clusters(x.device))]
    else:
        extra = [t, blocks]
    fn(ptr(x, x), ptr(yy, x), ptr(h_post, h_post_out, 4), ptr(h_res, h_res_out, 4), ptr(xo, x), ptr(phf, phf),
       ptr(alpha, alpha, 4), ptr(b_pre, b_pre, 4), ptr(b_post, b_post, 4), ptr(b_res, b_res, 4), ptr(w32, w32),
       ptr(out, out), ptr(h_post_out, h_post_out, 4), ptr(h_res_out, h_res_out, 4),
       ptr(PROFILE if PROFILE is not None else h_res_out, h_res_out), *extra,
       x.stride(0), x.stride(1), yy.stride(0), xo.stride(0), xo.stride(1), out.stride(0), eps, norm_eps,
       cuda.CUstream(stream))
    if not shape.sinkhorn and not shape.sinkhorn_lanes:
        _sinkhorn_after(h_res_out, t, n, iters)


def _sinkhorn_after(h_res: torch.Tensor, t: int, n: int, iters: int) -> None:
    import triton

    from .finish import sinkhorn_kernel

    sinkhorn_kernel[(triton.cdiv(t, SINKHORN_TOKENS),)](h_res, t, N=n, NP=triton.next_power_of_2(n),
                                                       TB=SINKHORN_TOKENS, ITERS=int(iters),
                                                       num_warps=SINKHORN_WARPS)


# Token counts whose update+read (UPDATE_READ_TOKENS) or read (READ_TOKENS) the Triton path hands
# to the cluster kernel when the caller leaves the launch form open (cooperative=None). H200, n = 4,
# H = 4096, bf16, CUDA graphs, against the form the Triton path would pick
# (benchmarks/results/2026-11-30-h200-session6.md):
# - update+read: T = 1 13.3 µs against 15.4 (one launch), 16 13.9 against 21.9, 128 15.0 against
#   29.7, 384 23.5 against 32.9; from 512 the Triton kernels are faster (38.8 against 39.7);
# - read: T = 1 10.8 against 15.6, 128 12.0 against 24.7, 384 17.3 against 26.0; 512 29.7 against
#   26.5.
UPDATE_READ_TOKENS = (1, 384)
READ_TOKENS = (1, 384)
_ELIGIBLE: dict[tuple, bool] = {}
_WARNED: set[tuple] = set()


def _eligible(x: torch.Tensor, update: bool, iters: int, shape: Any) -> bool:
    """Whether (device, the variant ``shape``) can take the cluster kernel: ``cluster_problem``, and
    a variant that compiles (here, outside any capture). A failure is a warning and the Triton
    kernels, never an error in the forward."""
    if cluster_problem(x, update=update, iters=iters):
        return False
    try:
        _compiled(shape)
        if shape.persistent and not shape.split:
            _resident_clusters(x.device)
    except Exception as e:  # a broken CuTe DSL install must not end the forward
        import warnings

        warnings.warn(f"MHC cluster kernel unavailable for n={x.shape[1]}, hidden={x.shape[2]} "
                      f"({type(e).__name__}: {e}); the Triton kernels serve these calls", stacklevel=4)
        return False
    return True


def takes(x: torch.Tensor, y: Optional[torch.Tensor], streams_out: Optional[torch.Tensor], out: torch.Tensor,
          iters: int) -> bool:
    """Whether an automatic launch-form choice sends this call to the cluster kernel: a token count
    in ``UPDATE_READ_TOKENS`` / ``READ_TOKENS`` (or an update+read of ``SPLIT_TOKENS`` or more whose
    split variant fits), aligned rows, and a (device, n, C, update) that
    ``cluster_problem`` accepts and whose variant compiles, decided on its first call. A first call
    inside a CUDA-graph capture cannot compile: it warns once and runs the Triton kernels, and the
    shape is decided again outside the capture. Past the first call: attribute reads and a
    dictionary lookup, no device query."""
    t = x.shape[0]
    update = y is not None
    lo, hi = UPDATE_READ_TOKENS if update else READ_TOKENS
    small = lo <= t <= hi
    large = bool(SPLIT_TOKENS) and t >= SPLIT_TOKENS
    if not (small or large) or x.dtype != torch.bfloat16 or not x.is_cuda:
        return False
    shape = _variant(t, x.shape[1], x.shape[2], update, iters)  # the variant launch() will run
    if not small and not shape.split:  # past the small sizes only the split variant beats Triton
        return False
    key = (x.device.index, _key(shape))
    ok = _ELIGIBLE.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing() and _key(shape) not in _COMPILED:
            if key not in _WARNED:
                _WARNED.add(key)
                import warnings

                warnings.warn(f"MHC cluster kernel for n={x.shape[1]}, hidden={x.shape[2]} not compiled before "
                              "CUDA-graph capture: this graph runs the Triton kernels; call "
                              "layer_boundary_mhc.cluster_ops.prepare_cluster(n, hidden) before capturing",
                              stacklevel=3)
            return False
        ok = _ELIGIBLE[key] = _eligible(x, update, iters, shape)
    return ok and all(_rows_ok(v) for v in (x, y, streams_out, out) if v is not None)


def mhc_read_cluster(
    x: torch.Tensor, params: Any, norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0,
    iters: int = SINKHORN_ITERS, out: Optional[torch.Tensor] = None, h_post: Optional[torch.Tensor] = None,
    h_res: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input [T, C], H_post [T, n], H_res [T, n, n])`` of streams ``x`` (``mhc_read_ref``)."""
    from .triton_ops import _boundary

    _, inp, hp, hr = _boundary(x, None, None, None, params, norm_weight, norm_eps, norm_offset, iters, None, None, out,
                               h_post, h_res, cluster=True)
    return inp, hp, hr


def mhc_update_read_cluster(
    x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, params: Any,
    norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0, iters: int = SINKHORN_ITERS,
    streams_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
    h_post_out: Optional[torch.Tensor] = None, h_res_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x', input, H_post', H_res')`` (``mhc_update_read_ref``) in one launch, x' never re-read."""
    from .triton_ops import _boundary

    streams, inp, hp, hr = _boundary(x, y, h_post, h_res, params, norm_weight, norm_eps, norm_offset, iters, None,
                                     streams_out, out, h_post_out, h_res_out, cluster=True)
    assert streams is not None
    return streams, inp, hp, hr
