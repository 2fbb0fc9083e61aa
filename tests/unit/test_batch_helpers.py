"""The residual.batch helpers: start, norm, fold, written, take_output, complete_output, snapshot
and add_to_output, each on the stream states it accepts, with the numbers it must give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import (
    rand,
    FakeCollectives,
    HalfSkip,
    Provider,
    Recorder,
    counted_handoff,
    declare,
    fake_topology,
    install_fake_dist,
    make_norm,
    raises_exact,
    rms,
    solo_sum,
)
from layer_boundary import (
    BoundaryError,
    ForwardBatch,
    GemmaRMSNorm,
    ResidualStream,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._contracts import Owed, OwedKind
from layer_boundary._layout import SumGroup
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary._errors import FOREIGN_OUTPUT, SNAPSHOT_PLAIN, START_FIRST, WRITE_BEFORE_TAKE
from layer_boundary.residual import batch as rb

H, T = 8, 3
F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def on(stream):
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    return fb


def pending(r=None, c=None, owed=(), update=None, tokens=T):
    """A batch whose stream holds residual ``r`` and pending contribution ``c``."""
    r = rand(tokens, H) if r is None else r
    c = rand(tokens, H, seed=1) if c is None else c
    stream, h = ResidualStream.arrive(residual=r, output=c, owed=owed, update=update)
    fb = ForwardBatch.for_tokens(tokens)
    fb.residual_stream = stream
    return fb, h, r.clone(), c.clone() if isinstance(c, torch.Tensor) else c


def written_stream(r=None):
    r = rand(T, H) if r is None else r
    stream, h = ResidualStream.arrive(residual=r)
    return on(stream), h, r


class HandoffLayer:
    """An attention + sparse-FFN layer whose FFN returns a counted finalize handoff, and the next
    consumer (an attention stage, or the final norm when ``terminal``)."""

    def __init__(self, *, terminal=False, tokens=T, gemma_final=False):
        self.attn, self.ffn = make_stages(
            (declare_attn(), make_norm(H, F64)),
            (declare_ffn(sparse=True), make_norm(H, F64, seed=1), {"fusions": Provider(finalize=True)}),
            terminal=terminal,
            following=None if terminal else declare_attn(),
        )
        self.next_norm = make_norm(H, F64, seed=2)
        (self.next,) = make_stages((declare_attn(), self.next_norm), previous=declare_ffn(sparse=True))
        self.fb = ForwardBatch.for_tokens(tokens)
        rb.start(self.fb)
        self.x = rand(tokens, H, seed=3)
        inp = self.attn.prepare(self.x, self.fb)
        self.y = inp * 0.5
        inp = self.ffn.prepare(self.attn.finish(self.y, self.fb), self.fb)
        self.r = self.x + self.y  # the residual the handoff's update lands on
        self.c = inp * 2
        with self.ffn.exit(self.fb) as out:
            assert out.defer_moe_finalize
            self.handoff, self.runs = counted_handoff(self.c.clone())
        self.h = out.finish(self.handoff)
        assert isinstance(self.h, OwedOutput)


class BlackBoxNorm(nn.Module):
    """A norm without RMSNorm parameters: the boundary calls it as a module; calls are counted."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * 2


class Service:
    """A handoff_norm service: records its calls and returns a marker tensor."""

    def __init__(self):
        self.calls = []

    def finalize(self, handoff, residual, gamma):
        self.calls.append((handoff, residual, gamma))
        return torch.full((handoff.num_tokens, H), 7.0, dtype=F64)


# -- start -------------------------------------------------------------------------------------


def test_start_gives_a_fresh_initial_stream_and_releases_the_old_one():
    fb, h, r, c = pending()
    old = fb.residual_stream
    new = rb.start(fb)
    assert fb.residual_stream is new and new is not old
    assert new.state is StreamState.INITIAL and not new.released
    assert old.released and old.residual is None and old.pending is None


def test_start_needs_a_settable_attribute():
    class Frozen:
        __slots__ = ("num_tokens",)

    with pytest.raises(TypeError, match="residual_stream"):
        rb.start(Frozen())


# -- norm --------------------------------------------------------------------------------------


@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_norm_of_a_pending_stream(gemma):
    final = make_norm(H, F64, gemma=gemma, seed=4)
    fb, h, r, c = pending()
    out = rb.norm(h, fb, final)
    torch.testing.assert_close(out, rms(r + c, final.weight, offset=1.0 if gemma else 0.0), **TOL)
    assert fb.residual_stream.released


def test_norm_of_written_and_initial_streams():
    final = make_norm(H, F64, seed=4)
    fb, h, r = written_stream()
    torch.testing.assert_close(rb.norm(h, fb, final), rms(r, final.weight), **TOL)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = rand(T, H, seed=6)
    torch.testing.assert_close(rb.norm(x, fb, final), rms(x, final.weight), **TOL)
    assert fb.residual_stream.released


def test_norm_capture_gets_the_updated_residual_borrowed():
    final = make_norm(H, F64, seed=4)
    fb, h, r, c = pending()
    rec = Recorder()
    rb.norm(h, fb, final, capture_output=rec)
    ((value, owned),) = rec.calls
    assert owned is False
    torch.testing.assert_close(value, r + c, rtol=0, atol=0)


def test_a_refused_norm_leaves_the_stream_for_the_retry():
    # Issue 32: releasing on a refusal answered the corrected retry with START_FIRST.
    fb, h, r, c = pending()
    norm = make_norm(H, F64)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.norm(h.clone(), fb, norm)
    assert not fb.residual_stream.released
    torch.testing.assert_close(rb.norm(h, fb, norm), norm(r + c), rtol=0, atol=0)
    with raises_exact(BoundaryError, START_FIRST):  # released once it succeeded
        rb.norm(h, fb, norm)


def test_norm_skip_empty_completes_a_handoff_and_skips_the_kernel():
    layer = HandoffLayer(terminal=True, tokens=0)
    final = BlackBoxNorm()
    rec = Recorder()
    out = rb.norm(layer.h, layer.fb, final, skip_empty=True, capture_output=rec)
    assert isinstance(out, torch.Tensor) and out.shape == (0, H)
    assert layer.runs == [1]  # the owed finalize ran once
    assert final.calls == 0  # only the norm kernel was skipped
    assert rec.calls and rec.calls[0][0].shape == (0, H)
    assert layer.fb.residual_stream.released


def test_norm_skip_empty_completes_an_owed_sum(fake_dist: FakeCollectives):
    topo = fake_topology()
    attn, ffn = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                            topology=topo)
    fb = ForwardBatch.for_tokens(0)
    rb.start(fb)
    inp = attn.prepare(torch.empty(0, H, dtype=F64), fb)
    h = attn.finish(inp * 2, fb)
    assert isinstance(h, OwedOutput)
    final = BlackBoxNorm()
    out = rb.norm(h, fb, final, skip_empty=True)
    assert out.shape == (0, H)
    assert fake_dist.calls == [0]  # the collective other ranks join still ran, once
    assert final.calls == 0


def test_norm_of_an_empty_batch_without_skip_empty_runs_the_kernel():
    fb, h, r, c = pending(tokens=0)
    final = BlackBoxNorm()
    out = rb.norm(h, fb, final)
    assert out.shape == (0, H) and final.calls == 1


def test_norm_skip_empty_with_tokens_still_normalizes():
    final = make_norm(H, F64, seed=4)
    fb, h, r, c = pending()
    torch.testing.assert_close(rb.norm(h, fb, final, skip_empty=True), rms(r + c, final.weight), **TOL)


def test_norm_handoff_norm_fuses_the_handoff():
    layer = HandoffLayer(terminal=True)
    final = GemmaRMSNorm(H, dtype=F64)
    service = Service()
    residual = layer.fb.residual_stream.residual
    out = rb.norm(layer.h, layer.fb, final, handoff_norm=service)
    ((handoff, res, gamma),) = service.calls
    assert handoff is layer.handoff
    assert res is residual
    torch.testing.assert_close(res, layer.r, rtol=0, atol=0)
    assert gamma is final.gemma_weight
    assert torch.equal(out, torch.full((T, H), 7.0, dtype=F64))
    assert layer.runs == []  # the service did the finalize; the unfused path never ran
    assert layer.fb.residual_stream.released


def test_norm_handoff_norm_refuses_capture_when_a_handoff_arrives():
    layer = HandoffLayer(terminal=True)
    service = Service()
    with pytest.raises(BoundaryError, match="capture_output"):
        rb.norm(layer.h, layer.fb, GemmaRMSNorm(H, dtype=F64), handoff_norm=service,
                capture_output=Recorder())
    assert service.calls == [] and layer.runs == []
    # Refused before it changed the stream: the retry without the capture runs the handoff.
    assert not layer.fb.residual_stream.released
    rb.norm(layer.h, layer.fb, GemmaRMSNorm(H, dtype=F64), handoff_norm=service)
    assert len(service.calls) == 1 and layer.fb.residual_stream.released


def test_norm_handoff_norm_needs_a_gemma_norm():
    layer = HandoffLayer(terminal=True)
    with pytest.raises(TypeError, match="gemma_weight"):
        rb.norm(layer.h, layer.fb, BlackBoxNorm(), handoff_norm=Service())


def test_norm_without_handoff_norm_completes_the_handoff_unfused_and_captures():
    layer = HandoffLayer(terminal=True)
    final = make_norm(H, F64, seed=4)
    rec = Recorder()
    out = rb.norm(layer.h, layer.fb, final, capture_output=rec)
    assert layer.runs == [1]
    torch.testing.assert_close(out, rms(layer.r + layer.c, final.weight), **TOL)
    ((value, owned),) = rec.calls
    assert owned is False
    torch.testing.assert_close(value, layer.r + layer.c, **TOL)


def test_norm_handoff_norm_is_unused_without_a_handoff():
    final = make_norm(H, F64, gemma=True, seed=4)
    fb, h, r, c = pending()
    service, rec = Service(), Recorder()
    out = rb.norm(h, fb, final, handoff_norm=service, capture_output=rec)
    assert service.calls == []
    torch.testing.assert_close(out, rms(r + c, final.weight, offset=1.0), **TOL)
    assert len(rec.calls) == 1


# -- fold --------------------------------------------------------------------------------------


def test_fold_applies_the_update_once():
    fb, h, r, c = pending()
    out = rb.fold(h, fb)
    stream = fb.residual_stream
    assert stream.state is StreamState.WRITTEN and stream.residual is out
    torch.testing.assert_close(out, r + c, rtol=0, atol=0)
    # Folding again is a no-op on a written stream.
    assert rb.fold(out, fb) is out
    torch.testing.assert_close(stream.residual, r + c, rtol=0, atol=0)
    # The next read applies nothing more.
    n = make_norm(H, F64)
    (attn,) = make_stages((declare_attn(), n))
    inp = attn.prepare(out, fb)
    torch.testing.assert_close(inp, rms(r + c, n.weight), **TOL)


def test_fold_completes_an_owed_sum_once(fake_dist: FakeCollectives):
    group = fake_topology().tp
    fb, h, r, c = pending(owed=(Owed(OwedKind.SUM, SumGroup.TP, group, static=True),))
    out = rb.fold(h, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(out, r + 2 * c, rtol=0, atol=0)


def test_fold_completes_a_handoff_once():
    layer = HandoffLayer()
    out = rb.fold(layer.h, layer.fb)
    assert layer.runs == [1]
    torch.testing.assert_close(out, layer.r + layer.c, **TOL)
    layer.next.prepare(out, layer.fb)
    assert layer.runs == [1]


def test_fold_on_an_initial_stream_writes_the_tensor():
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = rand(T, H)
    assert rb.fold(x, fb) is x
    assert fb.residual_stream.state is StreamState.WRITTEN and fb.residual_stream.residual is x


# -- written -----------------------------------------------------------------------------------


def test_written_discards_the_pending_contribution():
    fb, h, r, c = pending()
    new = rand(T, H, seed=9)
    out = rb.written(new, fb)
    stream = fb.residual_stream
    assert out is new and stream.residual is new and stream.pending is None
    assert stream.state is StreamState.WRITTEN
    n = make_norm(H, F64)
    (attn,) = make_stages((declare_attn(), n))
    inp = attn.prepare(out, fb)
    torch.testing.assert_close(inp, rms(new, n.weight), **TOL)  # c is gone
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.fold(h, fb)


def test_written_needs_a_tensor():
    fb, h, r, c = pending(owed=(solo_sum(),))
    with pytest.raises(TypeError):
        rb.written(h, fb)


# -- take_output -------------------------------------------------------------------------------


def test_take_output_returns_the_written_residual_and_releases():
    fb, h, r = written_stream()
    assert rb.take_output(h, fb) is h
    assert fb.residual_stream.released
    with raises_exact(BoundaryError, START_FIRST):
        rb.take_output(h, fb)


def test_take_output_after_fold():
    fb, h, r, c = pending()
    h = rb.fold(h, fb)
    out = rb.take_output(h, fb)
    torch.testing.assert_close(out, r + c, rtol=0, atol=0)


def test_take_output_rejects_a_pending_contribution_and_keeps_the_stream():
    # The spec's refusal says to fold or norm it first: that needs the stream (issue 32).
    fb, h, r, c = pending()
    with raises_exact(BoundaryError, WRITE_BEFORE_TAKE):
        rb.take_output(h, fb)
    assert not fb.residual_stream.released
    h = rb.fold(h, fb)
    torch.testing.assert_close(rb.take_output(h, fb), r + c, rtol=0, atol=0)
    assert fb.residual_stream.released
    with raises_exact(BoundaryError, START_FIRST):
        rb.take_output(h, fb)


def test_take_output_rejects_a_foreign_output_and_keeps_the_stream():
    fb, h, r = written_stream()
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.take_output(h.clone(), fb)
    assert torch.equal(rb.take_output(h, fb), r)
    with raises_exact(BoundaryError, START_FIRST):
        rb.take_output(h, fb)


# -- complete_output ---------------------------------------------------------------------------


def test_complete_output_runs_a_handoff_once_and_keeps_the_update_pending():
    layer = HandoffLayer()
    out = rb.complete_output(layer.h, layer.fb)
    assert isinstance(out, torch.Tensor) and layer.runs == [1]
    torch.testing.assert_close(out, layer.c, rtol=0, atol=0)
    stream = layer.fb.residual_stream
    assert stream.state is StreamState.PENDING
    torch.testing.assert_close(stream.residual, layer.r, **TOL)  # the residual is not updated yet
    # Completing again is harmless and does not finalize twice.
    assert rb.complete_output(out, layer.fb) is out
    inp = layer.next.prepare(out, layer.fb)
    assert layer.runs == [1]
    torch.testing.assert_close(stream.residual, layer.r + layer.c, **TOL)
    torch.testing.assert_close(inp, rms(layer.r + layer.c, layer.next_norm.weight), **TOL)


def test_complete_output_sums_once_and_keeps_the_update_pending(fake_dist: FakeCollectives):
    topo = fake_topology()
    attn, ffn = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                            topology=topo)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = rand(T, H)
    inp = attn.prepare(x, fb)
    y = inp * 2
    h = attn.finish(y.clone(), fb)
    out = rb.complete_output(h, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(out, 2 * y, rtol=0, atol=0)
    assert fb.residual_stream.state is StreamState.PENDING
    ffn.prepare(out, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(fb.residual_stream.residual, x + 2 * y, rtol=0, atol=0)


def test_complete_output_of_a_complete_or_written_output_changes_nothing():
    fb, h, r, c = pending()
    assert rb.complete_output(h, fb) is h
    assert fb.residual_stream.state is StreamState.PENDING
    fb, h, r = written_stream()
    assert rb.complete_output(h, fb) is h
    assert fb.residual_stream.state is StreamState.WRITTEN


# -- snapshot ----------------------------------------------------------------------------------


def test_snapshot_is_an_owned_copy_and_leaves_the_stream_unchanged():
    fb, h, r, c = pending()
    stream = fb.residual_stream
    before = (stream.state, stream.pending, stream.handle, stream.residual)
    snap = rb.snapshot(h, fb)
    torch.testing.assert_close(snap, r + c, rtol=0, atol=0)
    assert (stream.state, stream.pending, stream.handle, stream.residual) == before
    assert snap.data_ptr() not in (stream.residual.data_ptr(), stream.pending.value.data_ptr())
    snap.fill_(123.0)  # the copy is the caller's
    out = rb.fold(h, fb)  # the handle is still valid and the update applies once
    torch.testing.assert_close(out, r + c, rtol=0, atol=0)


def test_snapshot_of_a_written_stream_is_a_copy():
    fb, h, r = written_stream()
    snap = rb.snapshot(h, fb)
    assert snap is not h and snap.data_ptr() != h.data_ptr()
    torch.testing.assert_close(snap, r, rtol=0, atol=0)
    assert fb.residual_stream.handle is h


def test_snapshot_computes_a_static_sum_on_a_copy(fake_dist: FakeCollectives):
    group = fake_topology().tp
    fb, h, r, c = pending(owed=(Owed(OwedKind.SUM, SumGroup.TP, group, static=True),))
    snap = rb.snapshot(h, fb)
    torch.testing.assert_close(snap, r + 2 * c, rtol=0, atol=0)
    assert fake_dist.calls == [T]
    # The main contribution still owes its sum (same handle), and completes it once.
    assert fb.residual_stream.handle is h and isinstance(h, OwedOutput)
    out = rb.fold(h, fb)
    assert fake_dist.calls == [T, T]
    torch.testing.assert_close(out, r + 2 * c, rtol=0, atol=0)


def test_snapshot_requires_a_plain_update():
    fb, h, r, c = pending(update=HalfSkip())
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        rb.snapshot(h, fb)
    # The stream is untouched and the nonlinear update still applies.
    out = rb.fold(h, fb)
    torch.testing.assert_close(out, r / 2 + c, rtol=0, atol=0)


def test_snapshot_requires_a_plain_update_from_a_stage():
    attn, ffn = make_stages(
        (declare_attn(update=HalfSkip()), make_norm(H, F64)),
        (declare_ffn(), make_norm(H, F64, seed=1)),
    )
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = rand(T, H)
    inp = attn.prepare(x, fb)
    h = attn.finish(inp * 2, fb)
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        rb.snapshot(h, fb)
    ffn.prepare(h, fb)
    torch.testing.assert_close(fb.residual_stream.residual, x / 2 + inp * 2, **TOL)


def test_snapshot_raises_on_a_handoff():
    layer = HandoffLayer()
    with pytest.raises(BoundaryError, match="handoff"):
        rb.snapshot(layer.h, layer.fb)
    assert layer.runs == []
    # After complete_output the handoff is a plain contribution and can be snapshotted.
    out = rb.complete_output(layer.h, layer.fb)
    torch.testing.assert_close(rb.snapshot(out, layer.fb), layer.r + layer.c, **TOL)
    assert layer.runs == [1]


# -- add_to_output -----------------------------------------------------------------------------


def test_add_to_output_adds_extra_once_and_keeps_the_update_pending():
    fb, h, r, c = pending()
    e = rand(T, H, seed=7)
    e_copy = e.clone()
    h2 = rb.add_to_output(h, fb, e)
    assert h2 is not h and fb.residual_stream.state is StreamState.PENDING
    torch.testing.assert_close(fb.residual_stream.residual, r, rtol=0, atol=0)
    e.fill_(1000.0)  # the caller's tensor is not retained
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.fold(h, fb)
    out = rb.fold(h2, fb)
    torch.testing.assert_close(out, r + c + e_copy, **TOL)


def test_add_to_output_completes_the_sum_before_adding(fake_dist: FakeCollectives):
    group = fake_topology().tp
    fb, h, r, c = pending(owed=(Owed(OwedKind.SUM, SumGroup.TP, group, static=True),))
    e = rand(T, H, seed=7)
    h2 = rb.add_to_output(h, fb, e)
    assert fake_dist.calls == [T] and isinstance(h2, torch.Tensor)
    out = rb.fold(h2, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(out, r + 2 * c + e, **TOL)  # not r + 2 * (c + e)


def test_add_to_output_completes_a_handoff_first():
    layer = HandoffLayer()
    e = rand(T, H, seed=7)
    h = rb.add_to_output(layer.h, layer.fb, e)
    assert layer.runs == [1]
    layer.next.prepare(h, layer.fb)
    assert layer.runs == [1]
    torch.testing.assert_close(layer.fb.residual_stream.residual, layer.r + layer.c + e, **TOL)


def test_add_to_output_on_a_written_stream_makes_extra_pending():
    fb, h, r = written_stream()
    e = rand(T, H, seed=7)
    h2 = rb.add_to_output(h, fb, e)
    assert fb.residual_stream.state is StreamState.PENDING
    e.zero_()
    out = rb.fold(h2, fb)
    torch.testing.assert_close(out, r + rand(T, H, seed=7), **TOL)


def test_add_to_output_twice_adds_both():
    fb, h, r, c = pending()
    e1, e2 = rand(T, H, seed=7), rand(T, H, seed=8)
    h = rb.add_to_output(h, fb, e1)
    h = rb.add_to_output(h, fb, e2)
    torch.testing.assert_close(rb.fold(h, fb), r + c + e1 + e2, **TOL)


def test_add_to_output_checks_extra():
    fb, h, r, c = pending()
    with pytest.raises(TypeError):
        rb.add_to_output(h, fb, 1.0)
    with pytest.raises(ValueError, match="shape"):
        rb.add_to_output(h, fb, torch.ones(T + 1, H, dtype=F64))
    # Neither attempt changed the stream.
    torch.testing.assert_close(rb.fold(h, fb), r + c, rtol=0, atol=0)


def test_helpers_need_a_started_stack():
    fb = ForwardBatch.for_tokens(T)
    x = rand(T, H)
    calls = [
        lambda: rb.norm(x, fb, make_norm(H, F64)),
        lambda: rb.fold(x, fb),
        lambda: rb.written(x, fb),
        lambda: rb.take_output(x, fb),
        lambda: rb.complete_output(x, fb),
        lambda: rb.snapshot(x, fb),
        lambda: rb.add_to_output(x, fb, x),
    ]
    for call in calls:
        with raises_exact(BoundaryError, START_FIRST):
            call()


def test_mixer_output_through_helpers(fake_dist: FakeCollectives):
    """A dynamic (exit-decided) sum: snapshot computes it on a copy; the main output owes it."""
    topo = fake_topology()
    m, f = make_stages((declare("mixer"), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                       topology=topo)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = rand(T, H)
    inp = m.prepare(x, fb)
    with m.exit(fb) as out:
        y = inp * 3
    h = out.finish(y.clone())
    snap = rb.snapshot(h, fb)
    torch.testing.assert_close(snap, x + 2 * y, **TOL)
    f.prepare(h, fb)
    assert fake_dist.calls == [T, T]
    torch.testing.assert_close(fb.residual_stream.residual, x + 2 * y, **TOL)
