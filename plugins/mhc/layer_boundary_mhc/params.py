"""The parameters an MHC stage (and a learned exit head) owns.

======================  ===============  ================================================
Parameter               Shape            Role
======================  ===============  ================================================
``phi``                 [n*C, 2n + n*n]  projection of the normalized flat streams, column
                                         blocks ``[pre (n) | post (n) | res (n*n)]``
``alpha``               [3]              scales of the dynamic parts (pre, post, res)
``b_pre``, ``b_post``   [n]              static logits of ``H_pre`` and ``H_post``
``b_res``               [n, n]           static logits of ``H_res`` (row ``i``: stream ``i``'s
                                         inputs)
======================  ===============  ================================================

The ``res`` block is read row-major: ``H~_res[i, j] = (x~ phi_res)[i*n + j]``.

Parameters are held in FP32 (FP64 for an FP64 model) whatever the activation dtype: the
coefficient math runs in that precision.

Default init (deterministic, identical on every rank) makes the scheme a plain residual at first:
``phi = 0`` (coefficients static), ``alpha = 0.01`` (the paper's gating-factor init), ``b_post = 0``
(``H_post = 1``), ``b_res = 4 I`` (``H_res`` close to the identity and exactly doubly stochastic)
and ``b_pre = logit(1/n)`` (``H_pre = 1/n``: the read is the streams' mean). The stack entry repeats
the embedding into equal streams, and equal streams stay equal under a doubly-stochastic ``H_res``
with ``H_post = 1``: every stream then carries the plain residual, and the model computes what
the plain residual computes. For ``n = 1``, ``b_pre = 40`` saturates the sigmoid (``H_pre = 1``
exactly in FP32 and FP64), so ``n = 1`` is the plain residual to the last bit of its arithmetic.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["MhcStageParams", "MhcHead", "param_dtype"]

ALPHA_INIT = 0.01
RES_DIAGONAL_INIT = 4.0
PRE_SATURATED = 40.0  # sigmoid(40) == 1.0 in FP32 and FP64


def param_dtype(dtype: Optional[torch.dtype]) -> torch.dtype:
    """FP32 for 16-bit and FP32 models, FP64 for FP64 models."""
    return torch.promote_types(dtype or torch.float32, torch.float32)


def _pre_bias(n: int) -> float:
    return PRE_SATURATED if n == 1 else -math.log(n - 1)  # sigmoid(-log(n-1)) = 1/n


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MHC needs {name} to be an int of at least 1, got {value!r}")


class MhcStageParams(nn.Module):
    """``phi``, ``alpha`` and the static biases of one stage (see the module docstring)."""

    def __init__(
        self, n: int, hidden_size: int, *, dtype: Optional[torch.dtype] = None, device: Any = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        _count("n", n)
        _count("hidden_size", hidden_size)
        self.n = n
        self.hidden_size = hidden_size
        self.eps = float(eps)  # of the parameter-free RMSNorm of the flat streams
        kw = dict(dtype=param_dtype(dtype), device=device)
        self.phi = nn.Parameter(torch.empty(n * hidden_size, n * (n + 2), **kw))
        self.alpha = nn.Parameter(torch.empty(3, **kw))
        self.b_pre = nn.Parameter(torch.empty(n, **kw))
        self.b_post = nn.Parameter(torch.empty(n, **kw))
        self.b_res = nn.Parameter(torch.empty(n, n, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The near-plain init of the module docstring."""
        self.phi.zero_()
        self.alpha.fill_(ALPHA_INIT)
        self.b_pre.fill_(_pre_bias(self.n))
        self.b_post.zero_()
        self.b_res.copy_(RES_DIAGONAL_INIT * torch.eye(self.n))

    @torch.no_grad()
    def init_random(self, generator: torch.Generator) -> None:
        """Seeded non-trivial coefficients (demos and tests), drawn on the CPU from ``generator``:
        ``phi ~ N(0, 1/(n C))`` so ``x~ phi`` is about unit scale, ``alpha ~ U(0.5, 1.5)``,
        ``b_pre ~ logit(1/n) + N(0, 0.5^2)``, ``b_post ~ N(0, 0.5^2)``, ``b_res ~ N(0, 1)``: the
        Sinkhorn logits stay within a few units, so ``H_res`` mixes streams well away from I."""
        n, c = self.n, self.hidden_size

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=torch.float64)

        self.phi.copy_(draw(n * c, n * (n + 2)) / math.sqrt(n * c))
        self.alpha.copy_(0.5 + torch.rand(3, generator=generator, dtype=torch.float64))
        self.b_pre.copy_(_pre_bias(n) + 0.5 * draw(n) if n > 1 else torch.full((1,), PRE_SATURATED))
        self.b_post.copy_(0.5 * draw(n))
        self.b_res.copy_(draw(n, n))

    def check(self, dtype: torch.dtype) -> None:
        """Raise unless every parameter has the shape of the table and ``param_dtype(dtype)``
        for streams of ``dtype``: a wrong shape otherwise fails deep in the coefficient math (or
        broadcasts silently), and ``model.to(torch.bfloat16)`` casts these parameters too, which
        the coefficients' FP32 precision (and the kernels' FP32 phi) does not allow."""
        n, c, want = self.n, self.hidden_size, param_dtype(dtype)
        shapes = {"phi": (n * c, n * (n + 2)), "alpha": (3,), "b_pre": (n,), "b_post": (n,), "b_res": (n, n)}
        for name, shape in shapes.items():
            p = getattr(self, name)
            if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape:
                got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(f"MHC parameter {name} has shape {got}, expected {shape} (n = {n} streams, "
                                 f"hidden size {c}); load a checkpoint made for this n and hidden size, "
                                 "or build the stage with the n the checkpoint was trained with")
            if p.dtype != want:
                raise ValueError(f"MHC parameter {name} is {str(p.dtype).replace('torch.', '')}, expected "
                                 f"{str(want).replace('torch.', '')} for {str(dtype).replace('torch.', '')} "
                                 "streams: the coefficients need it (model.to(dtype) casts MHC parameters "
                                 "too; build the model with dtype= instead, or call .float() on the "
                                 "MhcStageParams modules after the cast)")

    def extra_repr(self) -> str:
        return f"n={self.n}, hidden_size={self.hidden_size}, eps={self.eps}"


class MhcHead(nn.Module):
    """A learned stack exit: ``h = sum_j w_j x_j`` over the ``n`` streams; ``w`` starts at ``1/n``
    (the mean)."""

    def __init__(self, n: int, *, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        _count("n", n)
        self.n = n
        self.weight = nn.Parameter(torch.full((n,), 1.0 / n, dtype=param_dtype(dtype), device=device))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0 / self.n)

    @torch.no_grad()
    def init_random(self, generator: torch.Generator) -> None:
        """``w ~ 1/n + N(0, (0.25/n)^2)``."""
        self.weight.copy_((1.0 + 0.25 * torch.randn(self.n, generator=generator, dtype=torch.float64)) / self.n)

    def extra_repr(self) -> str:
        return f"n={self.n}"
