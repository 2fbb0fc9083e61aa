"""The MHC read and update as torch functions: the meaning every faster kernel keeps.

For streams ``x [T, n, C]``, a stage output ``y [T, C]`` and an RMSNorm ``(w, eps, offset)``::

    mhc_read_ref(x, params, w, eps)
        (H_pre, H_post, H_res) = mhc_coefficients(x, params)        FP32
        input = RMSNorm(sum_j H_pre[j] x_j) * (w + offset)         FP32, rounded once
        -> (input [T, C], H_post [T, n], H_res [T, n, n])

    mhc_update_ref(x, y, H_post, H_res)
        x'_i = sum_j H_res[i, j] x_j + H_post[i] y                 FP32, rounded once
        -> x' [T, n, C]

    mhc_update_read_ref(x, y, H_post, H_res, params, w, eps)
        x' = mhc_update_ref(...); (input, H_post', H_res') = mhc_read_ref(x', ...)
        -> (x', input, H_post', H_res')

The read sees the *rounded* streams ``x'``, as a stage that stores the streams and reads them
later does. FP64 streams are computed in FP64 throughout. The Triton kernels
(``layer_boundary_mhc.triton_ops``) have these signatures; ``out=``-style destinations are
filled and returned.
"""

from __future__ import annotations

from typing import Optional

import torch

from layer_boundary.plugin_api import rmsnorm_ref

from .coefficients import SINKHORN_ITERS, acc_dtype, mhc_coefficients
from .params import MhcStageParams

__all__ = ["mhc_combine_ref", "mhc_read_ref", "mhc_update_ref", "mhc_update_read_ref"]


def _into(dest: Optional[torch.Tensor], value: torch.Tensor, what: str) -> torch.Tensor:
    if dest is None:
        return value
    if tuple(dest.shape) != tuple(value.shape):  # copy_ would broadcast into a larger tensor
        raise ValueError(f"{what} has shape {tuple(dest.shape)}; expected {tuple(value.shape)}")
    dest.copy_(value)
    return dest


def _check_streams(x: torch.Tensor, params: MhcStageParams) -> None:
    """Streams ``[T, n, C]`` of a floating dtype, with the n and C the parameters were made for."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"MHC streams must be a floating-point [T, n, C] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                         f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
    if (x.shape[1], x.shape[2]) != (params.n, params.hidden_size):
        raise ValueError(f"MHC streams [T, {x.shape[1]}, {x.shape[2]}] do not fit parameters made for n = "
                         f"{params.n} streams of hidden size {params.hidden_size}")
    params.check(x.dtype)


def _check_update(x: Optional[torch.Tensor], y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> None:
    """y ``[T, C]``, H_post ``[T, n]`` and H_res ``[T, n, n]`` of the streams' T, n and C (no
    broadcasting: a row of another token is a bug, not a shorthand)."""
    t, n = h_post.shape[0] if h_post.dim() == 2 else -1, h_post.shape[-1]
    c = y.shape[-1]
    if x is not None:
        if x.dim() != 3:
            raise ValueError(f"MHC streams must be [T, n, C], got {tuple(x.shape)}")
        t, n, c = x.shape
    want = {"y": (t, c), "h_post": (t, n), "h_res": (t, n, n)}
    for name, v in (("y", y), ("h_post", h_post), ("h_res", h_res)):
        if tuple(v.shape) != want[name]:
            raise ValueError(f"MHC update: {name} has shape {tuple(v.shape)}, expected {want[name]} "
                             f"(T = {t} tokens, n = {n} streams, C = {c})")


def mhc_combine_ref(
    x: torch.Tensor, params: MhcStageParams, iters: int = SINKHORN_ITERS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum_j H_pre[j] x_j [T, C], H_post, H_res)`` of streams ``x``; the combination is left in
    the accumulation dtype, for the stage's norm to round once."""
    _check_streams(x, params)
    h_pre, h_post, h_res = mhc_coefficients(x, params, iters)
    mixed = (h_pre.unsqueeze(1) @ x.to(acc_dtype(x.dtype))).squeeze(1)
    return mixed, h_post, h_res


def mhc_read_ref(
    x: torch.Tensor,
    params: MhcStageParams,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    norm_offset: float = 0.0,
    iters: int = SINKHORN_ITERS,
    out: Optional[torch.Tensor] = None,
    h_post: Optional[torch.Tensor] = None,
    h_res: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input, H_post, H_res)`` of streams ``x [T, n, C]`` (see the module docstring)."""
    mixed, hp, hr = mhc_combine_ref(x, params, iters)
    inp = rmsnorm_ref(mixed, norm_weight, norm_eps, weight_offset=norm_offset).to(x.dtype)
    return _into(out, inp, "out"), _into(h_post, hp, "h_post"), _into(h_res, hr, "h_res")


def mhc_update_ref(
    x: Optional[torch.Tensor],
    y: torch.Tensor,
    h_post: torch.Tensor,
    h_res: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``H_res x + H_post^T y`` accumulated in the coefficients' dtype, rounded once to the
    streams' dtype; ``x=None`` (no streams yet) gives ``H_post^T y`` in ``y``'s dtype."""
    _check_update(x, y, h_post, h_res)
    acc = h_res.dtype
    new = h_post.unsqueeze(-1) * y.to(acc).unsqueeze(1)  # [T, n, C]
    if x is None:
        return _into(out, new.to(y.dtype), "out")
    return _into(out, torch.baddbmm(new, h_res, x.to(acc)).to(x.dtype), "out")


def mhc_update_read_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    h_post: torch.Tensor,
    h_res: torch.Tensor,
    params: MhcStageParams,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    norm_offset: float = 0.0,
    iters: int = SINKHORN_ITERS,
    streams_out: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    h_post_out: Optional[torch.Tensor] = None,
    h_res_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x', input, H_post', H_res')``: the producer's update, then this stage's read of the
    rounded streams."""
    streams = mhc_update_ref(x, y, h_post, h_res, out=streams_out)
    inp, hp, hr = mhc_read_ref(streams, params, norm_weight, norm_eps, norm_offset=norm_offset, iters=iters,
                               out=out, h_post=h_post_out, h_res=h_res_out)
    return streams, inp, hp, hr
