"""The FP8 e4m3 per-token references and the quantized read (``AddNormReadSpec(quant=...)``).

Tolerances:

| check                              | bound                          | why |
| ---------------------------------- | ------------------------------ | --- |
| scale vs FP64 amax / 448           | rtol 1e-6                      | FP32 normalization, then one division |
| dequantized vs FP64 rows           | half an e4m3 step (+1e-6 rel)  | round to nearest: 2^-4 relative for normal codes, 2^-10 * scale below 2^-6 |
| stored residual                    | exact                          | the FP32 sum rounded once, as the unquantized read |
"""

from __future__ import annotations

import pytest
import torch

from helpers import EPS, make_norm, rms64
from layer_boundary import BoundaryContext, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._quant import QuantizedRows
from layer_boundary._kernels.providers import REFERENCE_PROVIDER
from layer_boundary._kernels.reference import (
    fused_add_rmsnorm_fp8_ref,
    fused_add_rmsnorm_ref,
    rmsnorm_fp8_ref,
    rmsnorm_ref,
)
from layer_boundary._providers import NormRequest
from layer_boundary._quant import FP8_E4M3_MAX, FP8_SCALE_FLOOR
from layer_boundary.residual import batch as rb
from layer_boundary.residual._add_norm import AddNormReadSpec, ModuleRead, RMSNormRead
from layer_boundary.testing._tolerances import assert_fp8_rows_close

BF16, F32 = torch.bfloat16, torch.float32
H = 96


def data(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g, dtype=torch.float64) * 3).to(dtype)
    r = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.rand(h, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return x, r, w


def within_half_step(q: QuantizedRows, y64: torch.Tensor) -> None:
    deq = q.data.double() * q.scale.double()
    bound = (2.0**-4 + 1e-6) * y64.abs() + 2.0**-10 * q.scale.double()
    excess = (deq - y64).abs() - bound
    assert bool((excess <= 0).all()), f"max excess over half an e4m3 step: {excess.max().item():.3g}"


@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32, torch.float64], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 129), (2, 1000)], ids=str)
def test_fp8_reference_against_fp64(dtype, offset, shape):
    t, h = shape
    x, r, w = data(t, h, dtype)
    for q, s in ((rmsnorm_fp8_ref(x, w, EPS, weight_offset=offset), x.double()),
                 (fused_add_rmsnorm_fp8_ref(x, r, w, EPS, weight_offset=offset)[0], x.double() + r.double())):
        assert isinstance(q, QuantizedRows)
        assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (t, h)
        assert q.scale.dtype == F32 and q.scale.shape == (t, 1)
        y64 = rms64(s, w, EPS, offset)
        torch.testing.assert_close(q.scale.double(), y64.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX, rtol=1e-6, atol=0)
        # Each row's largest value takes the largest code.
        assert torch.equal(q.data.float().abs().amax(-1), torch.full((t,), FP8_E4M3_MAX))
        within_half_step(q, y64)


def test_fused_fp8_reference_keeps_the_residual_semantics():
    x, r, w = data(4, 64, BF16, seed=1)
    _, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    q, got_r = fused_add_rmsnorm_fp8_ref(x, r, w, EPS)
    assert got_r.dtype == BF16
    torch.testing.assert_close(got_r, want_r, rtol=0, atol=0)
    # The quantized rows come from the FP32 sum, not from the rounded residual.
    from_rounded = rmsnorm_fp8_ref(want_r, w, EPS)
    y64 = rms64(x.double() + r.double(), w, EPS)
    assert (q.dequantize().double() - y64).abs().mean() < (from_rounded.dequantize().double() - y64).abs().mean()


def test_fp8_reference_destinations_and_zero_rows():
    x, r, w = data(3, 32, F32, seed=2)
    x[2].zero_()
    dest = QuantizedRows(torch.empty(3, 32, dtype=torch.float8_e4m3fn), torch.empty(3, 1))
    r_dest = torch.empty_like(r)
    q, got_r = fused_add_rmsnorm_fp8_ref(x, torch.zeros_like(r), w, EPS, out=dest, residual_out=r_dest)
    assert q is dest and got_r is r_dest
    assert q.scale[2, 0].item() == pytest.approx(FP8_SCALE_FLOOR)
    assert not q.data[2].float().any()
    assert_fp8_rows_close(q, rmsnorm_fp8_ref(x, w, EPS))
    assert torch.equal(q.dequantize(BF16), (q.data.float() * q.scale).to(BF16))
    assert q.shape == (3, 32)


def test_reference_provider_serves_fp8_and_refuses_unknown_formats():
    req = NormRequest("cuda", BF16, 64, 0.0, "fp8_e4m3")
    assert REFERENCE_PROVIDER.refuse(req) is None
    k = REFERENCE_PROVIDER.kernels(req)
    assert k.rmsnorm is rmsnorm_fp8_ref and k.fused_add_rmsnorm is fused_add_rmsnorm_fp8_ref
    assert not k.residual_in_place
    assert REFERENCE_PROVIDER.kernels(NormRequest("cpu", BF16, 64)).rmsnorm is rmsnorm_ref
    why = REFERENCE_PROVIDER.refuse(NormRequest("cpu", BF16, 64, 0.0, "int4"))
    assert why == "unknown quantized output 'int4' (known: fp8_e4m3)"


# -- the quantized read -----------------------------------------------------------------------------


def test_read_spec_validates_quant_and_binds_it():
    with pytest.raises(ValueError, match="unknown quantized output 'fp4'"):
        AddNormReadSpec(quant="fp4")
    read = AddNormReadSpec(quant="fp8_e4m3").bind(make_norm(H, BF16))
    assert isinstance(read, RMSNormRead) and read.quant == "fp8_e4m3"
    assert read.kernels.rmsnorm is rmsnorm_fp8_ref
    assert "quant=fp8_e4m3" in repr(read)
    plain = AddNormReadSpec().bind(make_norm(H, BF16))
    assert plain.quant is None and getattr(plain, "quant", None) is None
    assert isinstance(AddNormReadSpec().bind(torch.nn.LayerNorm(H)), ModuleRead)
    with pytest.raises(TypeError, match="needs an RMSNorm-like norm"):
        AddNormReadSpec(quant="fp8_e4m3").bind(torch.nn.LayerNorm(H))


def test_the_request_carries_quant_to_selection():
    ctx = BoundaryContext()
    (attn,) = make_stages((declare_attn(read=AddNormReadSpec(quant="fp8_e4m3")), make_norm(H, BF16)), context=ctx)
    (sel,) = [s for s in ctx.report.selections if s.what == "norm kernels"]
    assert sel.request == f"rmsnorm cpu bfloat16 H={H} -> fp8_e4m3"
    assert sel.chosen == "torch-reference"
    assert attn.plan.read.quant == "fp8_e4m3"


def test_a_quantized_stage_returns_rows_and_keeps_the_residual_in_its_dtype():
    q_read = AddNormReadSpec(quant="fp8_e4m3")
    a0, f0 = make_stages((declare_attn(read=q_read), make_norm(H, BF16)), (declare_ffn(), make_norm(H, BF16, seed=1)))
    a1, f1 = make_stages((declare_attn(read=q_read), make_norm(H, BF16, seed=2)),
                         (declare_ffn(), make_norm(H, BF16, seed=3)), previous=declare_ffn(), terminal=True)
    fb = ForwardBatch.for_tokens(5)
    rb.start(fb)
    x, c, w = data(5, H, BF16, seed=4)
    inp = a0.prepare(x, fb)
    assert isinstance(inp, QuantizedRows) and inp.shape == (5, H)
    assert_fp8_rows_close(inp, rmsnorm_fp8_ref(x, a0.plan.read.weight, EPS))
    h = a0.finish(c.clone(), fb)
    y = f0.prepare(h, fb)
    assert y.dtype == BF16  # the FFN's read is unquantized
    with f0.exit(fb) as out:
        d = y * 0.5
    h = out.finish(d)
    r_before = fb.residual_stream.residual.clone()
    inp = a1.prepare(h, fb)
    want_q, want_r = fused_add_rmsnorm_fp8_ref(d, r_before, a1.plan.read.weight, EPS)
    assert_fp8_rows_close(inp, want_q)
    r_now = fb.residual_stream.residual
    assert r_now.dtype == BF16
    torch.testing.assert_close(r_now, want_r, rtol=0, atol=0)
