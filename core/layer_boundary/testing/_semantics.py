"""Conformance of a ``ResidualSemantics``: capabilities, rounding order, stream transitions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from .._errors import SNAPSHOT_PLAIN, BoundaryError
from .._factories import declare_attn, declare_ffn, make_stages
from .._forward import ForwardBatch
from .._norms import RMSNorm
from .._providers import residual_part
from ..residual import batch as residual_batch
from ..residual._stream import Handle, StreamState
from ._tolerances import tolerance_of

if TYPE_CHECKING:
    from .. import StageBoundary

__all__ = ["ResidualSemanticsConformance"]


class _Stack(nn.Module):
    """Two layers of (attention-like, FFN-like) stages with linear compute, on ``semantics``."""

    def __init__(self, semantics: Any, hidden: int, dtype: torch.dtype, layers: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = [(torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(dtype) for _ in range(2 * layers)]
        self.norms = nn.ModuleList(RMSNorm(hidden, dtype=dtype) for _ in range(2 * layers + 1))
        with torch.no_grad():
            for n in self.norms:
                getattr(n, "weight").uniform_(0.5, 1.5, generator=g)
        parts = [residual_part(semantics, "stage", hidden, dtype=dtype) for _ in range(2 * layers)]
        self.params = nn.ModuleList(p.params for p in parts if p.params is not None)
        self.stages: list[StageBoundary] = []
        for i in range(layers):
            a, f = parts[2 * i], parts[2 * i + 1]
            prev = declare_ffn(update=parts[2 * i - 1].update) if i else None
            self.stages += make_stages(
                (declare_attn(update=a.update, read=a.read), self.norms[2 * i]),
                (declare_ffn(update=f.update, read=f.read), self.norms[2 * i + 1]),
                previous=prev, terminal=i == layers - 1)
        exit_ = residual_part(semantics, "exit", hidden, dtype=dtype)
        if exit_.params is not None:
            self.exit_params = exit_.params
        residual_batch.bind_final_norm(self.norms[-1], read=exit_.read)

    def run(self, x: torch.Tensor, fb: Any, states: list | None = None) -> torch.Tensor:
        residual_batch.start(fb)
        h: Handle = x
        for i in range(0, len(self.stages), 2):
            attn, ffn = self.stages[i], self.stages[i + 1]
            h = _input_like(attn.prepare(h, fb), x, f"{attn.plan.name}'s read")
            _record(states, fb)
            h = attn.finish(h @ self.weights[i], fb)
            _record(states, fb)
            h = _input_like(ffn.prepare(h, fb), x, f"{ffn.plan.name}'s update and read")
            with ffn.exit(fb) as out:
                y = h @ self.weights[i + 1]
            h = out.finish(y)
            _record(states, fb)
        return residual_batch.norm(h, fb, self.norms[-1])


def _input_like(got: Any, x: torch.Tensor, what: str) -> torch.Tensor:
    """A compute input has the stack input's rows, width and dtype: the model's next matmul takes
    it (a read that returns FP32 under bfloat16 fails there, far from the scheme)."""
    assert isinstance(got, torch.Tensor) and got.shape == x.shape and got.dtype == x.dtype, (
        f"{what} returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__} "
        f"{getattr(got, 'dtype', '')} for an input {tuple(x.shape)} {x.dtype}: a stage's compute input must "
        "have the stack input's shape and dtype")
    return got


def _record(states: list | None, fb: Any) -> None:
    if states is not None:
        states.append(fb.residual_stream.state)


class ResidualSemanticsConformance:
    """Subclass and provide ``semantics`` (a ``ResidualSemantics``). Optional fixtures:
    ``hidden_size``, ``dtype``, and ``reference`` (a callable ``(stack, x) -> output`` computing the
    same stack directly from its equations; without it only self-consistency is checked)."""

    @pytest.fixture
    def hidden_size(self) -> int:
        return 32

    @pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def dtype(self, request: Any) -> torch.dtype:
        return request.param

    @pytest.fixture
    def reference(self) -> Any:
        return None

    def test_capabilities_are_declared(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        part = semantics.stage(hidden_size, dtype=dtype)
        u = part.update
        for attr in ("name", "plain_add", "at_producer", "outlives_producer"):
            assert hasattr(u, attr), f"the update lacks {attr}"
        if not u.plain_add and not u.at_producer:
            assert u.outlives_producer, "a nonlinear update left for the next read must outlive its producer"
        read = part.read.bind(RMSNorm(hidden_size, dtype=dtype))
        for attr in ("name", "before_gather", "fuses_with"):
            assert hasattr(read, attr), f"the read lacks {attr}"

    def test_plain_add_means_plain_add(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        u = semantics.stage(hidden_size, dtype=dtype).update
        if not u.plain_add:
            pytest.skip("not declared plain")
        g = torch.Generator().manual_seed(2)
        r, c = torch.randn(5, hidden_size, generator=g).to(dtype), torch.randn(5, hidden_size, generator=g).to(dtype)
        got, want = u.apply(r, c), (r.float() + c.float()).to(dtype)
        same = isinstance(got, torch.Tensor) and got.shape == want.shape
        assert same and torch.equal(got, want), (
            f"update {u.name!r} declares plain_add=True but apply(r, c) is not r + c, the FP32 sum rounded "
            f"once (largest difference {(got.float() - want.float()).abs().max().item() if same else 'n/a'}): "
            "plain_add lets the boundary join the sum to a reduction on one rank and snapshot it, so a "
            "nonlinear update that claims it gives wrong results under TP; declare plain_add=False")

    def test_stream_transitions(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        stack = _Stack(semantics, hidden_size, dtype)
        x = torch.randn(6, hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
        fb = ForwardBatch(num_tokens=6)
        states: list = []
        out = stack.run(x, fb, states)
        assert states == [StreamState.WRITTEN, StreamState.PENDING, StreamState.PENDING] * 2, (
            f"stream states after (attention read, attention finish, FFN finish) x 2: {states}")
        assert fb.residual_stream is not None and fb.residual_stream.released, "the final norm did not end the stream"
        _input_like(out, x, "the final norm (exit read)")
        assert bool(torch.isfinite(out).all()), "the stack's output holds NaN or inf"

    def test_microbatches_do_not_share_state(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        """Two streams interleaved through the same stages give what each gives alone."""
        stack = _Stack(semantics, hidden_size, dtype, layers=1)
        g = torch.Generator().manual_seed(4)
        xa, xb = torch.randn(3, hidden_size, generator=g).to(dtype), torch.randn(5, hidden_size, generator=g).to(dtype)
        alone_a = stack.run(xa, ForwardBatch(num_tokens=3))
        alone_b = stack.run(xb, ForwardBatch(num_tokens=5))
        fa, fbb = ForwardBatch(num_tokens=3), ForwardBatch(num_tokens=5)
        residual_batch.start(fa)
        residual_batch.start(fbb)
        attn, ffn = stack.stages
        ha: Handle
        hb: Handle
        ha, hb = attn.prepare(xa, fa), attn.prepare(xb, fbb)
        ha, hb = attn.finish(ha @ stack.weights[0], fa), attn.finish(hb @ stack.weights[0], fbb)
        ha, hb = ffn.prepare(ha, fa), ffn.prepare(hb, fbb)
        with ffn.exit(fa) as oa:
            ya = ha @ stack.weights[1]
        with ffn.exit(fbb) as ob:
            yb = hb @ stack.weights[1]
        ha, hb = oa.finish(ya), ob.finish(yb)
        out_b = residual_batch.norm(hb, fbb, stack.norms[-1])
        out_a = residual_batch.norm(ha, fa, stack.norms[-1])
        assert torch.equal(out_a, alone_a) and torch.equal(out_b, alone_b), (
            "two microbatches interleaved through the same stages differ from each run alone: the "
            "scheme keeps per-forward state on the update, the read or their modules (it belongs to the "
            "stream: a read with makes_update returns the update that carries it)")

    def test_snapshot_only_for_plain(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        stack = _Stack(semantics, hidden_size, dtype, layers=1)
        attn = stack.stages[0]
        fb = ForwardBatch(num_tokens=2)
        residual_batch.start(fb)
        h: Handle = attn.prepare(torch.randn(2, hidden_size).to(dtype), fb)
        h = attn.finish(h @ stack.weights[0], fb)
        if attn.plan.update.plain_add:
            residual_batch.snapshot(h, fb)
        else:
            with pytest.raises(BoundaryError) as e:
                residual_batch.snapshot(h, fb)
            assert str(e.value) == SNAPSHOT_PLAIN

    @pytest.mark.gpu
    def test_cuda_graph_capture_replays(self, semantics: Any, hidden_size: int, dtype: torch.dtype) -> None:
        """A forward through the boundaries, captured in a CUDA graph, replays to the eager result."""
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        stack = _Stack(semantics, hidden_size, dtype).cuda()
        stack.weights = [w.cuda() for w in stack.weights]
        x = torch.randn(8, hidden_size, generator=torch.Generator().manual_seed(8)).to(dtype).cuda()
        with torch.inference_mode():
            eager, replayed = _graph_replays(lambda: stack.run(x, ForwardBatch(num_tokens=8)), [x])
        assert torch.equal(eager, replayed)

    def test_matches_direct_equations(self, semantics: Any, reference: Any, hidden_size: int,
                                      dtype: torch.dtype) -> None:
        if reference is None:
            pytest.skip("no direct reference given (fixture `reference`)")
        stack = _Stack(semantics, hidden_size, dtype)
        x = torch.randn(7, hidden_size, generator=torch.Generator().manual_seed(6)).to(dtype)
        got = stack.run(x, ForwardBatch(num_tokens=7))
        torch.testing.assert_close(got, reference(stack, x), **tolerance_of(semantics, dtype))


def _graph_replays(fn: Any, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # ``inputs`` are the static buffers ``fn`` reads; they stay alive for the replay.
    """``(eager, replayed)`` outputs of ``fn()`` with the output poisoned before replay."""
    eager = fn().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return eager, out
