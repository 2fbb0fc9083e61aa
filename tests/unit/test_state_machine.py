"""Random legal and illegal call sequences against a two-layer (attention + FFN each) stack on one
rank, checked against a shadow model in plain float64 torch.

The shadow keeps what the stream should hold (started?, residual, pending contribution, the one
object the model may pass next) and predicts each call's outcome: the spec's error text where the
spec names one, the documented misuse error otherwise, or the reference numbers (to 1e-12).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from helpers import NORM_OF, make_norm, rms, solo_sum, two_layer
from layer_boundary import BoundaryError, ForwardBatch, ResidualStream
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary._errors import FOREIGN_OUTPUT, START_FIRST, WRITE_BEFORE_TAKE
from layer_boundary.residual import batch as rb

H, T = 8, 3
F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)

STAGES = two_layer(H, F64, seed=100)  # [(kind, boundary)] for attn0, ffn0, attn1, ffn1
NORMS = [NORM_OF[b] for _, b in STAGES]
FINAL = make_norm(H, F64, seed=200)
_g = torch.Generator().manual_seed(300)
WEIGHTS = [torch.randn(H, H, generator=_g, dtype=F64) / H**0.5 for _ in STAGES]

ARGS = st.sampled_from(["held", "held", "held", "stale", "foreign", "foreign_owed", "clone", "fresh"])
PICK = st.integers(0, 1 << 16)
STAGE = st.integers(0, len(STAGES) - 1)


def rand(seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed), dtype=F64)


class BoundaryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fb = ForwardBatch.for_tokens(T)
        self.seed = 0
        # Shadow of the stream.
        self.started = False
        self.residual: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None
        self.handle: Any = None  # the one object the stream accepts next (None: none)
        # What the model holds.
        self.held: Any = None
        self.input: Optional[torch.Tensor] = None
        self.issued: list[Any] = []
        self.prepared: Optional[int] = None  # the stage whose compute runs next (legal_step)
        self._next = 0
        # Outputs of other streams (another microbatch), kept alive for the whole run.
        s1, self.foreign = ResidualStream.arrive(residual=rand(-1), output=rand(-2))
        s2, self.foreign_owed = ResidualStream.arrive(residual=rand(-3), output=rand(-4), owed=(solo_sum(),))
        self.others = (s1, s2)

    # -- helpers -----------------------------------------------------------------------------

    def fresh(self) -> torch.Tensor:
        self.seed += 1
        return rand(self.seed)

    def pick(self, which: str, i: int) -> Any:
        if which == "held" or (which == "stale" and not self.issued):
            return self.held
        if which == "stale":
            return self.issued[i % len(self.issued)]
        if which == "foreign":
            return self.foreign
        if which == "foreign_owed":
            return self.foreign_owed
        if which == "clone":
            return self.held.clone() if isinstance(self.held, torch.Tensor) else self.fresh()
        return self.fresh()

    def keep(self, value: Any) -> None:
        self.held = value
        if value is not None:
            self.issued.append(value)
            del self.issued[:-12]

    @property
    def state(self) -> Optional[str]:
        if not self.started:
            return None
        if self.pending is not None:
            return "pending"
        return "written" if self.residual is not None else "initial"

    def accepts(self, arg: Any) -> bool:
        return self.handle is not None and arg is self.handle

    def release(self) -> None:
        self.started = False
        self.residual = self.pending = self.handle = None

    def raises(self, exc: type, call: Callable[[], Any], *, text: Optional[str] = None,
               contains: Optional[str] = None) -> None:
        with pytest.raises(exc) as info:
            call()
        event(f"raised {type(info.value).__name__}: {str(info.value)[:40]}")
        if text is not None:
            assert str(info.value) == text
        if contains is not None:
            assert contains in str(info.value)

    def updated(self) -> torch.Tensor:
        assert self.residual is not None
        return self.residual if self.pending is None else self.residual + self.pending

    # -- rules -------------------------------------------------------------------------------

    @initialize()
    def begin(self) -> None:
        self.start()

    @rule()
    def start(self) -> None:
        rb.start(self.fb)
        self.release()
        self.started = True
        self.prepared = None
        self.keep(self.fresh())  # the embedding output

    def _legal_step(self) -> None:
        """What a model does next: start, prepare the next stage on the held output, run its
        compute and finish, or leave the stack through the final norm."""
        event("legal step")
        if not self.started:
            return self.start()
        if self.prepared is not None:
            k, self.prepared = self.prepared, None
            return self.exit_finish(k) if STAGES[k][0] == "ffn" else self.finish(k)
        if self.state == "initial":
            k = 0
        elif isinstance(self.held, torch.Tensor) and self.accepts(self.held):
            k = self._next
            if k == len(STAGES):
                return self.norm("held", 0, False)
        else:
            return self.start()
        self.prepare(k, "held", 0)
        if self.input is not None and self.state == "written" and self.handle is None:
            self.prepared = k

    @rule()
    def legal_step(self) -> None:
        self._legal_step()

    @rule()
    def legal_steps(self) -> None:
        for _ in range(3):
            self._legal_step()

    @rule()
    def skip_start(self) -> None:
        fb = ForwardBatch.for_tokens(T)
        self.raises(BoundaryError, lambda: STAGES[0][1].prepare(self.fresh(), fb), text=START_FIRST)

    @rule(k=STAGE, which=ARGS, i=PICK)
    def prepare(self, k: int, which: str, i: int) -> None:
        arg = self.pick(which, i)
        stage = STAGES[k][1]
        call = lambda: stage.prepare(arg, self.fb)  # noqa: E731
        state = self.state
        if state is None:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if state == "initial":
            if k != 0:  # only the stack's first stage starts the residual
                return self.raises(BoundaryError, call, contains="the residual stream is initial")
            if not isinstance(arg, torch.Tensor):
                return self.raises(TypeError, call)
            expected_residual = arg.clone()
        elif not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        else:
            expected_residual = self.updated()
        x = call()
        event(f"prepare ok from {state}")
        torch.testing.assert_close(x, rms(expected_residual, NORMS[k].weight), **TOL)
        self.residual, self.pending, self.handle = expected_residual, None, None
        self.input = x
        self._next = k + 1
        self.keep(x)

    def _compute(self, k: int) -> torch.Tensor:
        x = self.input if self.input is not None else self.fresh()
        return x @ WEIGHTS[k].T

    def _publish(self, call: Callable[[], Any], value: torch.Tensor) -> None:
        state = self.state
        if state == "initial":
            return self.raises(BoundaryError, call, contains="before any stage read")
        if state == "pending":
            return self.raises(BoundaryError, call, contains="only one can be pending")
        if self.handle is not None:
            return self.raises(BoundaryError, call, contains="unconsumed layer output")
        h = call()
        event("publish ok")
        assert h is value  # nothing is owed on one rank: the handle is the contribution
        self.pending, self.handle = value.clone(), h
        self.keep(h)

    @rule(k=STAGE)
    def finish(self, k: int) -> None:
        kind, stage = STAGES[k]
        value = self._compute(k)
        call = lambda: stage.finish(value, self.fb)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if kind == "ffn":
            return self.raises(BoundaryError, call, contains="exit(forward_batch)")
        self._publish(call, value)

    @rule(k=STAGE)
    def exit_finish(self, k: int) -> None:
        kind, stage = STAGES[k]
        if not self.started:
            return self.raises(BoundaryError, lambda: stage.exit(self.fb), text=START_FIRST)
        if kind == "attn":
            return self.raises(BoundaryError, lambda: stage.exit(self.fb), contains="PARTIAL")
        with stage.exit(self.fb) as out:
            value = self._compute(k)
        self._publish(lambda: out.finish(value), value)

    @rule(which=ARGS, i=PICK)
    def fold(self, which: str, i: int) -> None:
        arg = self.pick(which, i)
        call = lambda: rb.fold(arg, self.fb)  # noqa: E731
        state = self.state
        if state is None:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if state == "initial":
            if not isinstance(arg, torch.Tensor):
                return self.raises(TypeError, call)
            assert call() is arg
            self.residual, self.handle = arg.clone(), arg
            return self.keep(arg)
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        expected = self.updated()
        out = call()
        event(f"fold ok from {state}")
        torch.testing.assert_close(out, expected, **TOL)
        if state == "written":
            assert out is arg
        self.residual, self.pending, self.handle = expected, None, out
        self.keep(out)

    @rule()
    def written(self) -> None:
        t = self.fresh()
        call = lambda: rb.written(t, self.fb)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        assert call() is t
        self.residual, self.pending, self.handle = t.clone(), None, t
        self.keep(t)

    @rule(which=ARGS, i=PICK)
    def snapshot(self, which: str, i: int) -> None:
        arg = self.pick(which, i)
        call = lambda: rb.snapshot(arg, self.fb)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        snap = call()
        torch.testing.assert_close(snap, self.updated(), **TOL)
        assert snap is not arg and snap is not self.fb.residual_stream.residual

    @rule(k=STAGE, which=ARGS, i=PICK)
    def capture_output(self, k: int, which: str, i: int) -> None:
        arg = self.pick(which, i)
        call = lambda: STAGES[k][1].capture_output(arg, self.fb)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        handle, snap = call()
        assert handle is arg  # nothing is owed on one rank: the same handle stays valid
        torch.testing.assert_close(snap, self.updated(), **TOL)

    @rule(which=ARGS, i=PICK)
    def add_to_output(self, which: str, i: int) -> None:
        arg = self.pick(which, i)
        extra = self.fresh()
        call = lambda: rb.add_to_output(arg, self.fb, extra)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        expected = extra.clone() if self.pending is None else self.pending + extra
        h = call()
        assert isinstance(h, torch.Tensor) and h is not arg
        torch.testing.assert_close(h, expected, **TOL)
        self.pending, self.handle = expected, h
        self.keep(h)

    @rule(which=ARGS, i=PICK)
    def complete_output(self, which: str, i: int) -> None:
        arg = self.pick(which, i)
        call = lambda: rb.complete_output(arg, self.fb)  # noqa: E731
        if not self.started:
            return self.raises(BoundaryError, call, text=START_FIRST)
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        h = call()
        torch.testing.assert_close(h, self.pending if self.pending is not None else self.residual, **TOL)
        self.handle = h
        self.keep(h)

    @rule(which=ARGS, i=PICK)
    def take_output(self, which: str, i: int) -> None:
        arg = self.pick(which, i)
        call = lambda: rb.take_output(arg, self.fb)  # noqa: E731
        state = self.state
        if state is None:
            return self.raises(BoundaryError, call, text=START_FIRST)
        # take_output releases the stream when it returns; a refusal leaves it as it was.
        if state == "initial":
            if not isinstance(arg, torch.Tensor):
                return self.raises(TypeError, call)
            assert call() is arg
            self.keep(arg)
            return self.release()
        if not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        if state == "pending":
            return self.raises(BoundaryError, call, text=WRITE_BEFORE_TAKE)
        out = call()
        torch.testing.assert_close(out, self.residual, **TOL)
        self.keep(out)
        self.release()

    @rule(which=ARGS, i=PICK, skip_empty=st.booleans())
    def norm(self, which: str, i: int, skip_empty: bool) -> None:
        arg = self.pick(which, i)
        call = lambda: rb.norm(arg, self.fb, FINAL, skip_empty=skip_empty)  # noqa: E731
        state = self.state
        if state is None:
            return self.raises(BoundaryError, call, text=START_FIRST)
        # norm releases the stream when it returns; a refusal leaves it as it was.
        if state == "initial":
            if not isinstance(arg, torch.Tensor):
                return self.raises(TypeError, call)
            expected = arg.clone()
        elif not self.accepts(arg):
            return self.raises(BoundaryError, call, text=FOREIGN_OUTPUT)
        else:
            expected = self.updated()
        out = call()
        event(f"norm ok from {state}")
        torch.testing.assert_close(out, rms(expected, FINAL.weight), **TOL)
        self.keep(out)
        self.release()

    @rule(which=ARGS, i=PICK)
    def misuse_owed_handle(self, which: str, i: int) -> None:
        """An owed handle refuses tensor use whatever state this stream is in."""
        with pytest.raises(TypeError):
            self.foreign_owed + 1
        with pytest.raises(TypeError):
            torch.add(self.foreign_owed, 1)
        assert isinstance(self.foreign_owed, OwedOutput)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def stream_matches_the_shadow(self) -> None:
        stream = self.fb.residual_stream
        if not self.started:
            assert stream is None or stream.released
            return
        assert not stream.released
        want = {"initial": StreamState.INITIAL, "written": StreamState.WRITTEN, "pending": StreamState.PENDING}
        assert stream.state is want[self.state]
        if self.residual is not None:
            torch.testing.assert_close(stream.residual, self.residual, **TOL)
        if self.pending is not None:
            torch.testing.assert_close(stream.pending.value, self.pending, **TOL)
        assert stream.handle is self.handle

    @invariant()
    def other_streams_are_untouched(self) -> None:
        for s in self.others:
            assert s.state is StreamState.PENDING and not s.released


BoundaryMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBoundaryMachine = BoundaryMachine.TestCase


def test_start_over_a_forward_that_never_left_the_stack_warns():
    # A trial: a model that applied its final norm module itself (not residual_batch.norm) lost the
    # last residual add, and the next start() dropped the pending stream without a word.
    import warnings

    from layer_boundary import ForwardBatch, Topology, declare_attn, make_stages
    from layer_boundary._norms import RMSNorm
    from layer_boundary.residual import batch as residual_batch

    (stage,) = make_stages((declare_attn(), RMSNorm(8)), topology=Topology.single(), terminal=True)
    fb = ForwardBatch.for_tokens(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        residual_batch.start(fb)
        residual_batch.start(fb)  # nothing happened in between: silent
        h = stage.finish(stage.prepare(torch.randn(4, 8), fb), fb)
        residual_batch.norm(h, fb, stage.plan.read.norm)
        residual_batch.start(fb)  # left through norm(): silent
    stage.finish(stage.prepare(torch.randn(4, 8), fb), fb)
    with pytest.warns(UserWarning, match=r"previous forward never left the layer stack \(its stream is pending\)"):
        residual_batch.start(fb)
