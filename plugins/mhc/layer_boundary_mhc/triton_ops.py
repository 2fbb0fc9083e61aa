"""The MHC Triton kernels as callables with the references' signatures, and the ``torch.library``
operators that carry them through ``torch.compile``.

| callable                    | reference               | returns                          |
| --------------------------- | ----------------------- | -------------------------------- |
| ``mhc_read_triton``         | ``mhc_read_ref``        | (input, H_post, H_res)           |
| ``mhc_update_triton``       | ``mhc_update_ref``      | x'                               |
| ``mhc_update_read_triton``  | ``mhc_update_read_ref`` | (x', input, H_post', H_res')     |
| ``mhc_read_cluster``        | ``mhc_read_ref``        | (input, H_post, H_res)           |
| ``mhc_update_read_cluster`` | ``mhc_update_read_ref`` | (x', input, H_post', H_res')     |

The ``*_cluster`` callables launch the cluster kernel (``cluster_ops``, CuTe DSL, Hopper) in the
variant ``config`` picks, or refuse with its reason where it cannot run.

Streams ``x [T, n, C]`` (any strides; a column stride of 1 is the fast path) and the stage
output ``y [T, C]`` are bf16, fp16 or fp32 of one dtype, ``n <= 8``; coefficients are FP32
``[T, n]`` and ``[T, n, n]``; the norm is an RMSNorm given as ``(weight, eps, offset)``.
Destinations (``out=``, ...) are written and returned; missing ones are allocated contiguous.

Eager calls launch the kernels directly (the dispatcher costs more than a decode-sized kernel);
under ``torch.compile`` they call ``layer_boundary_mhc::boundary`` / ``::update``, opaque custom
operators (the vendor SDK's ``kernel_op``) whose schemas declare the destinations they write (the
registration says why not ``triton_op``). Each call allocates its workspace (FP32 partial sums, and
for the cooperative launch a zeroed counter per token block) from the caching allocator, which a
CUDA graph captures like any other allocation, and never synchronizes with the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from layer_boundary.plugin_api import kernel_op

from .accuracy import TOLERANCE  # re-exported: the kernels' tolerances live with their comparison
from .coefficients import SINKHORN_ITERS, check_iters
from .config import DEFAULT_CONFIG, MhcKernelConfig
from .derived import derived
from .projection import bf16_parts
from .triton_mhc import (
    CASTS,
    CASTS_PURE,
    COOPERATIVE,
    FINISH,
    INTERPRETED,
    MAX_STREAMS,
    STREAM_PASS,
    boundary_config,
    coefficient_columns,
    mhc_boundary_kernel,
    mhc_update_kernel,
    padded_streams,
    phi_parts,
    update_config,
)

if TYPE_CHECKING:
    from .params import MhcStageParams

__all__ = [
    "mhc_read_triton",
    "mhc_update_triton",
    "mhc_update_read_triton",
    "mhc_read_cluster",
    "mhc_update_read_cluster",
    "SUPPORTED_DTYPES",
    "TOLERANCE",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Which kernel a boundary call runs: the Triton form ``cooperative`` says, the cluster kernel where
# it takes the call (an open launch form), or the cluster kernel as asked (``cluster_ops``).
FORM_TRITON, FORM_AUTO, FORM_CLUSTER = 0, 1, 2
# The configs calls have used, by index: a config crosses the torch.library operator (whose schema
# takes no Python objects) as its index here. A handful a process; kept for its life.
_CONFIG_INDEX: dict[MhcKernelConfig, int] = {DEFAULT_CONFIG: 0}
_CONFIGS_BY_INDEX: list[MhcKernelConfig] = [DEFAULT_CONFIG]


def _config_index(config: MhcKernelConfig) -> int:
    index = _CONFIG_INDEX.get(config)
    if index is None:
        index = _CONFIG_INDEX[config] = len(_CONFIGS_BY_INDEX)
        _CONFIGS_BY_INDEX.append(config)
    return index


# -- launches (shared by the eager path and the operators) -----------------------------------------

def _launch_boundary(
    kernel: Any, x: torch.Tensor, y: Optional[torch.Tensor], h_post: Optional[torch.Tensor],
    h_res: Optional[torch.Tensor], streams_out: Optional[torch.Tensor], phi: torch.Tensor, phi_split: torch.Tensor,
    alpha: torch.Tensor,
    b_pre: torch.Tensor, b_post: torch.Tensor, b_res: torch.Tensor, norm_weight: torch.Tensor,
    out: torch.Tensor, h_post_out: torch.Tensor, h_res_out: torch.Tensor,
    eps: float, norm_eps: float, norm_offset: float, iters: int, cooperative: bool,
    config: MhcKernelConfig = DEFAULT_CONFIG,
) -> None:
    tokens, n, hidden = x.shape
    if tokens == 0:
        return  # an empty grid is not a valid launch
    hidden = int(hidden)  # constexpr: pins the width (the parameters fix it anyway)
    cfg = boundary_config(tokens, n, hidden, x.element_size(), x.dtype == torch.bfloat16, config)
    k, kp = coefficient_columns(n)
    blocks = cfg.blocks(tokens)
    part = torch.empty((blocks * cfg.block_tokens, cfg.slices, kp), dtype=torch.float32, device=x.device)
    update = y is not None
    # Placeholders the kernel never touches are a tensor of their own, never the workspace: where
    # launches are traced and functionalized (torch.library.triton_op, which these operators no
    # longer are: see their registration), an argument aliasing the workspace can stand for its written value.
    unused = torch.empty(1, dtype=torch.float32, device=x.device)
    if y is not None:
        if streams_out is None:
            raise ValueError("an update launch takes streams_out")
        y_strides, so_strides = y.stride(), streams_out.stride()
    else:
        y, h_post, h_res, streams_out = unused, unused, unused, unused
        y_strides, so_strides = (0, 0), (0, 0, 0)
    if phi_split is phi:  # not read by this launch shape
        phi_split = unused
    counters = torch.zeros(blocks + 1, dtype=torch.int32, device=x.device) if cooperative else unused
    args = (
        x, y, h_post, h_res, streams_out, phi, phi_split, alpha, b_pre, b_post, b_res, norm_weight,
        out, h_post_out, h_res_out, part, counters,
        tokens, blocks, cfg.lag_for(tokens),
        x.stride(0), x.stride(1), x.stride(2), *y_strides, *so_strides,
        norm_weight.stride(0), out.stride(0), out.stride(1),
        eps, norm_eps, norm_offset,
    )
    meta = dict(
        N=n, NP=padded_streams(n), K=k, KP=kp, C=hidden, CP=cfg.row_tile, S=cfg.slices, SB=cfg.slice_batch(kp),
        CS=cfg.slice_cols, BT=cfg.block_tokens, BC=cfg.block_cols, STAGES=cfg.stages, TB=cfg.finish_tokens, RB=cfg.finishers,
        ITERS=int(iters), UPDATE=update, SPLIT_A=x.dtype == torch.float32, PRESPLIT=cfg.presplit,
        CHUNKED=cfg.chunked, CASTS=CASTS_PURE if cfg.joined else CASTS,
        JOINED=cfg.joined, FR=cfg.finish_rows,
        LOADS="evict_first" if cfg.evict else "", KEEP="evict_last" if cfg.evict else "", SKIP_TAIL=cfg.skip_tail,
        num_warps=cfg.num_warps,
    )
    if cfg.max_registers and not INTERPRETED:
        meta["maxnreg"] = cfg.max_registers
    if cooperative:
        kernel[(cfg.grid(tokens, COOPERATIVE),)](*args, MODE=COOPERATIVE, **meta)
    else:
        kernel[(cfg.grid(tokens, STREAM_PASS),)](*args, MODE=STREAM_PASS, **meta)
        # A launch of its own: the finish's program size, and no cap made for two stream passes an SM.
        meta.pop("maxnreg", None)
        kernel[(cfg.grid(tokens, FINISH),)](*args, MODE=FINISH, **dict(meta, num_warps=cfg.finish_warps))


def _launch_update(kernel: Any, x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
                   out: torch.Tensor) -> None:
    tokens, n, hidden = x.shape
    if tokens == 0:
        return
    hidden = int(hidden)
    bt, bc, warps = update_config(n, hidden, x.element_size())
    grid = ((tokens + bt - 1) // bt, (hidden + bc - 1) // bc)
    kernel[grid](
        x, y, h_post, h_res, out, tokens,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), out.stride(0), out.stride(1), out.stride(2),
        N=n, C=hidden, BT=bt, BC=bc, CASTS=CASTS_PURE, num_warps=warps,
    )


# -- the operators ----------------------------------------------------------------------------------

def _boundary_body(
    x: torch.Tensor, y: Optional[torch.Tensor], h_post: Optional[torch.Tensor], h_res: Optional[torch.Tensor],
    phi: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor, b_post: torch.Tensor,
    b_res: torch.Tensor, norm_weight: torch.Tensor, eps: float, norm_eps: float, norm_offset: float, iters: int,
    cooperative: bool, form: int, config_index: int,
    streams_out: Optional[torch.Tensor], out: torch.Tensor, h_post_out: torch.Tensor, h_res_out: torch.Tensor,
) -> None:
    # FORM_AUTO: the caller left the launch form open, and the cluster kernel (CuTe DSL, Hopper)
    # takes the sizes where it is faster and where it imports; FORM_CLUSTER: the caller asked for
    # it. Decided here, on the real tensors: under torch.compile this body runs at run time.
    config = _CONFIGS_BY_INDEX[config_index]
    if form == FORM_CLUSTER or (form == FORM_AUTO and _cluster_takes(x, y, streams_out, out, iters, config)):
        from . import cluster_ops

        if form == FORM_CLUSTER:
            problem = cluster_ops.cluster_problem(x, y, streams_out, out, update=y is not None, iters=iters,
                                                  config=config)
            if problem:
                raise ValueError(f"the MHC cluster kernel cannot take this call: {problem}")
        cluster_ops.launch(x, y, h_post, h_res, streams_out, phi, alpha, b_pre, b_post, b_res, norm_weight, out,
                           h_post_out, h_res_out, eps, norm_eps, norm_offset, iters, config)
        return
    _launch_boundary(mhc_boundary_kernel, x, y, h_post, h_res, streams_out, phi, _split_for(phi, x, config), alpha,
                     b_pre, b_post, b_res, norm_weight, out, h_post_out, h_res_out, eps, norm_eps, norm_offset, iters,
                     cooperative, config)


def _cluster_takes(x: torch.Tensor, y: Optional[torch.Tensor], streams_out: Optional[torch.Tensor],
                   out: torch.Tensor, iters: int, config: MhcKernelConfig) -> bool:
    if INTERPRETED or not x.is_cuda or torch.version.hip:
        return False
    from . import cluster_ops

    return cluster_ops.takes(x, y, streams_out, out, iters, config)


def _update_body(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
                 out: torch.Tensor) -> None:
    _launch_update(mhc_update_kernel, x, y, h_post, h_res, out)


# Opaque to the compiler: the body runs as in eager mode, its launches and workspaces included, and
# eager calls are the plain bodies (kernel_op puts the operator in their place only under
# torch.compile). torch.library.triton_op (the body traced into the graph, the launches
# functionalized) gave wrong inputs on an H200 (torch 2.11, Triton 3.6: the finishes read garbage
# partial sums at T = 64), and copies every argument of a kernel holding impure inline assembly,
# which its analysis of the written arguments cannot read.
kernel_op("boundary", _boundary_body, mutates=("streams_out", "out", "h_post_out", "h_res_out"))
kernel_op("update", _update_body, mutates=("out",))


# -- checks (a few attribute reads a call) ------------------------------------------------------------

def one_launch(tokens: int, cooperative: Optional[bool], config: MhcKernelConfig = DEFAULT_CONFIG) -> bool:
    """Whether a call runs the Triton kernels as one launch: as the caller says, else up to
    ``config.cooperative_tokens`` tokens (two launches were faster above on an H200)."""
    return tokens <= config.cooperative_tokens if cooperative is None else cooperative


def _check_streams(x: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"the MHC kernels take streams [tokens, n, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"the MHC Triton kernels take bf16, fp16 or fp32 streams, got {x.dtype}; FP64 would be "
            "rounded by their FP32 accumulation: use layer_boundary_mhc.reference for it"
        )
    t, n, c = x.shape
    if n > MAX_STREAMS:
        raise ValueError(f"the MHC Triton kernels take at most {MAX_STREAMS} streams, got n={n}; use the torch "
                         "reference (MhcSemantics(kernels='torch'))")
    return t, n, c


def _check_shape(t: Optional[torch.Tensor], shape: tuple[int, ...], what: str,
                 dtype: Optional[torch.dtype] = None) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{what} has dtype {t.dtype}; expected {dtype}")


def _check_update(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> None:
    t, n, c = x.shape
    _check_shape(y, (t, c), "the stage output y", x.dtype)
    _check_shape(h_post, (t, n), "H_post", torch.float32)
    _check_shape(h_res, (t, n, n), "H_res", torch.float32)


def _param_tensors(params: MhcStageParams, x: torch.Tensor,
                   config: MhcKernelConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, ...]:
    """``(phi, phi's split for the launch shape of streams x, alpha, b_pre, b_post, b_res)``."""
    phi, *rest = _checked_params(params, x)
    return (phi, _split_for(phi, x, config), *rest)


def _checked_params(params: MhcStageParams, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(phi, alpha, b_pre, b_post, b_res)`` of ``params``, checked against streams ``x``."""
    t, n, c = x.shape
    k, _ = coefficient_columns(n)
    if params.n != n or params.hidden_size != c:
        raise ValueError(f"the MHC parameters are for n={params.n}, hidden={params.hidden_size}; the streams "
                         f"have n={n}, hidden={c}")
    if params.phi.dtype != torch.float32:
        raise TypeError(f"the MHC Triton kernels take FP32 parameters, got {params.phi.dtype}")
    _check_shape(params.phi, (n * c, k), "phi")
    # Indexed as contiguous by the kernels (a no-op for the usual parameters): phi's row stride is
    # then the constant K, which lets its rows load as 16-byte vectors.
    return (params.phi.contiguous(), params.alpha.contiguous(), params.b_pre.contiguous(),
            params.b_post.contiguous(), params.b_res.contiguous())


def _split_for(phi: torch.Tensor, x: torch.Tensor, config: MhcKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """phi's split that the launch shape of streams ``x`` reads (phi itself where it reads none)."""
    t, n, c = x.shape
    cfg = boundary_config(max(int(t), 1), n, int(c), x.element_size(), x.dtype == torch.bfloat16, config)
    if cfg.joined:
        return _phi_split(phi, ("bf16", n, padded_streams(n), coefficient_columns(n)[1]))
    if cfg.presplit:
        return _phi_split(phi, ("tf32",))
    return phi


def _split(phi: torch.Tensor, kind: tuple) -> torch.Tensor:
    return phi_parts(phi) if kind[0] == "tf32" else bf16_parts(phi, *kind[1:])


def _phi_split(phi: torch.Tensor, kind: tuple) -> torch.Tensor:
    return derived(phi, kind, lambda: _split(phi, kind))


def _dest(t: Optional[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor,
          what: str) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    _check_shape(t, shape, what, dtype)
    return t


def _coefficient_dest(t: Optional[torch.Tensor], shape: tuple[int, ...], like: torch.Tensor,
                      what: str) -> torch.Tensor:
    # The kernels write coefficients as contiguous rows.
    t = _dest(t, shape, torch.float32, like, what)
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return t


def _boundary(x: torch.Tensor, y: Optional[torch.Tensor], h_post: Optional[torch.Tensor],
              h_res: Optional[torch.Tensor], params: MhcStageParams, norm_weight: torch.Tensor, norm_eps: float,
              norm_offset: float, iters: int, cooperative: Optional[bool], streams_out: Optional[torch.Tensor],
              out: Optional[torch.Tensor], h_post_out: Optional[torch.Tensor], h_res_out: Optional[torch.Tensor],
              config: MhcKernelConfig, cluster: bool = False,
              ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks, destinations and the launch of every public callable here and in ``cluster_ops``
    (``cluster``: the cluster kernel, refused with its reason where it cannot run)."""
    t, n, c = _check_streams(x)
    check_iters(iters)
    phi, alpha, b_pre, b_post, b_res = _checked_params(params, x)
    _check_shape(norm_weight, (c,), "the norm weight")
    if y is not None:
        if h_post is None or h_res is None:
            raise ValueError("an update takes H_post and H_res with the stage output y")
        _check_update(x, y, h_post, h_res)
        h_post, h_res = h_post.contiguous(), h_res.contiguous()
        streams_out = _dest(streams_out, (t, n, c), x.dtype, x, "streams_out")
    out = _dest(out, (t, c), x.dtype, x, "out")
    h_post_out = _coefficient_dest(h_post_out, (t, n), x, "h_post")
    h_res_out = _coefficient_dest(h_res_out, (t, n, n), x, "h_res")
    eps = float(params.eps)
    form = FORM_CLUSTER if cluster else FORM_AUTO if cooperative is None else FORM_TRITON
    cooperative = one_launch(t, cooperative, config)
    _boundary_body(x, y, h_post, h_res, phi, alpha, b_pre, b_post, b_res, norm_weight, eps, float(norm_eps),
                   float(norm_offset), int(iters), cooperative, form, _config_index(config), streams_out, out,
                   h_post_out, h_res_out)
    return streams_out, out, h_post_out, h_res_out


# -- public callables: the references' signatures ----------------------------------------------------

def mhc_read_triton(
    x: torch.Tensor, params: MhcStageParams, norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0,
    iters: int = SINKHORN_ITERS, out: Optional[torch.Tensor] = None, h_post: Optional[torch.Tensor] = None,
    h_res: Optional[torch.Tensor] = None, cooperative: Optional[bool] = None,
    config: MhcKernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input [T, C], H_post [T, n], H_res [T, n, n])`` of streams ``x`` (``mhc_read_ref``).
    ``cooperative=False`` runs the stream passes and the finishes as two launches, ``True`` as one;
    ``None`` picks one launch up to ``config.cooperative_tokens`` tokens, two above (faster
    there on an H200), and on Hopper, where the CuTe DSL imports, the cluster kernels for the
    token counts ``config`` hands them (``cluster_ops.takes``). The two Triton forms give the same
    bits; the cluster kernels agree within the tolerance table. ``config``: the launch shapes
    (``MhcKernelConfig``)."""
    _, inp, hp, hr = _boundary(x, None, None, None, params, norm_weight, norm_eps, norm_offset, iters,
                               cooperative, None, out, h_post, h_res, config)
    return inp, hp, hr


def mhc_update_read_triton(
    x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, params: MhcStageParams,
    norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0, iters: int = SINKHORN_ITERS,
    streams_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
    h_post_out: Optional[torch.Tensor] = None, h_res_out: Optional[torch.Tensor] = None,
    cooperative: Optional[bool] = None, config: MhcKernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x', input, H_post', H_res')``: the producer's update ``x' = H_res x + H_post^T y`` and this
    stage's read of the rounded ``x'``, fused (``mhc_update_read_ref``); ``cooperative`` and
    ``config`` as for ``mhc_read_triton``."""
    streams, inp, hp, hr = _boundary(x, y, h_post, h_res, params, norm_weight, norm_eps, norm_offset, iters,
                                     cooperative, streams_out, out, h_post_out, h_res_out, config)
    assert streams is not None
    return streams, inp, hp, hr


def mhc_update_triton(
    x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x' = H_res x + H_post^T y`` in FP32, rounded once to the streams' dtype (``mhc_update_ref``
    with streams)."""
    t, n, c = _check_streams(x)
    _check_update(x, y, h_post, h_res)
    h_post, h_res = h_post.contiguous(), h_res.contiguous()
    out = _dest(out, (t, n, c), x.dtype, x, "out")
    _update_body(x, y, h_post, h_res, out)
    return out


# -- the cluster kernel (cluster_ops) through the same checks and destinations --------------------


def mhc_read_cluster(
    x: torch.Tensor, params: MhcStageParams, norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0,
    iters: int = SINKHORN_ITERS, out: Optional[torch.Tensor] = None, h_post: Optional[torch.Tensor] = None,
    h_res: Optional[torch.Tensor] = None, config: MhcKernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input [T, C], H_post [T, n], H_res [T, n, n])`` of streams ``x`` (``mhc_read_ref``); the
    variant ``config`` picks for this token count."""
    _, inp, hp, hr = _boundary(x, None, None, None, params, norm_weight, norm_eps, norm_offset, iters, None, None, out,
                               h_post, h_res, config, cluster=True)
    return inp, hp, hr


def mhc_update_read_cluster(
    x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, params: MhcStageParams,
    norm_weight: torch.Tensor, norm_eps: float, *, norm_offset: float = 0.0, iters: int = SINKHORN_ITERS,
    streams_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
    h_post_out: Optional[torch.Tensor] = None, h_res_out: Optional[torch.Tensor] = None,
    config: MhcKernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x', input, H_post', H_res')`` (``mhc_update_read_ref``) in one launch, x' never re-read;
    the variant ``config`` picks for this token count."""
    streams, inp, hp, hr = _boundary(x, y, h_post, h_res, params, norm_weight, norm_eps, norm_offset, iters, None,
                                     streams_out, out, h_post_out, h_res_out, config, cluster=True)
    assert streams is not None
    return streams, inp, hp, hr
