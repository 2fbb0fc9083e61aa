"""The core Triton norm kernels under Triton's interpreter, on CPU tensors.

Run by tests/unit/test_triton_kernels.py in a subprocess with TRITON_INTERPRET=1: Triton 3.6 chooses
the interpreter when ``@triton.jit`` runs, so the variable must be set before the kernel module
is imported, and the GPU tests of the same session must keep the compiled kernels. The
interpreter runs a program in ~20 ms, so the shapes are small; the GPU tests take the large ones.

Tolerances are the provider's (``TritonNormProvider.tolerance``: a few FP32 ulps before one
rounding to the output dtype); the stored residual is the FP32 sum rounded once, so it is compared
bitwise; FP8 outputs are compared with ``assert_fp8_rows_close`` (one e4m3 step).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (tests/unit/test_triton_kernels.py does)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from layer_boundary._kernels import triton_norm  # noqa: E402
from layer_boundary._kernels.providers import TRITON_PROVIDER  # noqa: E402
from layer_boundary._kernels.reference import (  # noqa: E402
    fused_add_rmsnorm_fp8_ref,
    fused_add_rmsnorm_ref,
    rmsnorm_fp8_ref,
    rmsnorm_ref,
)
from layer_boundary._kernels.triton_ops import (  # noqa: E402
    fused_add_rmsnorm_fp8_triton,
    fused_add_rmsnorm_triton,
    rmsnorm_fp8_triton,
    rmsnorm_triton,
)
from layer_boundary._quant import FP8_SCALE_FLOOR, QuantizedRows  # noqa: E402
from layer_boundary.testing._tolerances import assert_fp8_rows_close, tolerance_of  # noqa: E402

EPS = 1e-6
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def rows(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 2).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return x, r, w


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tolerance_of(TRITON_PROVIDER, dtype))


def test_the_interpreter_is_in_use():
    assert triton_norm.INTERPRETED, "TRITON_INTERPRET=1 was set after the kernel module was imported"


# (T, H, dtype, weight offset): 1 token, odd and prime widths, a width past a power of two.
FUSED_CASES = [
    (1, 1, BF16, 0.0), (3, 7, FP16, 1.0), (17, 128, BF16, 1.0), (3, 1000, FP32, 0.0),
    (3, 1000, BF16, 0.0), (2, 129, FP16, 0.0), (1, 4097, BF16, 1.0),
]


@pytest.mark.parametrize("t,h,dtype,offset", FUSED_CASES, ids=str)
def test_fused_add_rmsnorm_matches_reference_and_updates_in_place(t, h, dtype, offset):
    x, r, w = rows(t, h, dtype)
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS, weight_offset=offset)
    x0 = x.clone()
    y, r_out = fused_add_rmsnorm_triton(x, r, w, EPS, weight_offset=offset)
    assert r_out is r  # in place, as residual_in_place=True declares
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    close(y, want_y, dtype)
    assert torch.equal(x, x0)


def test_normalizes_the_fp32_sum_not_the_rounded_residual():
    """The rounding order the kit checks on GPUs: y comes from the FP32 sum, and is closer to
    normalizing it than to normalizing the stored bf16 residual."""
    x, r, w = rows(3, 1000, BF16, seed=3)
    exact = x.double() + r.double()
    y, _ = fused_add_rmsnorm_triton(x, r, w, EPS)
    from_sum = rmsnorm_ref(exact, w.double(), EPS)
    from_rounded = rmsnorm_ref(exact.to(BF16).double(), w.double(), EPS)
    assert (y.double() - from_sum).abs().mean() < (y.double() - from_rounded).abs().mean()


@pytest.mark.parametrize("t,h,dtype,offset", [(0, 128, BF16, 0.0), (1, 7, FP32, 1.0), (3, 1000, FP16, 0.0),
                                              (3, 1000, BF16, 1.0)], ids=str)
def test_rmsnorm_matches_reference(t, h, dtype, offset):
    x, _, w = rows(t, h, dtype)
    close(rmsnorm_triton(x, w, EPS, weight_offset=offset), rmsnorm_ref(x, w, EPS, weight_offset=offset), dtype)


def test_empty_batch_launches_nothing():
    x, r, w = rows(0, 64, BF16)
    y, r_out = fused_add_rmsnorm_triton(x, r, w, EPS)
    assert y.shape == (0, 64) and r_out is r
    q = rmsnorm_fp8_triton(x, w, EPS)
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 1)


@pytest.mark.parametrize("t,h,dtype,offset", [(3, 1000, BF16, 0.0), (17, 128, FP32, 1.0), (1, 7, FP16, 0.0)], ids=str)
def test_fp8_outputs_match_reference(t, h, dtype, offset):
    x, r, w = rows(t, h, dtype, seed=2)
    assert_fp8_rows_close(rmsnorm_fp8_triton(x, w, EPS, weight_offset=offset),
                          rmsnorm_fp8_ref(x, w, EPS, weight_offset=offset), what="rmsnorm")
    want_q, want_r = fused_add_rmsnorm_fp8_ref(x, r, w, EPS, weight_offset=offset)
    q, r_out = fused_add_rmsnorm_fp8_triton(x, r, w, EPS, weight_offset=offset)
    assert r_out is r and r.dtype == dtype
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    assert_fp8_rows_close(q, want_q, what="fused")


def test_fp8_rounds_to_nearest_not_toward_zero():
    """Dequantized values stay within half an e4m3 step of the FP32 normalized rows; truncation
    or a mis-rounded carry would miss by up to a whole step."""
    x, r, w = rows(3, 1000, FP32, seed=4)
    q = rmsnorm_fp8_triton(x, w, EPS)
    y = rmsnorm_ref(x, w, EPS)  # FP32: the unrounded rows
    err = (q.dequantize() - y).abs()
    bound = 2.0**-4 * y.abs() * (1 + 1e-5) + 2.0**-10 * q.scale + 1e-6 * y.abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def test_fp8_zero_row_takes_the_floor_scale():
    x, _, w = rows(3, 100, BF16)
    x[1].zero_()
    q = rmsnorm_fp8_triton(x, w, EPS)
    assert q.scale[1, 0].item() == pytest.approx(FP8_SCALE_FLOOR)
    assert not q.data[1].float().any()
    assert bool(torch.isfinite(q.data.float()).all())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rows_wider_than_a_tile_take_the_chunked_path(monkeypatch, fp8):
    """The chunked kernel (rows past MAX_TILE) on a 200-wide row: six 32-wide chunks and a part."""
    monkeypatch.setattr(triton_norm, "MAX_TILE", 64)
    monkeypatch.setattr(triton_norm, "CHUNK", 32)
    monkeypatch.setattr(triton_norm, "_CONFIGS", {})
    assert triton_norm.launch_config(200, 2)[0] == 32
    x, r, w = rows(2, 200, BF16, seed=6)
    if fp8:
        want_q, want_r = fused_add_rmsnorm_fp8_ref(x, r, w, EPS, weight_offset=1.0)
        q, _ = fused_add_rmsnorm_fp8_triton(x, r, w, EPS, weight_offset=1.0)
        assert_fp8_rows_close(q, want_q, what="chunked")
    else:
        want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS, weight_offset=1.0)
        y, _ = fused_add_rmsnorm_triton(x, r, w, EPS, weight_offset=1.0)
        close(y, want_y, BF16)
    # In place and chunked: the residual is written in the last pass only, after every read.
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)


def test_strided_rows_and_columns_need_no_copy():
    h = 100
    g = torch.Generator().manual_seed(8)
    wide_x = torch.randn(3, 3 * h, generator=g).to(BF16)
    wide_r = torch.randn(3, 2 * h, generator=g).to(BF16)
    w = (torch.rand(h, generator=g) + 0.5).to(BF16)
    x = wide_x[:, h:2 * h]  # row stride 3H, columns contiguous
    r = wide_r[:, ::2]  # row stride 2H, column stride 2: updated in place where it lies
    assert not x.is_contiguous() and not r.is_contiguous()
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    untouched = wide_r[:, 1::2].clone()
    y, r_out = fused_add_rmsnorm_triton(x, r, w, EPS)
    assert r_out is r and y.is_contiguous()
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    assert torch.equal(wide_r[:, 1::2], untouched)  # the interleaved columns are not written
    close(y, want_y, BF16)
    close(rmsnorm_triton(wide_x[:, ::3], w, EPS), rmsnorm_ref(wide_x[:, ::3], w, EPS), BF16)


def test_destinations_are_written_and_returned():
    x, r, w = rows(3, 64, FP16)
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    r0 = r.clone()
    out, r_out = torch.empty_like(x), torch.empty_like(r)
    y, got_r = fused_add_rmsnorm_triton(x, r, w, EPS, out=out, residual_out=r_out)
    assert y is out and got_r is r_out
    assert torch.equal(r, r0)  # residual_out given: the residual is left alone
    torch.testing.assert_close(r_out, want_r, rtol=0, atol=0)
    close(out, want_y, FP16)
    # residual_out=residual is the in-place form, not two written arguments.
    _, got_r = fused_add_rmsnorm_triton(x, r, w, EPS, residual_out=r)
    assert got_r is r
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    dest = QuantizedRows(torch.empty(3, 64, dtype=torch.float8_e4m3fn), torch.empty(3, 1))
    q = rmsnorm_fp8_triton(x, w, EPS, out=dest)
    assert q is dest
    assert_fp8_rows_close(q, rmsnorm_fp8_ref(x, w, EPS))


def test_leading_dimensions_are_flattened():
    x, r, w = rows(6, 40, BF16)
    x3, r3 = x.view(2, 3, 40), r.clone().view(2, 3, 40)
    want_y, want_r = fused_add_rmsnorm_ref(x3, r3, w, EPS)
    y, r_out = fused_add_rmsnorm_triton(x3, r3, w, EPS)
    assert y.shape == (2, 3, 40) and r_out is r3
    torch.testing.assert_close(r3, want_r, rtol=0, atol=0)
    close(y, want_y, BF16)


def test_bad_inputs_are_refused_before_any_launch():
    x, r, w = rows(2, 16, FP32)
    with pytest.raises(TypeError, match="FP64"):
        rmsnorm_triton(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="does not match hidden size"):
        rmsnorm_triton(x, w[:8], EPS)
    with pytest.raises(ValueError, match="does not match residual"):
        fused_add_rmsnorm_triton(x, r[:1], w, EPS)
    with pytest.raises(TypeError, match="QuantizedRows"):
        rmsnorm_fp8_triton(x, w, EPS, out=QuantizedRows(torch.empty(2, 16), torch.empty(2, 1)))
    with pytest.raises(ValueError, match=r"out has shape \(1, 16\); expected \(2, 16\)"):
        rmsnorm_triton(x, w, EPS, out=torch.empty(1, 16))
    with pytest.raises(ValueError, match="residual_out has shape"):
        fused_add_rmsnorm_triton(x, r, w, EPS, residual_out=torch.empty(2, 8))
    with pytest.raises(ValueError, match="out.scale has shape"):
        rmsnorm_fp8_triton(x, w, EPS, out=QuantizedRows(torch.empty(2, 16, dtype=torch.float8_e4m3fn), torch.empty(2)))


def test_compiled_fullgraph_matches_eager_and_mutates_the_residual():
    """Dynamo traces the wrappers into the operators, whose schemas declare the in-place update
    (under the interpreter the operators are plain custom ops with the same schemas)."""
    torch._dynamo.reset()
    x, r, w = rows(3, 64, BF16, seed=9)

    def step(x, r, w):
        y, r2 = fused_add_rmsnorm_triton(x, r, w, EPS, weight_offset=1.0)
        q = rmsnorm_fp8_triton(r2, w, EPS)
        return y, q.data, q.scale

    r_eager = r.clone()
    want = step(x, r_eager, w)
    r_comp = r.clone()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, r_comp, w)
    torch.testing.assert_close(r_comp, r_eager, rtol=0, atol=0)  # the caller's residual was updated
    for g, e in zip(got, want):
        torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=0)
