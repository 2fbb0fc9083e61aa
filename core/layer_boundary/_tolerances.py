"""Default per-dtype tolerances for providers that declare none, with the reason for each, and
the comparison of per-token FP8 outputs: the conformance kit's table (``layer_boundary.testing``
re-exports it) and the benchmarks' reference checks. Torch only: the benchmarks run where the
kit's pytest is not installed (the README's main-job install)."""

from __future__ import annotations

from typing import Any, TypedDict

import torch

__all__ = ["DEFAULT_TOLERANCE", "MAX_TOLERANCE", "Tolerance", "FP8_SCALE_RTOL", "FP8_STEP_RTOL", "FP8_SUBNORMAL_STEP",
           "tolerance_of", "assert_fp8_rows_close"]

# (atol, rtol) against the torch reference.
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    # FP32 accumulation in another order (tree vs sequential reduction): a few ulps.
    torch.float32: (1e-5, 1e-5),
    # One rounding of the output to bf16 may land on the neighbouring value: 2 ulps at 2^-8.
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
    torch.float64: (1e-12, 1e-12),
}

# The loosest (atol, rtol) a provider may declare for itself: twice the default (4 ulps of bf16 and
# fp16, where the default allows 2), ten times in FP32 (another reduction tree and an approximate
# rsqrt, not another algorithm). Looser than this is not the reference's numerics; the
# conformance kit fails a provider that declares it.
MAX_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3.2e-2, 3.2e-2),
    torch.float16: (4e-3, 4e-3),
    torch.float64: (1e-11, 1e-11),
}

# FP8 e4m3 per-token outputs (see layer_boundary._quant), compared dequantized, data.float() * scale:
# - the scale is amax(|y|) / 448 of FP32 rows that a kernel sums in another order, with an
#   approximate rsqrt: a few FP32 ulps.
FP8_SCALE_RTOL = 1e-5
# - a code may land on the neighbouring e4m3 value when y sits near a rounding boundary: one step
#   is at most 2^-3 of a normal value (3 mantissa bits) ...
FP8_STEP_RTOL = 2.0**-3
# - ... and 2^-9 (times the scale) below e4m3's smallest normal, 2^-6.
FP8_SUBNORMAL_STEP = 2.0**-9


class Tolerance(TypedDict):
    """Keyword arguments of ``torch.testing.assert_close``: ``assert_close(a, b, **tol)``."""

    atol: float
    rtol: float


def tolerance_of(provider: Any, dtype: torch.dtype) -> Tolerance:
    """``dict(atol=, rtol=)`` for ``dtype`` from the provider's ``tolerance`` or the default."""
    table = getattr(provider, "tolerance", None) or {}
    atol, rtol = table.get(dtype, DEFAULT_TOLERANCE.get(dtype, (1e-5, 1e-5)))
    return {"atol": atol, "rtol": rtol}


def assert_fp8_rows_close(got: Any, want: Any, *, scale_rtol: float = FP8_SCALE_RTOL, what: str = "") -> None:
    """Assert that ``got`` is a per-token FP8 e4m3 output within one e4m3 step of ``want``.

    Checks the types and shapes (data [T, H] float8_e4m3fn, scale [T, 1] float32), the scales to
    ``scale_rtol``, and each dequantized value to one e4m3 step of the reference's.
    """
    from ._quant import QuantizedRows

    where = f"{what}: " if what else ""
    assert isinstance(got, QuantizedRows), f"{where}expected QuantizedRows, got {type(got).__name__}"
    assert got.data.dtype == torch.float8_e4m3fn, f"{where}data dtype {got.data.dtype}, expected float8_e4m3fn"
    assert got.scale.dtype == torch.float32, f"{where}scale dtype {got.scale.dtype}, expected float32"
    assert got.data.shape == want.data.shape, f"{where}data shape {tuple(got.data.shape)} != {tuple(want.data.shape)}"
    assert got.scale.shape == want.scale.shape, f"{where}scale shape {tuple(got.scale.shape)} != {tuple(want.scale.shape)}"
    if got.data.numel() == 0:
        return
    g_scale, w_scale = got.scale.detach().cpu(), want.scale.detach().cpu()
    torch.testing.assert_close(g_scale, w_scale, rtol=scale_rtol, atol=0,
                               msg=lambda m: f"{where}per-token scales differ: {m}")
    h = want.data.shape[-1]
    g_scale, w_scale = g_scale.reshape(-1, 1), w_scale.reshape(-1, 1)
    g = got.data.detach().cpu().float().reshape(-1, h) * g_scale
    w = want.data.detach().cpu().float().reshape(-1, h) * w_scale
    assert bool(torch.isfinite(g).all()), f"{where}non-finite dequantized values"
    bound = (FP8_STEP_RTOL + 2 * scale_rtol) * w.abs() + FP8_SUBNORMAL_STEP * w_scale * (1 + scale_rtol)
    excess = (g - w).abs() - bound
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        row, col = divmod(i, h)
        n = int((excess > 0).sum())
        raise AssertionError(
            f"{where}{n} dequantized value(s) more than one e4m3 step from the reference; worst at "
            f"[{row}, {col}]: got {g[row, col].item():.6g}, expected {w[row, col].item():.6g} "
            f"(scale {w_scale[row, 0].item():.6g})"
        )
