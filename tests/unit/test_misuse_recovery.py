"""Misuse raises the library's error and leaves the stream usable (issue 32, part 7): a refused
batch helper keeps the stream for the corrected retry; a 0-d stack input and a pipeline handoff
missing the residual it needs are named, not an IndexError or a silently dropped residual."""

from __future__ import annotations

import pytest
import torch

from layer_boundary import (BoundaryError, declare_attn, declare_ffn, ForwardBatch, make_stages, RMSNorm,
                            residual_batch as rb)

H = 8


def _layer(**kw):
    return make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), **kw)


def _run(attn, ffn, fb, x):
    h = attn.finish(attn.prepare(x, fb), fb)
    y = ffn.prepare(h, fb)
    with ffn.exit(fb) as out:
        pass
    return out.finish(y)


def test_a_0d_stack_input_is_named():
    attn, _ = _layer(terminal=True)
    fb = ForwardBatch(num_tokens=3)
    rb.start(fb)
    with pytest.raises(BoundaryError, match=r"shape \(\): boundaries move token rows"):
        attn.prepare(torch.tensor(1.0), fb)


def test_a_refused_norm_keeps_the_stream_for_the_retry():
    attn, ffn = _layer(terminal=True)
    final = RMSNorm(H)
    rb.bind_final_norm(final)
    fb = ForwardBatch(num_tokens=3)
    rb.start(fb)
    x = torch.randn(3, H)
    h = _run(attn, ffn, fb, x)
    with pytest.raises(BoundaryError, match="does not belong to this residual stream"):
        rb.norm(h[:2], fb, final)  # not the handle the stream handed out
    assert not fb.residual_stream.released
    out = rb.norm(h, fb, final)
    ref_fb = ForwardBatch(num_tokens=3)
    rb.start(ref_fb)
    assert torch.equal(out, rb.norm(_run(attn, ffn, ref_fb, x), ref_fb, final))
    assert fb.residual_stream.released


def test_a_refused_take_output_keeps_the_stream():
    attn, ffn = _layer(terminal=True)
    fb = ForwardBatch(num_tokens=3)
    rb.start(fb)
    h = _run(attn, ffn, fb, torch.randn(3, H))
    with pytest.raises(BoundaryError):
        rb.take_output(h, fb)  # still pending: fold it first
    h = rb.fold(h, fb)
    assert torch.equal(rb.take_output(h, fb), h)


@pytest.mark.parametrize("drop", ["residual", "output"])
def test_from_pp_refuses_a_handoff_missing_what_it_needs(drop):
    attn, ffn = _layer()
    fb = ForwardBatch(num_tokens=3)
    rb.start(fb)
    wire = rb.to_pp(_run(attn, ffn, fb, torch.randn(3, H)), fb)
    assert {"output", "residual"} <= set(wire)
    receiver, _ = _layer(previous=declare_ffn(), terminal=True)
    del wire[drop]
    with pytest.raises(BoundaryError, match=f"has no '{drop}' tensor"):
        receiver.from_pp(wire, ForwardBatch(num_tokens=3))
