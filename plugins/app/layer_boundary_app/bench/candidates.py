"""Fused consumer candidates as construction accepted them, and contexts with and without fusion.

The benchmarks find candidates the way a model does: build stages with ``make_stages(...,
context=ctx)`` and read what construction accepted from each stage's plan. A candidate written
later (a core one, a plugin's) shows up here without a change to the benchmarks.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Iterable, Optional

import torch

from layer_boundary import BatchVariant, BoundaryContext

__all__ = ["AcceptedCandidate", "accepted_candidates", "no_candidate_reason", "describe_candidates",
           "UnfusedContext", "strip_candidates", "two_stage_plan", "model_stages"]


class AcceptedCandidate:
    """A candidate with the stage that accepted it and that stage's read (what it is called with)."""

    __slots__ = ("stage", "candidate", "read")

    def __init__(self, stage: str, candidate: Any, read: Any) -> None:
        self.stage, self.candidate, self.read = stage, candidate, read

    @property
    def name(self) -> str:
        return str(self.candidate.name)


def accepted_candidates(stages: Iterable[Any]) -> list[AcceptedCandidate]:
    """The ordinary-variant candidates of ``stages``, first occurrence of each name kept."""
    out: list[AcceptedCandidate] = []
    seen: set[str] = set()
    for stage in stages:
        entry = stage.plan.entries.get(BatchVariant.ORDINARY)
        for cand in (entry.candidates if entry is not None else ()):
            if cand.name not in seen:
                seen.add(cand.name)
                out.append(AcceptedCandidate(stage.plan.name, cand, stage.plan.read))
    return out


def no_candidate_reason(ctx: BoundaryContext) -> str:
    """Why no candidate was accepted, from the selection report (or the plugin list when no
    provider offered any, which leaves nothing in the report)."""
    refusals = [f"{c.name} ({c.origin}): {c.refused}"
                for s in ctx.report.selections if s.what == "consumer fusion"
                for c in s.candidates if c.refused]
    if refusals:
        return "; ".join(dict.fromkeys(refusals))
    records = ctx.registry.records if ctx.registry is not None else []
    plugins = ", ".join(f"{r.name} {r.status.value}" + (f" ({r.reason})" if r.reason else "") for r in records)
    return "no fusion provider offered a candidate" + (f"; plugins: {plugins}" if plugins else "; no plugins found")


class UnfusedContext(BoundaryContext):
    """A context that offers no fusion providers: the same plugins and norm kernels, every sum
    completed by the boundary's own collective followed by the separate add+norm kernel.

    Denying a plugin would not do: it would also take that plugin's norm kernels away, and the
    comparison is meant to change the fusion only.
    """

    def __init__(self, topology: Any, **kw: Any) -> None:
        # Where the context can leave out the core's fusions, do not even create them (their
        # workspaces are allocated at construction).
        if "core_fusion" in inspect.signature(BoundaryContext.__init__).parameters:
            kw.setdefault("core_fusion", False)
        super().__init__(topology, **kw)

    def fusion_providers(self) -> tuple[Any, ...]:
        return ()


def strip_candidates(stages: Iterable[Any]) -> int:
    """Drop candidates that construction bound without a fusion provider (a built-in fusion);
    returns how many there were. Only for the benchmark's unfused baseline."""
    dropped = 0
    for stage in stages:
        entries = stage.plan.entries
        for variant, entry in list(entries.items()):
            if entry.candidates:
                dropped += len(entry.candidates)
                entries[variant] = replace(entry, candidates=())
    return dropped


def two_stage_plan(ctx: BoundaryContext, hidden: int, dtype: torch.dtype, device: str,
                   seed: int = 0) -> tuple[Any, Any]:
    """An attention and an FFN stage of one decoder layer (previous: an FFN), built on ``ctx``
    with norm weights ``1 + N(0, 0.1^2)`` on ``device``; the context is frozen afterwards."""
    from layer_boundary import declare_attn, declare_ffn, make_stages, RMSNorm

    g = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(2):
        n = RMSNorm(hidden, dtype=dtype)
        with torch.no_grad():
            n.weight.copy_(1.0 + 0.1 * torch.randn(hidden, generator=g))
        norms.append(n.to(device))
    stages = make_stages((declare_attn(), norms[0]), (declare_ffn(), norms[1]), previous=declare_ffn(),
                         context=ctx)
    ctx.freeze()
    return stages[0], stages[1]


def model_stages(model: Any) -> list[Any]:
    """Every stage boundary of a reference decoder (attention and FFN of each layer)."""
    return [b for layer in model.model.layers for b in (layer.attn_boundary, layer.ffn_boundary)]


def describe_candidates(cands: list[AcceptedCandidate], ctx: Optional[BoundaryContext]) -> str:
    if cands:
        return ", ".join(f"{c.name} ({c.stage.split(' #')[0]})" for c in cands)
    return "no fused candidate accepted: " + (no_candidate_reason(ctx) if ctx is not None else "unknown")
