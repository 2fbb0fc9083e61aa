"""The routed experts of the reference MoE as one ``torch.library`` operator.

Running only the experts some token chose, each on exactly its tokens, needs the chosen set on the
host (``torch.unique(...).tolist()``): a data-dependent shape, which ``torch.compile(fullgraph=True)``
cannot trace. Engines put their fused-MoE kernel behind an operator for the same reason; this is
the reference's. Eager forwards call :func:`run_experts` directly (the operator's dispatch is pure
overhead there); a traced forward calls the operator, whose fake implementation gives the output's
shape, and which runs the same code, so compiled and eager numbers are the same bits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "run_experts", "experts_op"]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the SwiGLU activation of Qwen experts."""
    return F.silu(gate) * up


# The activations the operator can name (its schema carries a string, not a callable).
ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"silu_and_mul": silu_and_mul}


def run_experts(x: torch.Tensor, ids: torch.Tensor, gate_up: Sequence[torch.Tensor],
                down: Sequence[torch.Tensor], act: str, top_k: int) -> torch.Tensor:
    """``expert_out [T, k, H]``: slot ``(t, j)`` holds expert ``ids[t, j]`` applied to ``x[t]``,
    partial over the experts' shard group. Experts no token chose do not run."""
    out = x.new_zeros(x.shape[0], top_k, x.shape[-1])
    if x.shape[0] == 0:
        return out
    fn = ACTIVATIONS[act]
    # A host sync per layer: this is a reference, not a grouped-GEMM kernel.
    for e in torch.unique(ids).tolist():
        tokens, slots = torch.where(ids == e)
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        out[tokens, slots] = F.linear(fn(gate, up), down[e])
    return out


@torch.library.custom_op("layer_boundary_app::moe_experts", mutates_args=())
def experts_op(x: torch.Tensor, ids: torch.Tensor, gate_up: list[torch.Tensor],
               down: list[torch.Tensor], act: str, top_k: int) -> torch.Tensor:
    return run_experts(x, ids, gate_up, down, act, top_k)


@experts_op.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
      act: str, top_k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], top_k, x.shape[-1])
