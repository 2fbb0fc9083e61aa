"""``NormKernels.input_as_out``: a kernel cheapest in place on its input gets the consumed
contribution as ``out=``, and the stage's result is unchanged."""

from __future__ import annotations

import torch

from layer_boundary import ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary._norms import RMSNorm
from layer_boundary.residual._add_norm import AddNormReadSpec, NormKernels


def _stack(input_as_out: bool, seen: list):
    def fused(x, residual, weight, eps, *, weight_offset=0.0, out=None, residual_out=None):
        seen.append(out is x)
        return fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset, out=out,
                                     residual_out=residual_out)

    kernels = NormKernels("probe", rmsnorm_ref, fused, input_as_out=input_as_out)
    spec = AddNormReadSpec(kernels=kernels)
    torch.manual_seed(0)
    n1, n2 = RMSNorm(16), RMSNorm(16)
    return make_stages((declare_attn(read=spec), n1), (declare_ffn(read=spec), n2), previous=None, terminal=True)


def _forward(stages, h):
    attn, ffn = stages
    fb = ForwardBatch(num_tokens=h.shape[0])
    from layer_boundary.residual import batch as residual_batch

    residual_batch.start(fb)
    x = attn.prepare(h, fb)
    out = attn.finish(x * 2.0, fb)
    return ffn.prepare(out, fb).clone()


def test_out_is_the_contribution_only_when_asked():
    h = torch.randn(5, 16)
    seen_plain, seen_inplace = [], []
    want = _forward(_stack(False, seen_plain), h)
    got = _forward(_stack(True, seen_inplace), h)
    assert seen_plain == [False] and seen_inplace == [True]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
