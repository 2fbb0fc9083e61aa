"""The cluster kernel (``cute_cluster``, CuTe DSL): its launch, its shapes and why a call cannot take it.

Its callables with the references' signatures (``mhc_read_cluster``, ``mhc_update_read_cluster``)
live in ``triton_ops`` beside the Triton ones, whose checks and destinations they share; the
automatic launch form there sends calls here (``takes``), so this module imports nothing above it.

For bf16 streams ``[T, n, C]`` with ``2 <= n <= 4`` on Hopper (sm_90) GPUs where ``nvidia-cutlass-dsl``
imports; ``cluster_problem`` says why a call cannot take it (the Triton kernels then serve it).
Each (n, C, update) variant compiles once, on first use (about a second), never during CUDA-graph
capture: ``prepare_cluster`` compiles ahead. phi's bf16 fragments and the FP32 norm weight (with
its offset folded in, the sum the Triton finish computes per element) are made once per parameter
version, like the Triton kernels' phi split.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import counts
from .coefficients import SINKHORN_ITERS
from .config import DEFAULT_CONFIG, MhcKernelConfig
from .derived import derived

__all__ = ["cluster_problem", "cluster_shape", "import_problem",
           "phi_fragments", "prepare_cluster", "launch", "takes", "Dispatch", "persistent_shape", "split_shape"]

# What each variant measured, and why its default is what it is, is in ``MhcKernelConfig``'s field
# docstrings (``config``) and ``plugins/mhc/PERFORMANCE.md``. The variants, by token count of an
# open launch form (``takes``), at the default config:
# - the cluster kernel (``cute_cluster``) for 1 to 384 tokens (``update_read_tokens``,
#   ``read_tokens``): H200, n = 4, H = 4096, bf16, CUDA graphs, against the form the Triton path
#   would pick (benchmarks/results/2026-11-30-h200-session6.md): update+read T = 1 13.3 µs against
#   15.4, 128 15.0 against 29.7, 384 23.5 against 32.9; read T = 1 10.8 against 15.6, 128 12.0
#   against 24.7, 384 17.3 against 26.0. From 512 the Triton kernels are faster.
# - the split variant (``cute_split``) from 1024 tokens (``split_tokens``) where it fits (n = 2 to 4,
#   H up to 4096): update+read T = 1024 41.8 against 53.0 µs, 8192 227 / 311 (70.0 % of the
#   roofline), 32768 879 / 1192; read T = 1024 31.7 / 35.4, 8192 198 / 223, 32768 766 / 858
#   (benchmarks/results/2026-12-01-h200-session16.md; every MHC GPU test passed, 130).
# - the persistent variant (``cute_persistent``) only where ``persistent_tokens`` asks: it ties the
#   Triton two launches (T = 8192 309.8 against 309.4 µs, 32768 1203.3 against 1194.5).


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


def cluster_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS, sinkhorn: bool = True,
                  config: MhcKernelConfig = DEFAULT_CONFIG) -> Any:
    """The variant for these sizes (``cluster_shape.ClusterShape``; ``sinkhorn``: H_res's Sinkhorn in
    the kernel, else after it), or one whose ``problem`` says why none fits; planned once per sizes
    and config (every launch asks)."""
    key = ("cluster", n, hidden, update, iters, sinkhorn, config)
    shape = _SHAPES.get(key)
    if shape is None:
        shape = _SHAPES[key] = _plan(n, hidden, update, iters, sinkhorn, config)
    return shape


def _plan(n: int, hidden: int, update: bool, iters: int, sinkhorn: bool, config: MhcKernelConfig) -> Any:
    from .cluster_shape import ClusterShape

    c = config
    tries = [(c.cluster, c.cluster_block_tokens, c.cluster_warps, c.cluster_ctas, c.cluster_stages)]
    tries += [(cl, bt, 8, 1, 0) for cl in (c.cluster, 8) for bt in (64, 32, 16)]  # fallbacks of the default form
    shape = None
    for cl, bt, warps, ctas, stages in tries:
        shape = ClusterShape(n, hidden, cl, bt, update, iters, stages=stages, warps=warps, ctas=ctas,
                             sinkhorn=sinkhorn, push=c.push)
        if not shape.problem:
            return shape
    return shape


def persistent_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS,
                     config: MhcKernelConfig = DEFAULT_CONFIG) -> Any:
    """The persistent variant's shape (``cluster_shape.PersistentShape``; its ``problem`` says why
    it does not fit)."""
    key = ("persistent", n, hidden, update, iters, config.persistent_warps)
    shape = _SHAPES.get(key)
    if shape is None:
        from .cluster_shape import PersistentShape

        shape = _SHAPES[key] = PersistentShape(n, hidden, update, iters, warps=config.persistent_warps)
    return shape


def split_shape(n: int, hidden: int, update: bool, iters: int = SINKHORN_ITERS,
                config: MhcKernelConfig = DEFAULT_CONFIG) -> Any:
    """The split variant's shape (``cluster_shape.SplitShape``; its ``problem`` says why it does not
    fit)."""
    key = ("split", n, hidden, update, iters, config.persistent_warps, config.split_producers,
           config.split_produce_depth)
    shape = _SHAPES.get(key)
    if shape is None:
        from .cluster_shape import SplitShape

        shape = _SHAPES[key] = SplitShape(n, hidden, update, iters, warps=config.persistent_warps,
                                          producers=config.split_producers,
                                          produce_depth=config.split_produce_depth)
    return shape


def _variant(t: int, n: int, hidden: int, update: bool, iters: int, config: MhcKernelConfig = DEFAULT_CONFIG) -> Any:
    """The shape a call of ``t`` tokens runs."""
    for first, variant in ((config.split_tokens, split_shape), (config.persistent_tokens, persistent_shape)):
        if first and t >= first:
            shape = variant(n, hidden, update, iters, config)
            if not shape.problem:
                return shape
    return cluster_shape(n, hidden, update, iters, sinkhorn=t < config.sinkhorn_after_tokens, config=config)


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


def split_grid(sms: int, blocks: int, finishers: int) -> tuple[int, int]:
    """(sets of 16 stream CTAs, finisher CTAs) for the split variant on a GPU of ``sms`` SMs: one CTA
    an SM, at least ``finishers`` SMs left to the finisher CTAs, no more sets than blocks."""
    sets = max(1, min(blocks, (sms - finishers) // 16))
    return sets, max(1, sms - 16 * sets)


def _split_grid(device: torch.device, blocks: int, finishers: int) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return split_grid(sms, blocks, finishers)


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
                    iters: int = SINKHORN_ITERS, config: MhcKernelConfig = DEFAULT_CONFIG) -> str:
    """Why streams ``x`` (and the bf16 ``tensors``: y, destinations) cannot take the cluster kernel; ""
    when they can."""
    if not x.is_cuda or torch.version.hip:
        return "not an NVIDIA GPU tensor"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(x.device)} (the kernel is for sm_90)"
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        return f"{x.dtype} streams of shape {tuple(x.shape)} (bf16 [T, n, C] only)"
    shape = cluster_shape(x.shape[1], x.shape[2], update, iters, config=config)
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


def prepare_cluster(n: int, hidden: int, *, iters: int = SINKHORN_ITERS,
                    config: MhcKernelConfig = DEFAULT_CONFIG) -> None:
    """Compile the read and update+read variants for (n, hidden) now (before CUDA-graph capture),
    with the Sinkhorn in the kernel and after it, and (on the current CUDA device) the Triton
    Sinkhorn that follows the latter; with ``config.persistent_tokens`` set, also the persistent
    variant where it fits, and the device's resident-cluster count it launches with; with
    ``config.split_tokens`` set, the split variant where it fits, and its kept counts' pool."""
    for update in (False, True):
        for sinkhorn in (True, False):
            _compiled(cluster_shape(n, hidden, update, iters, sinkhorn, config))
        for first, variant in ((config.split_tokens, split_shape), (config.persistent_tokens, persistent_shape)):
            if first and not variant(n, hidden, update, iters, config).problem:
                _compiled(variant(n, hidden, update, iters, config))
    if torch.cuda.is_available():
        _sinkhorn_after(torch.zeros(1, n, n, device="cuda"), 1, n, iters, config)
        if config.split_tokens:
            counts.reserve(torch.device("cuda", torch.cuda.current_device()), config.split_captured_words)
        if config.persistent_tokens:
            _resident_clusters(torch.device("cuda"))


def launch(x: torch.Tensor, y: Optional[torch.Tensor], h_post: Optional[torch.Tensor], h_res: Optional[torch.Tensor],
           streams_out: Optional[torch.Tensor], phi: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor,
           b_post: torch.Tensor, b_res: torch.Tensor, norm_weight: torch.Tensor, out: torch.Tensor,
           h_post_out: torch.Tensor, h_res_out: torch.Tensor, eps: float, norm_eps: float, norm_offset: float,
           iters: int, config: MhcKernelConfig = DEFAULT_CONFIG) -> None:
    """One launch on checked tensors (``cluster_problem`` is "" for them), on the current stream."""
    t, n, c = x.shape
    if t == 0:
        return
    update = y is not None
    shape = _variant(t, n, c, update, iters, config)
    fn = _compiled(shape)
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

    if y is not None and (h_post is None or h_res is None or streams_out is None):
        raise ValueError("an update launch takes h_post, h_res and streams_out")
    yy = x if y is None else y
    xo = x if streams_out is None or y is None else streams_out
    if shape.persistent and h_post is not None and h_res is not None and update and n == 4:
        # The persistent variant copies these rows 16 bytes at a time (contiguous rows of 16 and
        # 64 bytes); a view that starts off a 16-byte boundary goes through an aligned copy.
        h_post = h_post if h_post.data_ptr() % 16 == 0 else h_post.clone()
        h_res = h_res if h_res.data_ptr() % 16 == 0 else h_res.clone()
    blocks = (t + shape.bt - 1) // shape.bt
    stream = torch.cuda.current_stream(x.device).cuda_stream  # the launch's, and its kept counts' key
    extra: list = []
    if shape.split:
        # Each block's partials ([block][CTA][token][K + 1]), per call, and its ready count, from a
        # buffer kept between launches (``counts``; cap: its half's counts).
        part = torch.empty(blocks * 16 * shape.bt * (shape.kpad + 1), dtype=torch.float32, device=x.device)
        cnt, cap = counts.counts(x.device, blocks, config.split_captured_words, stream)
        grid = _split_grid(x.device, blocks, config.split_finishers)
        extra = [ptr(part, part, 4), ptr(cnt, cnt, 4), t, blocks, *grid, cap]
    elif shape.persistent:
        extra = [t, blocks, min(blocks, _resident_clusters(x.device))]
    else:
        extra = [t, blocks]
    fn(ptr(x, x), ptr(yy, x), ptr(h_post, h_post_out, 4), ptr(h_res, h_res_out, 4), ptr(xo, x), ptr(phf, phf),
       ptr(alpha, alpha, 4), ptr(b_pre, b_pre, 4), ptr(b_post, b_post, 4), ptr(b_res, b_res, 4), ptr(w32, w32),
       ptr(out, out), ptr(h_post_out, h_post_out, 4), ptr(h_res_out, h_res_out, 4),
       *extra,
       x.stride(0), x.stride(1), yy.stride(0), xo.stride(0), xo.stride(1), out.stride(0), eps, norm_eps,
       cuda.CUstream(stream))
    if not shape.sinkhorn and not shape.sinkhorn_lanes:
        _sinkhorn_after(h_res_out, t, n, iters, config)


def _sinkhorn_after(h_res: torch.Tensor, t: int, n: int, iters: int, config: MhcKernelConfig) -> None:
    import triton

    from .finish import sinkhorn_kernel

    sinkhorn_kernel[(triton.cdiv(t, config.sinkhorn_tokens),)](h_res, t, N=n, NP=triton.next_power_of_2(n),
                                                              TB=config.sinkhorn_tokens, ITERS=int(iters),
                                                              num_warps=config.sinkhorn_warps)


class Dispatch:
    """The open launch form's choice (``takes``), with what it asks of the device and the compiler as
    parameters: the module's instance asks the real ones (``cluster_problem``, the compile cache,
    row alignment, CUDA-graph capture); the CPU tests stand them in. Decisions are cached per
    (device, variant): past a call's first, attribute reads and a dictionary lookup."""

    def __init__(self, problem: Optional[Callable[..., str]] = None, compile: Optional[Callable[[Any], Any]] = None,
                 rows_ok: Optional[Callable[[Any], bool]] = None,
                 capturing: Optional[Callable[[], bool]] = None) -> None:
        self._problem = problem or cluster_problem
        self._compile = compile or _compiled
        self._rows_ok = rows_ok or _rows_ok
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._eligible: dict[tuple, bool] = {}
        self._warned: set[tuple] = set()

    def eligible(self, x: torch.Tensor, update: bool, iters: int, shape: Any, config: MhcKernelConfig) -> bool:
        """Whether (device, the variant ``shape``) can take the cluster kernel: ``cluster_problem``,
        and a variant that compiles (here, outside any capture). A failure is a warning and the
        Triton kernels, never an error in the forward."""
        if self._problem(x, update=update, iters=iters, config=config):
            return False
        try:
            self._compile(shape)
            if shape.persistent and not shape.split:
                _resident_clusters(x.device)
        except Exception as e:  # a broken CuTe DSL install must not end the forward
            import warnings

            warnings.warn(f"MHC cluster kernel unavailable for n={x.shape[1]}, hidden={x.shape[2]} "
                          f"({type(e).__name__}: {e}); the Triton kernels serve these calls", stacklevel=5)
            return False
        return True

    def takes(self, x: torch.Tensor, y: Optional[torch.Tensor], streams_out: Optional[torch.Tensor],
              out: torch.Tensor, iters: int, config: MhcKernelConfig = DEFAULT_CONFIG) -> bool:
        """See the module-level ``takes``."""
        t = x.shape[0]
        update = y is not None
        lo, hi = config.update_read_tokens if update else config.read_tokens
        small = lo <= t <= hi
        large = bool(config.split_tokens) and t >= config.split_tokens
        if not (small or large) or x.dtype != torch.bfloat16 or not x.is_cuda:
            return False
        shape = _variant(t, x.shape[1], x.shape[2], update, iters, config)  # the variant launch() will run
        if not small and not shape.split:  # past the small sizes only the split variant beats Triton
            return False
        key = (x.device.index, _key(shape))
        ok = self._eligible.get(key)
        if ok is None:
            if self._capturing() and _key(shape) not in _COMPILED:
                if key not in self._warned:
                    self._warned.add(key)
                    import warnings

                    warnings.warn(f"MHC cluster kernel for n={x.shape[1]}, hidden={x.shape[2]} not compiled before "
                                  "CUDA-graph capture: this graph runs the Triton kernels; call "
                                  "layer_boundary_mhc.cluster_ops.prepare_cluster(n, hidden) before capturing",
                                  stacklevel=4)
                return False
            ok = self._eligible[key] = self.eligible(x, update, iters, shape, config)
        return ok and all(self._rows_ok(v) for v in (x, y, streams_out, out) if v is not None)


_DISPATCH = Dispatch()


def takes(x: torch.Tensor, y: Optional[torch.Tensor], streams_out: Optional[torch.Tensor], out: torch.Tensor,
          iters: int, config: MhcKernelConfig = DEFAULT_CONFIG) -> bool:
    """Whether an automatic launch-form choice sends this call to the cluster kernel: a token count
    in ``config.update_read_tokens`` / ``read_tokens`` (or a call of ``config.split_tokens`` or more
    whose split variant fits), aligned rows, and a (device, n, C, update) that
    ``cluster_problem`` accepts and whose variant compiles, decided on its first call. A first call
    inside a CUDA-graph capture cannot compile: it warns once and runs the Triton kernels, and the
    shape is decided again outside the capture."""
    return _DISPATCH.takes(x, y, streams_out, out, iters, config)
