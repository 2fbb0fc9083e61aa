"""Every sequence of one to four attention/FFN stages, in any order, end to end on random data,
against a hand-computed stack:

    r = x;  input_0 = rmsnorm(x);  c_0 = W_0 @ input_0
    for i >= 1:  s = r + c_{i-1} (in FP32, FP64 for FP64 data);  r = s;  input_i = rmsnorm(s);
                 c_i = W_i @ input_i
    final = rmsnorm(r + c_last)

built three ways: one ``make_stages`` call; one ``make_stages`` call per stage chained with
``previous=``/``following=``; and the single-stage factories. Tolerances: see ``helpers.TOL``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import TOL, acc_dtype, declare, make_norm, rms, rms64
from layer_boundary import (
    ForwardBatch,
    ResidualStream,
    RMSNorm,
    declare_attn,
    declare_ffn,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
)
from layer_boundary.residual import batch as rb

H, T = 16, 5

SEQUENCES = [seq for n in range(1, 5) for seq in itertools.product(("attn", "ffn"), repeat=n)]
MIXER_SEQUENCES = [seq for n in range(1, 4) for seq in itertools.product(("attn", "ffn", "mixer"), repeat=n)]


def ids(seq):
    return "-".join(seq)


def build(seq, norms, mode):
    n = len(seq)
    if mode == "one":
        return make_stages(*[(declare(k), norms[i]) for i, k in enumerate(seq)], terminal=True)
    stages = []
    for i, kind in enumerate(seq):
        prev = declare(seq[i - 1]) if i else None
        last = i == n - 1
        if mode == "chained":
            (stage,) = make_stages(
                (declare(kind), norms[i]),
                previous=prev,
                following=None if last else declare(seq[i + 1]),
                terminal=last,
            )
        else:  # the single-stage factories: the declaration carries its own source
            decl = declare(kind, previous=prev, terminal=last)
            following = None if last else declare(seq[i + 1], previous=declare(kind))
            factory = make_ffn_stage if kind == "ffn" else make_attn_stage
            stage = factory(decl, norms[i], following=following)
        stages.append(stage)
    return tuple(stages)


def run(seq, stages, x, weights, final, *, skip_empty=False):
    """The model's forward: prepare, compute, finish (attention) or exit().finish() (FFN, mixer)."""
    fb = ForwardBatch.for_tokens(x.shape[0])
    rb.start(fb)
    h = x
    inputs = []
    for kind, stage, w in zip(seq, stages, weights):
        inp = stage.prepare(h, fb)
        inputs.append(inp)
        if kind == "attn":
            h = stage.finish(inp @ w.T, fb)
        else:
            with stage.exit(fb) as out:
                y = inp @ w.T
            h = out.finish(y)
    return inputs, rb.norm(h, fb, final, skip_empty=skip_empty)


def reference(x, weights, norms, final, offset=0.0):
    """The hand-computed stack (plain torch, no library code)."""
    dtype, acc = x.dtype, acc_dtype(x.dtype)
    r, c = x, None
    inputs = []
    for w, n in zip(weights, norms):
        s = r.to(acc) if c is None else r.to(acc) + c.to(acc)
        if c is not None:
            r = s.to(dtype)
        inp = rms(s, n.weight, n.eps, offset).to(dtype)
        inputs.append(inp)
        c = inp @ w.T
    s = r.to(acc) + c.to(acc)
    return inputs, rms(s, final.weight, final.eps, offset).to(dtype)


def setup(n, dtype, *, tokens=T, gemma=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64).to(dtype)
    weights = [(torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype) for _ in range(n)]
    norms = [make_norm(H, dtype, gemma=gemma, seed=seed + 1 + i) for i in range(n)]
    final = make_norm(H, dtype, gemma=gemma, seed=seed + 99)
    return x, weights, norms, final


def check(seq, mode, dtype, *, gemma=False, tokens=T, skip_empty=False):
    x, weights, norms, final = setup(len(seq), dtype, tokens=tokens, gemma=gemma, seed=len(seq))
    stages = build(seq, norms, mode)
    got_inputs, got = run(seq, stages, x, weights, final, skip_empty=skip_empty)
    want_inputs, want = reference(x, weights, norms, final, offset=1.0 if gemma else 0.0)
    assert got.dtype == dtype and got.shape == (tokens, H)
    for i, (g_in, w_in) in enumerate(zip(got_inputs, want_inputs)):
        torch.testing.assert_close(g_in, w_in, **TOL[dtype], msg=lambda m, i=i: f"stage {i} input: {m}")
    torch.testing.assert_close(got, want, **TOL[dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["one", "chained", "factories"])
@pytest.mark.parametrize("seq", SEQUENCES, ids=ids)
def test_sequence(seq, mode, dtype):
    check(seq, mode, dtype)


@pytest.mark.parametrize("seq", SEQUENCES, ids=ids)
def test_sequence_bf16(seq):
    check(seq, "one", torch.bfloat16)


@pytest.mark.parametrize("seq", SEQUENCES, ids=ids)
def test_sequence_gemma_norms(seq):
    check(seq, "one", torch.float64, gemma=True)


@pytest.mark.parametrize("skip_empty", [False, True], ids=["norm", "skip_empty"])
@pytest.mark.parametrize("seq", SEQUENCES, ids=ids)
def test_sequence_empty_batch(seq, skip_empty):
    got = check(seq, "one", torch.float64, tokens=0, skip_empty=skip_empty)
    assert got.numel() == 0


@pytest.mark.parametrize("seq", MIXER_SEQUENCES, ids=ids)
def test_sequence_with_mixers(seq):
    check(seq, "chained", torch.float64)


def test_construction_modes_agree_bit_for_bit():
    seq = ("attn", "ffn", "ffn", "attn")
    outs = [check(seq, mode, torch.float64) for mode in ("one", "chained", "factories")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_reference_is_sensitive_to_the_stage_order():
    """Guard against a vacuous comparison: a different order gives different numbers."""
    x, weights, norms, final = setup(2, torch.float64)
    _, a = reference(x, weights, norms, final)
    _, b = reference(x, weights[::-1], norms[::-1], final)
    assert not torch.allclose(a, b)


def _bf16_sum_case():
    """bf16 residual ~1 plus contributions of 2^-10..2^-8: rounding the sum to bf16 loses most of
    the contribution, the FP32 sum (exact here) keeps it."""
    g = torch.Generator().manual_seed(3)
    r = (1 + torch.randint(0, 64, (8, 64), generator=g).double() / 128).to(torch.bfloat16)
    c = (torch.rand(8, 64, generator=g, dtype=torch.float64) * (2**-8 - 2**-10) + 2**-10).to(torch.bfloat16)
    exact = c.double() + r.double()
    rounded = exact.to(torch.bfloat16).double()
    return r, c, exact, rounded


@pytest.mark.parametrize("where", ["stage", "final_norm"])
def test_reads_normalize_the_fp32_sum(where):
    r, c, exact, rounded = _bf16_sum_case()
    n = RMSNorm(64, eps=1e-6, dtype=torch.bfloat16)
    stream, h = ResidualStream.arrive(residual=r, output=c)
    fb = ForwardBatch.for_tokens(8)
    fb.residual_stream = stream
    if where == "stage":
        (ffn,) = make_stages((declare_ffn(), n), previous=declare_attn())
        y = ffn.prepare(h, fb)
    else:
        y = rb.norm(h, fb, n)
    want = rms64(exact, n.weight, 1e-6).to(torch.bfloat16)
    not_this = rms64(rounded, n.weight, 1e-6).to(torch.bfloat16)
    assert (want != not_this).sum() > 64  # the case separates the two orders
    assert torch.equal(y, want)
