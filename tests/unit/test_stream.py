"""The ResidualStream state machine: transitions, identity checks, owed handles, release of
consumed contributions and one pending contribution at a time."""

from __future__ import annotations

import weakref

import pytest
import torch

from helpers import (
    rand,
    NORM_OF,
    FakeCollectives,
    Provider,
    counted_handoff,
    declare,
    fake_topology,
    install_fake_dist,
    make_norm,
    raises_exact,
    rms,
    run_stage,
    solo_sum,
    two_layer,
)
from layer_boundary import BoundaryError, ForwardBatch, ResidualStream, declare_attn, declare_ffn, make_stages
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary._errors import FOREIGN_OUTPUT, WRITE_BEFORE_TAKE, START_FIRST
from layer_boundary.residual import batch as rb

H, T = 8, 3
F64 = torch.float64


def started(num_tokens=T):
    fb = ForwardBatch.for_tokens(num_tokens)
    rb.start(fb)
    return fb


def with_stream(stream):
    fb = ForwardBatch.for_tokens(T)
    fb.residual_stream = stream
    return fb


@pytest.fixture
def stack():
    return two_layer(H)


# -- transitions -------------------------------------------------------------------------------


def test_transitions_through_a_layer(stack):
    (_, a0), (_, f0), (_, a1), (_, f1) = stack
    fb = ForwardBatch.for_tokens(T)
    assert fb.residual_stream is None
    stream = rb.start(fb)
    assert fb.residual_stream is stream and stream.state is StreamState.INITIAL
    x = rand(T, H)
    inp = a0.prepare(x, fb)
    assert stream.state is StreamState.WRITTEN
    assert stream.residual is x  # enter keeps the stack input as the residual
    torch.testing.assert_close(inp, rms(x, NORM_OF[a0].weight), rtol=1e-12, atol=1e-12)
    c = inp * 3
    h = a0.finish(c, fb)
    assert h is c and stream.state is StreamState.PENDING
    inp = f0.prepare(h, fb)
    assert stream.state is StreamState.WRITTEN
    torch.testing.assert_close(stream.residual, x + c, rtol=0, atol=0)
    torch.testing.assert_close(inp, rms(x + c, NORM_OF[f0].weight), rtol=1e-12, atol=1e-12)
    with f0.exit(fb) as out:
        d = inp * 2
    h = out.finish(d)
    assert h is d and stream.state is StreamState.PENDING
    h = rb.fold(h, fb)
    assert stream.state is StreamState.WRITTEN
    torch.testing.assert_close(h, x + c + d, rtol=0, atol=0)
    h = rb.add_to_output(h, fb, torch.ones(T, H, dtype=F64))
    assert stream.state is StreamState.PENDING
    h = rb.written(torch.zeros(T, H, dtype=F64), fb)
    assert stream.state is StreamState.WRITTEN and stream.pending is None
    out = rb.norm(h, fb, make_norm(H, F64, seed=9))
    assert out.shape == (T, H)
    assert stream.released and fb.residual_stream is stream
    with raises_exact(BoundaryError, START_FIRST):
        a0.prepare(x, fb)


def test_stack_entry_accepts_a_written_stream_and_skips_enter(stack):
    (_, a0), _, _, _ = stack
    r = rand(T, H)
    stream, handle = ResidualStream.arrive(residual=r)
    assert stream.state is StreamState.WRITTEN and handle is r
    fb = with_stream(stream)
    inp = a0.prepare(handle, fb)
    assert stream.residual is r and stream.state is StreamState.WRITTEN
    torch.testing.assert_close(inp, rms(r, NORM_OF[a0].weight), rtol=1e-12, atol=1e-12)


def test_stack_entry_accepts_a_pending_stream(stack):
    (_, a0), _, _, _ = stack
    r, c = rand(T, H), rand(T, H, seed=1)
    stream, handle = ResidualStream.arrive(residual=r, output=c)
    fb = with_stream(stream)
    inp = a0.prepare(handle, fb)
    torch.testing.assert_close(stream.residual, r + c, rtol=0, atol=0)
    torch.testing.assert_close(inp, rms(r + c, NORM_OF[a0].weight), rtol=1e-12, atol=1e-12)


def test_initial_stream_needs_the_stack_entry_stage(stack):
    _, (_, f0), _, _ = stack
    fb = started()
    with pytest.raises(BoundaryError, match="the residual stream is initial"):
        f0.prepare(rand(T, H), fb)


def test_arrive_forms():
    s, h = ResidualStream.arrive()
    assert s.state is StreamState.INITIAL and h is None
    c = rand(T, H)
    s, h = ResidualStream.arrive(output=c)
    assert s.state is StreamState.PENDING and h is c and s.residual is None
    s, h = ResidualStream.arrive(residual=rand(T, H), output=c, owed=(solo_sum(),))
    assert s.state is StreamState.PENDING and isinstance(h, OwedOutput)
    with pytest.raises(ValueError):
        ResidualStream.arrive(residual=rand(T, H), owed=(solo_sum(),))


def test_microbatches_have_independent_streams(stack):
    """Two microbatches, each with its own stream, interleaved stage by stage, give the rows of
    the whole batch."""
    x = rand(2 * T, H)
    w = [rand(H, H, seed=10 + i) for i in range(4)]

    def forward_whole(x):
        fb = started(2 * T)
        h = x
        for i, (kind, b) in enumerate(stack):
            h = run_stage(b, kind, h, fb, lambda v, i=i: v @ w[i].T)
        return rb.norm(h, fb, final)

    final = make_norm(H, F64, seed=7)
    whole = forward_whole(x)
    fbs = [started(T), started(T)]
    hs = [x[:T], x[T:]]
    for i, (kind, b) in enumerate(stack):
        for m in (0, 1):
            hs[m] = run_stage(b, kind, hs[m], fbs[m], lambda v, i=i: v @ w[i].T)
    parts = [rb.norm(hs[m], fbs[m], final) for m in (0, 1)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)


# -- identity ----------------------------------------------------------------------------------

# Every accessor that takes a layer output, as ``f(next_stage, handle, fb)``.
ACCESSORS = {
    "prepare": lambda nxt, h, fb: nxt.prepare(h, fb),
    "capture_output": lambda nxt, h, fb: nxt.capture_output(h, fb),
    "fold": lambda nxt, h, fb: rb.fold(h, fb),
    "snapshot": lambda nxt, h, fb: rb.snapshot(h, fb),
    "complete_output": lambda nxt, h, fb: rb.complete_output(h, fb),
    "add_to_output": lambda nxt, h, fb: rb.add_to_output(h, fb, torch.ones(T, H, dtype=F64)),
    "take_output": lambda nxt, h, fb: rb.take_output(h, fb),
    "norm": lambda nxt, h, fb: rb.norm(h, fb, make_norm(H, F64)),
}
RELEASING = ()  # no accessor releases the stream on a refusal (the retry needs it)


def _pending_after_attn(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    h = a0.finish(inp * 2, fb)
    return fb, h, f0


@pytest.mark.parametrize("name", list(ACCESSORS))
def test_clone_of_a_handle_is_refused(stack, name):
    fb, h, f0 = _pending_after_attn(stack)
    stream = fb.residual_stream
    pending_before = stream.pending
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        ACCESSORS[name](f0, h.clone(), fb)
    if name in RELEASING:
        assert stream.released
        with raises_exact(BoundaryError, START_FIRST):
            f0.prepare(h, fb)
    else:
        assert stream.pending is pending_before and stream.handle is h
        if name == "take_output":  # the real handle reaches the next check: the stream is pending
            with raises_exact(BoundaryError, WRITE_BEFORE_TAKE):
                ACCESSORS[name](f0, h, fb)
        else:
            ACCESSORS[name](f0, h, fb)  # the real handle still works


@pytest.mark.parametrize("name", list(ACCESSORS))
def test_rebound_output_is_refused(stack, name):
    fb, h, f0 = _pending_after_attn(stack)
    h2 = h + 0  # same numbers, another object: a rebinding
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        ACCESSORS[name](f0, h2, fb)


def test_views_of_a_handle_are_other_objects(stack):
    fb, h, f0 = _pending_after_attn(stack)
    for alias in (h.view(T, H), h[:], h.detach()):
        with raises_exact(BoundaryError, FOREIGN_OUTPUT):
            f0.prepare(alias, fb)
    f0.prepare(h, fb)


def test_compute_input_is_not_a_layer_output(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    for call in (lambda: f0.prepare(inp, fb), lambda: rb.fold(inp, fb), lambda: rb.snapshot(inp, fb)):
        with raises_exact(BoundaryError, FOREIGN_OUTPUT) as info:
            call()
        assert info.value.__notes__  # the specific reason rides along as a note


STALE_AFTER = ["fold", "add_to_output", "prepare", "written", "complete_output_owed", "capture_output_dynamic"]


@pytest.mark.parametrize("step", STALE_AFTER)
def test_handles_go_stale_after_a_write(stack, step, fake_dist):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    if step in ("complete_output_owed", "capture_output_dynamic"):
        # An owed handle: a dynamic sum decided by a mixer's exit before an FFN (fake TP=2).
        topo = fake_topology()
        mixer, ffn = make_stages((declare("mixer"), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                                 topology=topo)
        inp = mixer.prepare(rand(T, H), fb)
        with mixer.exit(fb) as out:
            assert out.skips_reduction
            y = inp * 2
        old = out.finish(y)
        assert isinstance(old, OwedOutput)
        if step == "complete_output_owed":
            new = rb.complete_output(old, fb)
        else:
            new, _ = ffn.capture_output(old, fb)
        assert isinstance(new, torch.Tensor) and new is not old
        f0 = ffn
    else:
        inp = a0.prepare(rand(T, H), fb)
        old = a0.finish(inp * 2, fb)
        if step == "fold":
            new = rb.fold(old, fb)
        elif step == "add_to_output":
            new = rb.add_to_output(old, fb, torch.ones(T, H, dtype=F64))
        elif step == "written":
            new = rb.written(rand(T, H, seed=4), fb)
        else:
            f0.prepare(old, fb)
            new = None
        assert new is not old
    for call in (lambda h: rb.fold(h, fb), lambda h: rb.snapshot(h, fb), lambda h: f0.prepare(h, fb)):
        with raises_exact(BoundaryError, FOREIGN_OUTPUT):
            call(old)
    if new is not None:
        f0.prepare(new, fb)


@pytest.mark.parametrize("step", ["fold", "complete_output", "add_to_output", "written", "prepare"])
def test_owed_handles_go_stale_after_a_write(step):
    fb, old = _owed_by_handoff() if step == "prepare" else _owed_by_arrive()
    assert isinstance(old, OwedOutput)
    if step == "fold":
        new = rb.fold(old, fb)
    elif step == "complete_output":
        new = rb.complete_output(old, fb)
    elif step == "add_to_output":
        new = rb.add_to_output(old, fb, torch.ones(T, H, dtype=F64))
    elif step == "written":
        new = rb.written(rand(T, H, seed=4), fb)
    else:
        (nxt,) = make_stages((declare_attn(), make_norm(H, F64)), previous=declare_ffn(sparse=True))
        nxt.prepare(old, fb)
        new = None
    for call in (rb.fold, rb.snapshot, rb.complete_output):
        with raises_exact(BoundaryError, FOREIGN_OUTPUT):
            call(old, fb)
    if new is not None:
        assert isinstance(new, torch.Tensor)
        rb.fold(new, fb)


def test_output_of_another_stream_is_refused(stack):
    (_, a0), (_, f0), _, _ = stack
    fb1, fb2 = started(), started()
    h1 = a0.finish(a0.prepare(rand(T, H), fb1) * 2, fb1)
    h2 = a0.finish(a0.prepare(rand(T, H, seed=1), fb2) * 2, fb2)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        f0.prepare(h1, fb2)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.fold(h2, fb1)
    # Both streams are intact.
    f0.prepare(h1, fb1)
    f0.prepare(h2, fb2)


def test_owed_output_of_another_stream_is_refused():
    s1, h1 = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1), owed=(solo_sum(),))
    s2, h2 = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=2), owed=(solo_sum(),))
    fb1, fb2 = with_stream(s1), with_stream(s2)
    for f in (rb.fold, rb.complete_output, rb.snapshot):
        with raises_exact(BoundaryError, FOREIGN_OUTPUT) as info:
            f(h1, fb2)
        assert info.value.__notes__
    assert isinstance(rb.complete_output(h1, fb1), torch.Tensor)
    assert isinstance(rb.complete_output(h2, fb2), torch.Tensor)


# -- owed handles ------------------------------------------------------------------------------


def _owed_by_arrive():
    stream, h = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1), owed=(solo_sum(),))
    return with_stream(stream), h


def _owed_by_handoff():
    (a, f) = make_stages(
        (declare_attn(), make_norm(H, F64)),
        (declare_ffn(sparse=True), make_norm(H, F64, seed=1), {"fusions": Provider(finalize=True)}),
        following=declare_attn(),
    )
    fb = started()
    inp = a.prepare(rand(T, H), fb)
    inp = f.prepare(a.finish(inp, fb), fb)
    with f.exit(fb) as out:
        handoff, _ = counted_handoff(inp * 2, scratch=torch.zeros(T, H))
    return fb, out.finish(handoff)


MISUSES = {
    "add": lambda h: h + 1,
    "radd": lambda h: 1 + h,
    "iadd": lambda h: h.__iadd__(1),
    "sub": lambda h: h - 1,
    "mul": lambda h: h * 2,
    "rmul": lambda h: 2.0 * h,
    "truediv": lambda h: h / 2,
    "matmul": lambda h: h @ torch.eye(H, dtype=F64),
    "neg": lambda h: -h,
    "pow": lambda h: h**2,
    "compare": lambda h: h < 0,
    "index": lambda h: h[0],
    "slice": lambda h: h[:, :2],
    "setitem": lambda h: h.__setitem__(0, 1.0),
    "shape": lambda h: h.shape,
    "dtype": lambda h: h.dtype,
    "to": lambda h: h.to(torch.float32),
    "clone": lambda h: h.clone(),
    "torch.add": lambda h: torch.add(h, 1),
    "torch.cat": lambda h: torch.cat([h, h]),
    "tensor+owed": lambda h: torch.ones(T, H, dtype=F64) + h,
    "F.rms_norm": lambda h: torch.nn.functional.rms_norm(h, (H,)),
    "bool": lambda h: bool(h),
    "if": lambda h: 1 if h else 0,
    "len": lambda h: len(h),
    "iter": lambda h: list(h),
    "float": lambda h: float(h),
}


@pytest.mark.parametrize("source", ["arrive", "handoff"])
@pytest.mark.parametrize("misuse", list(MISUSES))
def test_owed_output_refuses_tensor_use(source, misuse):
    fb, h = _owed_by_arrive() if source == "arrive" else _owed_by_handoff()
    assert isinstance(h, OwedOutput) and not isinstance(h, torch.Tensor)
    with pytest.raises(TypeError, match="OwedOutput"):
        MISUSES[misuse](h)
    # The refusal changed nothing: the handle still completes.
    value = rb.complete_output(h, fb)
    assert isinstance(value, torch.Tensor) and value.shape == (T, H)


def test_owed_output_repr_names_the_work():
    _, h = _owed_by_arrive()
    assert "sum over TP" in repr(h)
    _, h = _owed_by_handoff()
    assert "finalize" in repr(h)


# -- release of consumed contributions -------------------------------------------------------


def _collected(ref):
    # Freed by reference counting alone, without waiting for the cycle collector: a consumed
    # contribution's memory is returned the moment the stream drops it.
    return ref() is None


def test_prepare_releases_the_consumed_contribution(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    h = a0.finish(inp * 2, fb)
    ref = weakref.ref(h)  # the handle is the contribution tensor itself
    inp = f0.prepare(h, fb)
    del h
    assert _collected(ref)
    assert fb.residual_stream.pending is None


def test_fold_releases_the_consumed_contribution():
    c = rand(T, H)
    ref = weakref.ref(c)
    stream, h = ResidualStream.arrive(residual=rand(T, H, seed=1), output=c, owed=(solo_sum(),))
    del c
    fb = with_stream(stream)
    r = rb.fold(h, fb)
    del h
    assert _collected(ref)
    assert r is stream.residual


def test_written_releases_the_discarded_contribution(stack):
    (_, a0), _, _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    h = a0.finish(inp * 2, fb)
    ref = weakref.ref(h)
    r = rb.written(rand(T, H, seed=5), fb)
    del h
    assert _collected(ref)
    assert fb.residual_stream.residual is r


def test_handoff_is_released_after_its_consumer():
    fb, h = _owed_by_handoff()
    stream = fb.residual_stream
    # HandoffOutput takes no weak references; its payload tensor lives exactly as long as it.
    handoff_ref = weakref.ref(stream.pending.value.payload["scratch"])
    (nxt,) = make_stages((declare_attn(), make_norm(H, F64)), previous=declare_ffn(sparse=True))
    nxt.prepare(h, fb)
    del h
    assert _collected(handoff_ref)


def test_norm_releases_the_residual(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    inp = f0.prepare(a0.finish(inp * 2, fb), fb)
    ref = weakref.ref(fb.residual_stream.residual)
    with f0.exit(fb) as out:
        y = inp * 2
    h = out.finish(y)
    del y
    out = rb.norm(h, fb, make_norm(H, F64))
    del h
    assert _collected(ref)
    assert fb.residual_stream.residual is None and fb.residual_stream.pending is None


# -- one pending contribution at a time --------------------------------------------------------


def test_finish_twice_is_refused(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    first = inp * 2
    h = a0.finish(first, fb)
    with pytest.raises(BoundaryError, match="only one can be pending"):
        a0.finish(inp * 3, fb)
    # The first contribution is intact and still applies exactly once.
    assert fb.residual_stream.pending.value is first
    x = fb.residual_stream.residual
    f0.prepare(h, fb)
    torch.testing.assert_close(fb.residual_stream.residual, x + first, rtol=0, atol=0)


def test_exit_finish_while_pending_is_refused(stack):
    (_, a0), (_, f0), _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    a0.finish(inp * 2, fb)
    with f0.exit(fb) as out:
        y = inp
    with pytest.raises(BoundaryError, match="only one can be pending"):
        out.finish(y)


def test_finish_over_an_unconsumed_written_output_is_refused(stack):
    (_, a0), _, _, _ = stack
    fb = started()
    inp = a0.prepare(rand(T, H), fb)
    rb.fold(a0.finish(inp * 2, fb), fb)
    with pytest.raises(BoundaryError, match="unconsumed layer output"):
        a0.finish(inp, fb)


def test_finish_before_any_read_is_refused(stack):
    (_, a0), _, _, _ = stack
    fb = started()
    with pytest.raises(BoundaryError, match="before any stage read"):
        a0.finish(rand(T, H), fb)


# -- owed sums complete exactly once (fake two-rank group) --------------------------------------


def test_partial_attention_sum_completes_once_at_the_next_input(fake_dist: FakeCollectives):
    topo = fake_topology()
    a, f = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                       topology=topo)
    fb = started()
    x = rand(T, H)
    inp = a.prepare(x, fb)
    y = inp * 2
    h = a.finish(y.clone(), fb)
    assert isinstance(h, OwedOutput)
    assert fake_dist.calls == []
    f.prepare(h, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(fb.residual_stream.residual, x + 2 * y, rtol=0, atol=0)


def test_mixer_before_ffn_leaves_its_sum_to_the_ffn(fake_dist: FakeCollectives):
    topo = fake_topology()
    m, f = make_stages((declare("mixer"), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                       topology=topo)
    fb = started()
    x = rand(T, H)
    inp = m.prepare(x, fb)
    with m.exit(fb) as out:
        assert out.skips_reduction and out.fuse_mlp_allreduce
        y = inp * 2
    h = out.finish(y.clone())
    assert isinstance(h, OwedOutput)
    f.prepare(h, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(fb.residual_stream.residual, x + 2 * y, rtol=0, atol=0)
