"""Worker functions for the heterogeneous multi-process tests (importable by spawned ranks).

Each case builds the heterogeneous reference on its layout, runs one forward over sequences
spread across the attention-DP groups, and reports the largest difference from the single-rank
model, the collectives the forward ran, the flag each mixer's compute saw, and what the test
fusion provider was asked and did.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Optional

import torch

from layer_boundary import StageKind, get_forward, _ops as ops
from layer_boundary._context import BoundaryContext
from layer_boundary._layout import SumGroup
from layer_boundary_app.models import hetero
from layer_boundary_app.models.runner import RunSpec, rank_forward, single_rank_logits
from layer_boundary._reduction import return_paths
from layer_boundary.residual._add_norm import PLAIN_ADD

from parallel_cases import count_collectives, topology


class SumAddNorm:
    """Consumer candidate: completes an attention-TP sum, then the plain add+norm read; or
    declines (returns ``None`` before touching anything) so the input falls back to its own
    all-reduce."""

    name = "test-sum-add-norm"
    sum_group = SumGroup.ATTN_TP

    def __init__(self, group: Any, accept: bool, stats: dict[str, int]) -> None:
        self.group, self.accept, self.stats = group, accept, stats

    def refuse(self, plan: Any) -> Optional[str]:
        prev = plan.declaration.previous
        if prev is not None and prev.kind is StageKind.FFN:
            return "completes attention-TP sums only; this input receives a TP sum"
        return None

    def __call__(self, contribution: torch.Tensor, residual: Any, read: Any, forward_batch: Any) -> Any:
        self.stats["candidate_calls"] += 1
        if not self.accept:
            return None
        self.stats["fused"] += 1
        ops.all_reduce(contribution, self.group)
        return read.update_and_read(PLAIN_ADD, contribution, residual)


class DeferringFusion:
    """Fusion provider: ``can_defer_all_reduce`` answers ``defer`` for every batch; attention-kind
    inputs get one :class:`SumAddNorm` candidate."""

    name = "test-deferring-fusion"

    def __init__(self, *, defer: bool, accept: bool) -> None:
        self.defer, self.accept = defer, accept
        self.stats = {"asked": 0, "candidate_calls": 0, "fused": 0}

    def attention_input(self, plan: Any) -> list[SumAddNorm]:
        return [SumAddNorm(plan.topology.attn_tp, self.accept, self.stats)]

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        self.stats["asked"] += 1
        return self.defer


_SEEN: list[bool] = []


def _record_flags() -> None:
    """Make each mixer compute record the ``fuse_mlp_allreduce`` its exit published."""
    if getattr(hetero.ShortConvMixer, "_recording", False):
        return
    forward = hetero.ShortConvMixer.forward

    def recording(self: Any, x: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        _SEEN.append(get_forward().fuse_mlp_allreduce)
        return forward(self, x, forward_batch)

    hetero.ShortConvMixer.forward = recording  # type: ignore[method-assign]
    hetero.ShortConvMixer._recording = True  # type: ignore[attr-defined]


def hetero_matrix(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    _record_flags()
    refs: dict[tuple, torch.Tensor] = {}
    results = []
    for case in cases:
        seqs = tuple(tuple(s) for s in case["sequences"])
        overrides = case.get("config", {})
        spec = RunSpec(sequences=seqs, tp=world, dp=case["dp"], reduction=case["policy"], dtype="float64",
                       plugins=False, pattern=case["pattern"], config_overrides=overrides)
        topo = topology(world, case["dp"])
        ctx = BoundaryContext(topo, reduction=case["policy"], architecture="hetero")
        provider = DeferringFusion(**case["provider"]) if case.get("provider") else None
        config = dataclasses.replace(hetero.HeteroConfig(), **overrides)
        model = hetero.HeteroForCausalLM(config, case["pattern"], context=ctx,
                                         dtype=torch.float64, fusions=provider)
        hetero.init_hetero_weights(model, seed=0)
        model.eval().requires_grad_(False)
        ctx.freeze()
        _SEEN.clear()
        with count_collectives() as n:
            idx, logits, _ = rank_forward(model, spec, "cpu")
        flags = list(_SEEN)
        key = (case["pattern"], seqs, tuple(sorted(overrides.items())))
        if key not in refs:
            refs[key] = single_rank_logits(spec)
        want = refs[key][idx] if idx else logits[:0]
        results.append({
            "case": case,
            "rows": len(idx),
            "max_diff": (logits - want).abs().max().item() if idx else 0.0,
            "collectives": dict(n),
            "mixer_flags": flags,
            "provider": dict(provider.stats) if provider else None,
            "return": return_paths(ctx.reduction, topo)[0],
        })
    return results
