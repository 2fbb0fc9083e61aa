"""Worker functions for the fused MoE finalize tests (importable by spawned ranks).

Each case runs the embedded Qwen3-MoE with ``fused_finalize`` (zero-centered norms; every sparse
FFN's handoff taken by the next attention input or the final norm) on this rank's layout and
compares it with the single-rank model that completes every finalize unfused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from layer_boundary._fusion.moe_finalize import MoeFinalizeFusion
from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

from parallel_cases import topology


def spec_of(case: dict[str, Any], world: int, device: str) -> RunSpec:
    return RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world, dp=case.get("dp", 1),
                   reduction=case.get("policy", "ar"), dtype=case["dtype"], plugins=False, moe=True,
                   fused_finalize=True, device=device, config_overrides=case.get("config", {}))


def unfused(spec: RunSpec, device: str) -> torch.Tensor:
    """The single-rank logits of the same model with every handoff completed unfused."""
    overrides = {"zero_centered_norms": True, **spec.config_overrides}
    return single_rank_logits(dataclasses.replace(spec, fused_finalize=False, config_overrides=overrides), device)


def providers(model: Any) -> list[MoeFinalizeFusion]:
    found: list[MoeFinalizeFusion] = []
    for layer in model.model.layers:
        for b in (layer.attn_boundary, layer.ffn_boundary):
            found += [p for p in b.plan.fusions if isinstance(p, MoeFinalizeFusion) and p not in found]
    return found


def fused_matrix(rank: int, world: int, cases: list[dict[str, Any]], device: str = "cpu") -> list[dict[str, Any]]:
    results = []
    for case in cases:
        spec = spec_of(case, world, device)
        topo = topology(world, spec.dp) if world > 1 else None
        from layer_boundary import Topology

        model = build_model(spec, topo or Topology.single(), device)
        idx, logits, _ = rank_forward(model, spec, device)
        want = unfused(spec, device)[idx]
        results.append({
            "case": case, "rows": len(idx), "max_diff": (logits - want).abs().max().item() if idx else 0.0,
            "scale": want.abs().max().item() if idx else 0.0,
            "fused_calls": sum(p.fused_calls for p in providers(model)),
            "kernel": providers(model)[0].kernel,
        })
    return results
