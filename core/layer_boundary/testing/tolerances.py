"""Default per-dtype tolerances for providers that declare none, with the reason for each."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULT_TOLERANCE", "tolerance_of"]

# (atol, rtol) against the torch reference.
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    # FP32 accumulation in another order (tree vs sequential reduction): a few ulps.
    torch.float32: (1e-5, 1e-5),
    # One rounding of the output to bf16 may land on the neighbouring value: 2 ulps at 2^-8.
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
    torch.float64: (1e-12, 1e-12),
}


def tolerance_of(provider: Any, dtype: torch.dtype) -> dict[str, float]:
    """``dict(atol=, rtol=)`` for ``dtype`` from the provider's ``tolerance`` or the default."""
    table = getattr(provider, "tolerance", None) or {}
    atol, rtol = table.get(dtype, DEFAULT_TOLERANCE.get(dtype, (1e-5, 1e-5)))
    return {"atol": atol, "rtol": rtol}
