"""Conformance of fusion providers whose candidates take a MoE finalize handoff.

Part of ``FusionProviderConformance``: a provider none of whose candidates ``takes_handoff``
skips these. A handoff candidate must finish exactly the unfused work (top-k combine plus the
shared expert, then the add and the norm) within ``FINALIZE_TOLERANCE``, mark the handoff done,
and decline, untouched and without a collective, a handoff it cannot take.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from .._factories import declare_attn, declare_ffn, make_stages
from .._forward import ForwardBatch
from .._kernels.reference import fused_add_rmsnorm_ref
from .._norms import RMSNorm
from .._output import HandoffOutput
from ._collectives import no_collectives

__all__ = ["HandoffConformance", "make_handoff"]

TOPK = 4


def make_handoff(rows: int, hidden: int, dtype: torch.dtype, device: str, *, seed: int = 0,
                 shared: bool = True, payload: bool = True) -> HandoffOutput:
    """A single-rank finalize handoff as a sparse FFN returns one (``moe_finalize`` unfused)."""
    from .._fusion.moe_finalize import moe_finalize

    g = torch.Generator().manual_seed(seed)
    expert = torch.randn(rows, TOPK, hidden, generator=g).to(dtype).to(device)
    weights = torch.softmax(torch.randn(rows, TOPK, generator=g), -1).to(dtype).to(device)
    sh = torch.randn(rows, hidden, generator=g).to(dtype).to(device) if shared else None
    kw = dict(expert_out=expert, topk_weights=weights, shared_out=sh) if payload else {}
    return HandoffOutput(lambda: moe_finalize(expert, weights, sh), num_tokens=rows, **kw)


class HandoffConformance:
    """Mixed into ``FusionProviderConformance`` (which supplies the fixtures)."""

    def _handoff_candidates(self, provider: Any, hidden: int, dtype: torch.dtype,
                            device: str) -> list[tuple[Any, Any]]:
        norms = [RMSNorm(hidden, dtype=dtype).to(device) for _ in range(2)]
        sparse = declare_ffn(sparse=True, next_sparse=True)
        attn, _ = make_stages((declare_attn(), norms[0], {"fusions": provider}),
                              (sparse, norms[1], {"fusions": provider}), previous=sparse)
        offer = getattr(provider, "attention_input", None)
        cands = [c for c in (offer(attn.plan) or ()) if getattr(c, "takes_handoff", False)] if offer else []
        usable = [(c, attn.plan.read) for c in cands if c.refuse(attn.plan) is None]
        if not usable:
            pytest.skip("the provider offers no finalize handoff candidate on one rank")
        return usable

    def _each_handoff_candidate(self, provider: Any, hidden: int, dtype: torch.dtype, device: str,
                                check: Callable[[Any, Any], None]) -> None:
        for cand, read in self._handoff_candidates(provider, hidden, dtype, device):
            check(cand, read)

    def test_handoff_candidates_match_the_unfused_finalize(self, provider: Any, hidden_size: int,
                                                           dtype: torch.dtype, device: str) -> None:
        from .._fusion.moe_finalize import FINALIZE_TOLERANCE, moe_finalize

        def check(cand: Any, read: Any) -> None:
            for rows, shared in ((1, False), (5, True)):
                h = make_handoff(rows, hidden_size, dtype, device, seed=rows, shared=shared)
                r = torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
                p = h.payload
                unfused = moe_finalize(p["expert_out"], p["topk_weights"], p["shared_out"])
                want_x, want_r = fused_add_rmsnorm_ref(unfused, r, read.weight, read.eps, weight_offset=read.offset)
                out = cand(h, r.clone(), read, ForwardBatch(num_tokens=rows))
                assert out is not None, f"{cand.name} declined a handoff it was offered for"
                assert h.completed, f"{cand.name} did not mark the handoff finished"
                atol, rtol = FINALIZE_TOLERANCE[dtype]
                scale = max(1.0, want_x.abs().max().item())
                torch.testing.assert_close(out[0], want_x, atol=atol * scale, rtol=rtol)
                torch.testing.assert_close(out[1], want_r, atol=atol * scale, rtol=rtol)

        self._each_handoff_candidate(provider, hidden_size, dtype, device, check)

    def test_handoff_candidates_decline_untouched(self, provider: Any, hidden_size: int,
                                                  dtype: torch.dtype, device: str) -> None:
        def check(cand: Any, read: Any) -> None:
            h = make_handoff(3, hidden_size, dtype, device, payload=False)
            r = torch.randn(3, hidden_size).to(dtype).to(device)
            r0 = r.clone()
            with no_collectives():
                out = cand(h, r, read, ForwardBatch(num_tokens=3))
            assert out is None, f"{cand.name} took a handoff without an expert_out payload"
            assert not h.completed and torch.equal(r, r0), f"{cand.name} touched what it declined"

        self._each_handoff_candidate(provider, hidden_size, dtype, device, check)

    @pytest.mark.gpu
    def test_handoff_candidates_replay_in_a_cuda_graph(self, provider: Any, hidden_size: int,
                                                       dtype: torch.dtype) -> None:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        from .._fusion.moe_finalize import moe_finalize
        from ._semantics import _graph_replays

        def check(cand: Any, read: Any) -> None:
            p = make_handoff(4, hidden_size, dtype, "cuda", seed=3).payload
            r = torch.randn(4, hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype).cuda()

            def step() -> torch.Tensor:
                # A handoff is spent once taken: each call (eager, warm-up, capture) makes its own
                # over the same static payload, as every forward's exit does.
                h = HandoffOutput(lambda: moe_finalize(p["expert_out"], p["topk_weights"], p["shared_out"]),
                                  num_tokens=4, **p)
                return cand(h, r.clone(), read, ForwardBatch(num_tokens=4))[0]

            eager, replayed = _graph_replays(step, [r, *[t for t in p.values() if t is not None]])
            assert torch.equal(eager, replayed), f"{cand.name} replays differently from eager"

        self._each_handoff_candidate(provider, hidden_size, dtype, "cuda", check)
