"""Conformance of a ``FusionProvider``: consumer candidates decline cleanly, decisions are pure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from .._factories import declare_attn, declare_ffn, make_stages
from .._forward import ForwardBatch
from .._kernels.reference import fused_add_rmsnorm_ref
from .._norms import RMSNorm
from ..residual._add_norm import RMSNormRead
from ._collectives import no_collectives
from ._finalize import HandoffConformance

if TYPE_CHECKING:
    from .._stage import StageBoundary
from ._tolerances import tolerance_of

__all__ = ["FusionProviderConformance"]

class FusionProviderConformance(HandoffConformance):
    """Subclass and provide fixtures:

    ``provider``: the ``FusionProvider``. ``declined_batch``: a batch every candidate of the
    provider must decline (for example over its token limit). ``accepted_batch``: a batch the
    candidates accept (``None`` if they accept nothing on one rank). Optional: ``hidden_size``,
    ``dtype`` and ``device`` fixtures.
    """

    @pytest.fixture
    def hidden_size(self) -> int:
        return 256

    @pytest.fixture
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @pytest.fixture
    def device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @pytest.fixture
    def accepted_batch(self) -> Any:
        return None

    def _stages(self, provider: Any, hidden: int, dtype: torch.dtype, device: str) -> tuple[StageBoundary, ...]:
        n1 = RMSNorm(hidden, dtype=dtype).to(device)
        n2 = RMSNorm(hidden, dtype=dtype).to(device)
        return make_stages((declare_attn(), n1, {"fusions": provider}),
                           (declare_ffn(), n2, {"fusions": provider}), previous=declare_ffn())

    def _candidates(self, provider: Any, stage: Any) -> list[Any]:
        hook = "attention_input" if stage.plan.name.startswith("attn") else "ffn_input"
        offer = getattr(provider, hook, None)
        return list(offer(stage.plan) or ()) if offer is not None else []

    def test_decisions_are_bools_without_side_effects(self, provider: Any, hidden_size: int,
                                                      dtype: torch.dtype, device: str) -> None:
        attn, ffn = self._stages(provider, hidden_size, dtype, device)
        fb = ForwardBatch(num_tokens=4)
        for name in ("can_defer_finalize", "can_defer_all_reduce"):
            fn = getattr(provider, name, None)
            if fn is None:
                continue
            with no_collectives():
                first = fn(ffn.plan, fb)
                second = fn(ffn.plan, fb)
            assert isinstance(first, bool), f"{name} must return a bool, got {type(first).__name__}"
            assert first == second, f"{name} gave different answers for the same batch"

    def test_static_refusals_are_reasons(self, provider: Any, hidden_size: int, dtype: torch.dtype,
                                         device: str) -> None:
        for stage in self._stages(provider, hidden_size, dtype, device):
            for cand in self._candidates(provider, stage):
                assert isinstance(cand.name, str) and cand.name
                why = cand.refuse(stage.plan)
                assert why is None or (isinstance(why, str) and why)

    def test_declines_before_touching_inputs(self, provider: Any, declined_batch: Any, hidden_size: int,
                                             dtype: torch.dtype, device: str) -> None:
        tried = 0
        for stage in self._stages(provider, hidden_size, dtype, device):
            for cand in self._candidates(provider, stage):
                g = torch.Generator().manual_seed(0)
                y = torch.randn(declined_batch.num_tokens, hidden_size, generator=g).to(dtype).to(device)
                r = torch.randn(declined_batch.num_tokens, hidden_size, generator=g).to(dtype).to(device)
                y0, r0 = y.clone(), r.clone()
                with no_collectives():
                    out = cand(y, r, stage.plan.read, declined_batch)
                assert out is None, f"{cand.name} did not decline the declined batch"
                assert torch.equal(y, y0) and torch.equal(r, r0), f"{cand.name} modified its inputs before declining"
                tried += 1
        if not tried:
            pytest.skip("the provider offers no consumer candidates")

    def test_accepted_matches_reference(self, provider: Any, accepted_batch: Any, hidden_size: int,
                                        dtype: torch.dtype, device: str) -> None:
        if accepted_batch is None:
            pytest.skip("no batch is accepted on one rank (its fused sum needs several ranks)")
        done = 0
        for stage in self._stages(provider, hidden_size, dtype, device):
            for cand in self._candidates(provider, stage):
                if cand.refuse(stage.plan) is not None:
                    continue
                g = torch.Generator().manual_seed(1)
                y = torch.randn(accepted_batch.num_tokens, hidden_size, generator=g).to(dtype).to(device)
                r = torch.randn(accepted_batch.num_tokens, hidden_size, generator=g).to(dtype).to(device)
                read = stage.plan.read
                # RMSNorm with the default read binds an RMSNormRead (weight, eps, offset)
                assert isinstance(read, RMSNormRead), f"{stage.plan.name} read is {read!r}"
                want_x, want_r = fused_add_rmsnorm_ref(y, r, read.weight, read.eps, weight_offset=read.offset)
                out = cand(y.clone(), r.clone(), read, accepted_batch)
                assert out is not None, f"{cand.name} declined the accepted batch"
                torch.testing.assert_close(out[0], want_x, **tolerance_of(provider, dtype))
                torch.testing.assert_close(out[1], want_r, **tolerance_of(provider, dtype))
                done += 1
        if not done:
            pytest.skip("no candidate accepts a single-rank stage")


    @pytest.mark.gpu
    def test_accepted_candidates_replay_in_a_cuda_graph(self, provider: Any, accepted_batch: Any,
                                                        hidden_size: int, dtype: torch.dtype) -> None:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if accepted_batch is None:
            pytest.skip("no batch is accepted on one rank (its fused sum needs several ranks)")
        from ._semantics import _graph_replays

        done = 0
        for stage in self._stages(provider, hidden_size, dtype, "cuda"):
            for cand in self._candidates(provider, stage):
                if cand.refuse(stage.plan) is not None:
                    continue
                g = torch.Generator().manual_seed(2)
                y = torch.randn(accepted_batch.num_tokens, hidden_size, generator=g).to(dtype).cuda()
                r = torch.randn(accepted_batch.num_tokens, hidden_size, generator=g).to(dtype).cuda()
                read = stage.plan.read

                def step(cand: Any = cand, read: Any = read) -> torch.Tensor:
                    return cand(y.clone(), r.clone(), read, accepted_batch)[0]

                eager, replayed = _graph_replays(step, [y, r])
                assert torch.equal(eager, replayed), f"{cand.name} replays differently from eager"
                done += 1
        if not done:
            pytest.skip("no candidate accepts a single-rank stage")
