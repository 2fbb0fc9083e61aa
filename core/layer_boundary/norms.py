"""Norm modules whose parameters a stage read binds: RMSNorm and Gemma RMSNorm.

A stage's read calls a norm-read kernel with ``(weight, eps, weight_offset)`` taken from these
modules, so the module's own ``forward`` is only used outside boundaries.
Any module with ``weight`` and ``eps`` (or ``variance_epsilon``) is read the same way; a module
with neither is called as a black box (no add+norm fusion).
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels.reference import rmsnorm_ref

__all__ = ["RMSNorm", "GemmaRMSNorm", "norm_params"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``; weight initialized to ones."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_ref(x, self.weight, self.eps, weight_offset=self.weight_offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """``y = x / sqrt(mean(x^2) + eps) * (1 + weight)``; weight initialized to zeros."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    @property
    def gemma_weight(self) -> torch.Tensor:
        """The stored weight (without the +1), as fused Gemma kernels take it."""
        return self.weight


def norm_params(norm: nn.Module) -> tuple[torch.Tensor, float, float] | None:
    """``(weight, eps, weight_offset)`` of an RMSNorm-like module, or ``None`` if it is not one."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
        return None
    if isinstance(norm, (nn.LayerNorm, nn.GroupNorm)):
        return None
    return weight, float(eps), float(getattr(norm, "weight_offset", 0.0))
