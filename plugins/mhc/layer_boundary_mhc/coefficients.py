"""MHC coefficients of one stage invocation, computed from its input streams.

For streams ``x [T, n, C]`` (per token)::

    x~      = flat(x) / sqrt(mean(flat(x)^2) + eps)            flat(x): [T, n*C], no weight
    H_pre   = sigmoid(alpha_pre  * (x~ phi_pre) + b_pre)         [T, n]
    H_post  = 2 sigmoid(alpha_post * (x~ phi_post) + b_post)     [T, n]
    H_res   = Sinkhorn(alpha_res * mat(x~ phi_res) + b_res)      [T, n, n], doubly stochastic

``mat`` is row-major (``H~_res[i, j] = v[i*n + j]``), and ``H_res`` is applied as
``x'_i = sum_j H_res[i, j] x_j``. Every step runs in FP32 (FP64 for FP64 streams), whatever the
activation dtype: the Sinkhorn normalizations and the sigmoids lose too much in 16 bits.
"""

from __future__ import annotations

import torch

from .params import MhcStageParams

__all__ = ["acc_dtype", "sinkhorn", "check_iters", "mhc_coefficients", "SINKHORN_ITERS", "MAX_STREAMS"]

# The kernels' limit (n^2 + 2n coefficient columns padded to 128); a fact selection checks at
# construction (without importing triton) and the kernel module enforces.
MAX_STREAMS = 8
SINKHORN_ITERS = 20


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP32 for 16-bit and FP32 data; FP64 data keeps FP64."""
    return torch.promote_types(dtype, torch.float32)


def check_iters(iters: int) -> None:
    """Sinkhorn iterations: an int of at least 1 (a float, a bool or 0 is a caller's slip)."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"Sinkhorn iterations must be an int of at least 1, got {iters!r} (the default is "
                         f"{SINKHORN_ITERS})")


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits)`` (``[..., n, n]``) onto doubly-stochastic matrices.

    Each iteration divides every column by its sum, then every row by its sum (``M <- T_r(T_c(M))``).
    After the last one every row sums to 1 to rounding, so each new stream is a convex combination
    of the old ones (equal streams stay equal), and the column sums are 1 to the convergence of
    ``iters`` iterations (within 1e-5 for logits in [-1, 1]; strongly unbalanced logits converge
    slower). The per-matrix maximum is subtracted before ``exp`` (the normalizations cancel any
    common scale), so large logits do not overflow; entries are floored at the smallest normal
    float, so logits further apart than ``exp`` can represent (about 87 in FP32) saturate instead
    of leaving an all-zero column to divide by.
    """
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"Sinkhorn takes square [..., n, n] logits, got shape {tuple(logits.shape)}")
    check_iters(iters)
    floor = torch.finfo(logits.dtype).tiny
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True)).clamp_min(floor)
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def mhc_coefficients(
    x: torch.Tensor, params: MhcStageParams, iters: int = SINKHORN_ITERS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(H_pre [T, n], H_post [T, n], H_res [T, n, n])`` of streams ``x [T, n, C]``, in FP32
    (FP64 for FP64 ``x``)."""
    t, n, c = x.shape
    acc = acc_dtype(x.dtype)
    flat = x.reshape(t, n * c).to(acc)
    normed = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + params.eps)
    proj = normed @ params.phi.to(acc)  # [T, 2n + n*n]: pre | post | res
    alpha = params.alpha.to(acc)
    pre = alpha[0] * proj[:, :n] + params.b_pre.to(acc)
    post = alpha[1] * proj[:, n : 2 * n] + params.b_post.to(acc)
    res = alpha[2] * proj[:, 2 * n :].reshape(t, n, n) + params.b_res.to(acc)
    return torch.sigmoid(pre), 2.0 * torch.sigmoid(post), sinkhorn(res, iters)
