"""The torch reference kernels against independent float64 formulas.

Tolerances (the output is rounded to the input dtype once, so the bound is one ulp of it):

| dtype    | rtol / atol      | why |
| -------- | ---------------- | --- |
| float64  | 1e-12            | computed in FP64; only summation order differs |
| float32  | 2e-6 / 1e-6      | FP32 accumulation of the mean and the product |
| bfloat16 | 8e-3 / 8e-3      | one bf16 ulp (2^-8) from rounding the FP32 result |
| float16  | 1e-3 / 1e-3      | one fp16 ulp (2^-11) from rounding the FP32 result |
"""

from __future__ import annotations

import pytest
import torch

from helpers import rms64
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref

KTOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}
DTYPES = list(KTOL)
# 1 token, odd and prime widths, sizes just past a power of two.
SHAPES = [(1, 8), (1, 1), (3, 7), (5, 13), (2, 129), (4, 257)]


def data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype)


def weight(h, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(h, generator=g, dtype=torch.float64) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
def test_rmsnorm_matches_fp64_formula(dtype, shape, offset):
    x, w = data(shape, dtype), weight(shape[-1], dtype)
    y = rmsnorm_ref(x, w, 1e-6, weight_offset=offset)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), rms64(x, w, 1e-6, offset), **KTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
def test_fused_add_rmsnorm_matches_fp64_formula(dtype, shape, offset):
    x, r, w = data(shape, dtype, 0), data(shape, dtype, 5), weight(shape[-1], dtype)
    y, r_new = fused_add_rmsnorm_ref(x, r, w, 1e-6, weight_offset=offset)
    s = x.double() + r.double()
    assert y.dtype == dtype and r_new.dtype == dtype
    torch.testing.assert_close(y.double(), rms64(s, w, 1e-6, offset), **KTOL[dtype])
    # The stored residual is the sum rounded once to the residual dtype (exact for fp64).
    torch.testing.assert_close(r_new, s.to(dtype), rtol=0, atol=0)
    # Inputs are not modified when no destination is given.
    torch.testing.assert_close(r, data(shape, dtype, 5), rtol=0, atol=0)


def test_fp64_is_not_rounded_through_fp32():
    # 1 + 2^-40 is lost in FP32; an FP64 reference must keep it.
    x = torch.tensor([[1.0 + 2.0**-40, 1.0]], dtype=torch.float64)
    r = torch.tensor([[2.0**-40, 0.0]], dtype=torch.float64)
    w = torch.ones(2, dtype=torch.float64)
    y = rmsnorm_ref(x, w, 0.0)
    assert y[0, 0] != y[0, 1]
    torch.testing.assert_close(y, rms64(x, w, 0.0), rtol=1e-15, atol=0)
    y2, r2 = fused_add_rmsnorm_ref(x, r, w, 0.0)
    assert r2[0, 0].item() == 1.0 + 2.0**-39
    torch.testing.assert_close(y2, rms64(x + r, w, 0.0), rtol=1e-15, atol=0)


def _norm_fp64_then_round(s64: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return rms64(s64, w, 1e-6).to(dtype)


def test_add_norm_normalizes_the_fp32_sum_not_the_rounded_sum():
    """bf16 residual ~1, contributions of 2^-10..2^-8: the bf16-rounded sum loses them, the FP32
    sum (exact here: both addends are bf16 of nearby exponents) keeps them."""
    g = torch.Generator().manual_seed(3)
    T, H = 8, 64
    r = (1 + torch.randint(0, 64, (T, H), generator=g).double() / 128).to(torch.bfloat16)
    x = (torch.rand(T, H, generator=g, dtype=torch.float64) * (2**-8 - 2**-10) + 2**-10).to(torch.bfloat16)
    w = torch.ones(H, dtype=torch.bfloat16)
    s_exact = x.double() + r.double()
    assert torch.equal(s_exact.float().double(), s_exact), "the FP32 sum must be exact for this check"
    s_rounded = s_exact.to(torch.bfloat16).double()

    y, r_new = fused_add_rmsnorm_ref(x, r, w, 1e-6)
    from_fp32_sum = _norm_fp64_then_round(s_exact, w, torch.bfloat16)
    from_rounded_sum = _norm_fp64_then_round(s_rounded, w, torch.bfloat16)
    differ = (from_fp32_sum != from_rounded_sum).sum().item()
    assert differ > T * H // 8, "the case must separate the two orders to mean anything"
    assert torch.equal(y, from_fp32_sum)
    assert (y != from_rounded_sum).sum().item() == differ
    # The stored residual is the rounded sum.
    assert torch.equal(r_new, s_exact.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_out_destination(dtype):
    x, w = data((3, 11), dtype), weight(11, dtype)
    expected = rmsnorm_ref(x, w, 1e-6)
    out = torch.full_like(x, float("nan"))
    got = rmsnorm_ref(x, w, 1e-6, out=out)
    assert got is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_add_rmsnorm_destinations(dtype):
    x, r, w = data((3, 11), dtype, 0), data((3, 11), dtype, 1), weight(11, dtype)
    y_expected, r_expected = fused_add_rmsnorm_ref(x, r.clone(), w, 1e-6)

    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(r, float("nan"))
    y, r_new = fused_add_rmsnorm_ref(x, r, w, 1e-6, out=out, residual_out=res_out)
    assert y is out and r_new is res_out
    assert torch.equal(out, y_expected) and torch.equal(res_out, r_expected)

    # residual_out=residual updates the residual in place, as fused kernels do.
    r_inplace = r.clone()
    y2, r2 = fused_add_rmsnorm_ref(x, r_inplace, w, 1e-6, residual_out=r_inplace)
    assert r2 is r_inplace
    assert torch.equal(r_inplace, r_expected) and torch.equal(y2, y_expected)
    # The contribution itself is never written.
    assert torch.equal(x, data((3, 11), dtype, 0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(dtype):
    base = data((6, 26), dtype, 0)
    x = base[::2, ::2]  # [3, 13], strided in both dimensions
    rbase = data((13, 3), dtype, 1)
    r = rbase.t()  # transposed view
    assert not x.is_contiguous() and not r.is_contiguous()
    w_base = weight(26, dtype)
    w = w_base[::2]
    torch.testing.assert_close(rmsnorm_ref(x, w, 1e-6).double(), rms64(x, w, 1e-6), **KTOL[dtype])
    y, r_new = fused_add_rmsnorm_ref(x, r, w, 1e-6)
    s = x.double() + r.double()
    torch.testing.assert_close(y.double(), rms64(s, w, 1e-6), **KTOL[dtype])
    torch.testing.assert_close(r_new, s.to(dtype), rtol=0, atol=0)
    # Same values as the contiguous copies, bit for bit.
    assert torch.equal(y, fused_add_rmsnorm_ref(x.contiguous(), r.contiguous(), w.contiguous(), 1e-6)[0])


def test_empty_batch():
    x = torch.empty(0, 16)
    w = torch.ones(16)
    assert rmsnorm_ref(x, w, 1e-6).shape == (0, 16)
    y, r = fused_add_rmsnorm_ref(x, torch.empty(0, 16), w, 1e-6)
    assert y.shape == (0, 16) and r.shape == (0, 16)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="does not match residual"):
        fused_add_rmsnorm_ref(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6)


def test_eps_is_used():
    x = torch.zeros(1, 4, dtype=torch.float64)
    x[0, 0] = 1e-4
    w = torch.ones(4, dtype=torch.float64)
    for eps in (1e-6, 1e-2):
        torch.testing.assert_close(rmsnorm_ref(x, w, eps), rms64(x, w, eps), rtol=1e-12, atol=0)
    assert not torch.equal(rmsnorm_ref(x, w, 1e-6), rmsnorm_ref(x, w, 1e-2))
