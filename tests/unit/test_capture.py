"""Auxiliary capture: the collector's copy-or-keep rule, and which values the boundary passes as
owned or borrowed at each capture point."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    rand,
    FakeCollectives,
    HalfSkip,
    Provider,
    Recorder,
    counted_handoff,
    fake_topology,
    install_fake_dist,
    make_norm,
    raises_exact,
    solo_sum,
)
from layer_boundary import (
    AuxHiddenStateList,
    BoundaryError,
    ForwardBatch,
    ResidualStream,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._contracts import Owed, OwedKind
from layer_boundary._layout import SumGroup
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary._errors import SNAPSHOT_PLAIN
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary.residual import batch as rb
from layer_boundary.residual._add_norm import AddNormReadSpec, NormKernels

H, T = 8, 3
F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def started(tokens=T):
    fb = ForwardBatch.for_tokens(tokens)
    rb.start(fb)
    return fb


def layer(previous=None, *, ffn_read=None, terminal=False):
    kw = {} if ffn_read is None else {"read": ffn_read}
    return make_stages(
        (declare_attn(), make_norm(H, F64)),
        (declare_ffn(**kw), make_norm(H, F64, seed=1)),
        previous=previous,
        terminal=terminal,
    )


# -- the collector -----------------------------------------------------------------------------


def test_collector_copies_borrowed_values():
    aux = AuxHiddenStateList()
    src = rand(T, H)
    aux.capture(src)  # owned defaults to False
    aux.capture(src, owned=False)
    src.fill_(5.0)
    assert len(aux) == 2
    for kept in aux:
        assert kept is not src
        torch.testing.assert_close(kept, rand(T, H), rtol=0, atol=0)


def test_collector_keeps_owned_values_by_identity():
    aux = AuxHiddenStateList()
    a, b = rand(T, H), rand(T, H, seed=1)
    aux.capture(a, owned=True)
    aux.capture(b, owned=True)
    assert aux[0] is a and aux[1] is b
    assert torch.equal(aux.stack(), torch.stack([a, b]))
    aux.clear()
    assert len(aux) == 0


def test_collector_refuses_non_tensors():
    with pytest.raises(TypeError):
        AuxHiddenStateList().capture([1.0, 2.0])


# -- attention prepare(capture_output=) --------------------------------------------------------


def test_stack_entry_captures_the_input_borrowed():
    attn, _ = layer()
    fb = started()
    x = rand(T, H)
    rec = Recorder()
    attn.prepare(x, fb, capture_output=rec)
    ((value, owned),) = rec.calls
    assert value is x and owned is False


def test_later_capture_is_owned_under_the_reference_kernels():
    """The FFN that follows locally reads through the reference add+norm, which never writes the
    residual it is given: that certificate makes the capture owned."""
    a0, f0 = layer()
    a1, f1 = layer(previous=declare_ffn(), terminal=True)
    fb = started()
    x = rand(T, H)
    inp = f0.prepare(a0.finish(a0.prepare(x, fb) * 2, fb), fb)
    with f0.exit(fb) as out:
        c = inp * 3
    h = out.finish(c)
    r_before = fb.residual_stream.residual.clone()
    rec = Recorder()
    a1.prepare(h, fb, capture_output=rec)
    ((value, owned),) = rec.calls
    assert owned is True
    assert value is fb.residual_stream.residual  # the updated residual this read produced
    torch.testing.assert_close(value, r_before + c, rtol=0, atol=0)


def test_capture_of_a_last_local_stage_is_borrowed():
    (attn,) = make_stages((declare_attn(), make_norm(H, F64)), previous=declare_ffn(), following=declare_ffn())
    ffn, attn2 = make_stages((declare_ffn(), make_norm(H, F64)), (declare_attn(), make_norm(H, F64, seed=1)),
                             previous=declare_attn(), following=declare_ffn())
    for stage in (attn, attn2):
        stream, h = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1))
        fb = ForwardBatch.for_tokens(T)
        fb.residual_stream = stream
        rec = Recorder()
        stage.prepare(h, fb, capture_output=rec)
        ((value, owned),) = rec.calls
        assert owned is False


def _inplace_kernels():
    def fused_inplace(x, residual, weight, eps, *, weight_offset=0.0, out=None, residual_out=None):
        return fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset,
                                     out=out, residual_out=residual)

    return NormKernels("in-place", rmsnorm_ref, fused_inplace, residual_in_place=True)


def test_no_certificate_when_the_next_read_writes_the_residual_in_place():
    """With a following read that updates the residual in place, an owned capture would be
    overwritten; the boundary must pass it borrowed so the collector keeps a correct copy."""
    spec = AddNormReadSpec(_inplace_kernels())
    a0, f0 = layer(ffn_read=spec)
    a1, f1 = layer(previous=declare_ffn(read=spec), ffn_read=spec, terminal=True)
    f1.plan.read._checked_fused = True  # past its first call, which works on copies (it is checked)
    fb = started()
    x = rand(T, H)
    aux = AuxHiddenStateList()
    rec = Recorder()
    inp = f0.prepare(a0.finish(a0.prepare(x, fb) * 2, fb), fb)
    with f0.exit(fb) as out:
        c = inp * 3
    r = fb.residual_stream.residual.clone()
    inp = a1.prepare(out.finish(c), fb, capture_output=lambda v, owned=False: (rec(v, owned=owned),
                                                                              aux.capture(v, owned=owned)))
    assert rec.calls[0][1] is False
    captured = (r + c).clone()
    # The next FFN's in-place kernel overwrites the residual storage the capture aliased.
    f1.prepare(a1.finish(inp * 2, fb), fb)
    assert not torch.equal(rec.calls[0][0], captured)  # the borrowed storage did change ...
    torch.testing.assert_close(aux[0], captured, **TOL)  # ... and the collector kept a copy


def test_capture_in_a_forward_matches_the_residuals():
    """Captures at every attention input of a two-layer forward, collected and checked at the end."""
    a0, f0 = layer()
    a1, f1 = layer(previous=declare_ffn(), terminal=True)
    w = [rand(H, H, seed=10 + i) for i in range(4)]
    fb = started()
    x = rand(T, H)
    aux = AuxHiddenStateList()
    h = x
    expected = [x.clone()]
    r = x.clone()
    for i, (attn, ffn) in enumerate(((a0, f0), (a1, f1))):
        inp = attn.prepare(h, fb, capture_output=aux.capture)
        c = inp @ w[2 * i].T
        h = attn.finish(c, fb)
        r = r + c
        inp = ffn.prepare(h, fb)
        with ffn.exit(fb) as out:
            d = inp @ w[2 * i + 1].T
        h = out.finish(d)
        r = r + d
        if i == 0:
            expected.append(r.clone())
    rb.norm(h, fb, make_norm(H, F64, seed=5))
    assert len(aux) == 2
    assert aux[0] is not x  # borrowed at entry: copied
    for got, want in zip(aux, expected):
        torch.testing.assert_close(got, want, **TOL)


def test_captured_last_layer_outputs_collects_the_updated_residual():
    a0, f0 = layer()
    a1, f1 = layer(previous=declare_ffn(), terminal=True)
    fb = started()
    x = rand(T, H)
    inp = f0.prepare(a0.finish(a0.prepare(x, fb) * 2, fb), fb)
    with f0.exit(fb) as out:
        c = inp * 3
    r = fb.residual_stream.residual.clone()
    rec = Recorder()
    a1.prepare(out.finish(c), fb, captured_last_layer_outputs=rec)
    ((value, owned),) = rec.calls
    assert owned is True
    torch.testing.assert_close(value, r + c, rtol=0, atol=0)


def test_capture_and_collector_together_see_the_same_residual():
    a0, f0 = layer()
    fb = started()
    stream, h = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1))
    fb.residual_stream = stream
    r1, r2 = Recorder(), Recorder()
    a0.prepare(h, fb, capture_output=r1, captured_last_layer_outputs=r2)
    assert r1.calls[0][0] is r2.calls[0][0] is stream.residual


@pytest.mark.parametrize("kw", ["capture_output", "captured_last_layer_outputs"])
def test_ffn_prepare_refuses_capture(kw):
    a0, f0 = layer()
    fb = started()
    h = a0.finish(a0.prepare(rand(T, H), fb), fb)
    rec = Recorder()
    with pytest.raises(TypeError, match="FFN prepare"):
        f0.prepare(h, fb, **{kw: rec})
    assert rec.calls == []
    assert fb.residual_stream.state is StreamState.PENDING  # nothing was consumed
    f0.prepare(h, fb)


# -- boundary.capture_output() -----------------------------------------------------------------


def _consumer(previous=None):
    (attn,) = make_stages((declare_attn(), make_norm(H, F64)), previous=previous)
    return attn


def test_capture_output_snapshots_a_static_sum_on_a_copy(fake_dist: FakeCollectives):
    group = fake_topology().tp
    r, c = rand(T, H), rand(T, H, seed=1)
    stream, h = ResidualStream.arrive(residual=r.clone(), output=c.clone(),
                                      owed=(Owed(OwedKind.SUM, SumGroup.TP, group, static=True),))
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    handle, snap = _consumer().capture_output(h, fb)
    assert handle is h and isinstance(handle, OwedOutput)  # the main output still owes its sum
    assert fake_dist.calls == [T]
    torch.testing.assert_close(snap, r + 2 * c, rtol=0, atol=0)
    torch.testing.assert_close(stream.pending.value, c, rtol=0, atol=0)  # main value untouched
    out = rb.fold(handle, fb)
    assert fake_dist.calls == [T, T]
    torch.testing.assert_close(out, r + 2 * c, rtol=0, atol=0)


def test_capture_output_completes_a_dynamic_sum_on_the_main_output(fake_dist: FakeCollectives):
    group = fake_topology().tp
    r, c = rand(T, H), rand(T, H, seed=1)
    stream, h = ResidualStream.arrive(residual=r.clone(), output=c.clone(),
                                      owed=(Owed(OwedKind.SUM, SumGroup.TP, group, static=False),))
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    handle, snap = _consumer().capture_output(h, fb)
    assert isinstance(handle, torch.Tensor) and handle is not h
    assert fake_dist.calls == [T]
    torch.testing.assert_close(snap, r + 2 * c, rtol=0, atol=0)
    assert snap.data_ptr() not in (handle.data_ptr(), stream.residual.data_ptr())
    out = rb.fold(handle, fb)
    assert fake_dist.calls == [T]  # not summed again
    torch.testing.assert_close(out, r + 2 * c, rtol=0, atol=0)


def test_capture_output_with_a_solo_static_sum():
    r, c = rand(T, H), rand(T, H, seed=1)
    stream, h = ResidualStream.arrive(residual=r, output=c, owed=(solo_sum(),))
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    handle, snap = _consumer().capture_output(h, fb)
    assert handle is h
    torch.testing.assert_close(snap, r + c, rtol=0, atol=0)
    snap.zero_()
    torch.testing.assert_close(rb.fold(handle, fb), r + c, rtol=0, atol=0)


def test_capture_output_of_a_written_stream():
    r = rand(T, H)
    stream, h = ResidualStream.arrive(residual=r)
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    handle, snap = _consumer().capture_output(h, fb)
    assert handle is h and snap is not r
    torch.testing.assert_close(snap, r, rtol=0, atol=0)


def test_capture_output_requires_a_plain_update():
    stream, h = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1), update=HalfSkip())
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        _consumer(previous=declare_attn(update=HalfSkip())).capture_output(h, fb)


def test_capture_output_refuses_a_handoff():
    a, f = make_stages(
        (declare_attn(), make_norm(H, F64)),
        (declare_ffn(sparse=True), make_norm(H, F64, seed=1), {"fusions": Provider(finalize=True)}),
        following=declare_attn(),
    )
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with f.exit(fb) as out:
        handoff, runs = counted_handoff(inp * 2)
    h = out.finish(handoff)
    with pytest.raises(BoundaryError, match="handoff"):
        _consumer(previous=declare_ffn(sparse=True)).capture_output(h, fb)
    assert runs == []


def test_an_in_place_kernel_never_overwrites_the_models_input():
    """The entry aliases the stack's input as the residual; before, the first in-place fused add
    + norm wrote the updated residual over the model's tensor (the reference kernels do not), so a
    caller reusing its input (a comparison, a second run) got different numbers by plugin."""
    spec = AddNormReadSpec(_inplace_kernels())
    a0, f0 = layer(ffn_read=spec)
    fb = started()
    x = rand(T, H)
    kept = x.clone()
    inp = f0.prepare(a0.finish(a0.prepare(x, fb) * 2, fb), fb)
    assert torch.equal(x, kept)
    r = fb.residual_stream.residual
    torch.testing.assert_close(r, kept + 2 * a0.plan.read.read(kept), **TOL)
    # Copied once: the next in-place update writes the boundary's own residual.
    assert not fb.residual_stream.borrowed
