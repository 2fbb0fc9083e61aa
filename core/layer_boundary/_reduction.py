"""The FFN output reduction policy: which optional return paths a model may use.

========  =================================================================
``ar``      all-reduce, then each DP group keeps its rows
``rs``      fixed-size (padded) reduce-scatter where eligible
``rsv``     variable-size attention-DP reduce-scatter where eligible
``rs+rsv``  both scatter choices where eligible, RSv tried first
``auto``    the architecture's entry in ``AUTO_POLICY`` (``ar`` when unknown)
========  =================================================================

These are permissions: an ineligible scatter falls back to the all-reduce, and the selection
report says why. The policy is resolved before model construction.
"""

from __future__ import annotations

from typing import Optional

from ._topology import Topology

__all__ = ["POLICIES", "AUTO_POLICY", "resolve_policy", "return_paths", "refusals"]

POLICIES = ("ar", "rs", "rsv", "rs+rsv", "auto")

# Per-architecture defaults (HF model_type). Dense and MoE decoders whose FFN runs on gathered
# DP rows gain from scattering the output straight back to its group.
AUTO_POLICY: dict[str, str] = {
    "qwen3": "rs+rsv",
    "qwen3_moe": "rs+rsv",
    "hetero": "rs+rsv",
    "longcat": "rs+rsv",
}


def resolve_policy(policy: str, architecture: Optional[str] = None) -> str:
    """A concrete policy (never ``auto``)."""
    if policy not in POLICIES:
        raise ValueError(f"reduction policy {policy!r} is not one of {', '.join(POLICIES)}")
    if policy != "auto":
        return policy
    return AUTO_POLICY.get(architecture or "", "ar")


def _permitted(policy: str) -> tuple[str, ...]:
    return {"ar": ("ar",), "rs": ("rs", "ar"), "rsv": ("rsv", "ar"), "rs+rsv": ("rsv", "rs", "ar")}[policy]


def refusals(policy: str, topology: Topology) -> dict[str, str]:
    """Why each scatter path the policy permits cannot run on this topology."""
    out: dict[str, str] = {}
    for path in _permitted(policy):
        if path == "ar":
            continue
        if topology.attn_dp.size == 1:
            out[path] = "no attention DP: the FFN output already lands on the rows that need it"
        elif path == "rsv" and topology.attn_tp.size > 1:
            out[path] = (f"RSv returns whole DP-group rows to single ranks; attention TP is "
                         f"{topology.attn_tp.size}")
    return out


def return_paths(policy: str, topology: Topology) -> tuple[str, ...]:
    """The eligible return paths in preference order; ``ar`` always last."""
    refused = refusals(policy, topology)
    return tuple(p for p in _permitted(policy) if p not in refused)
