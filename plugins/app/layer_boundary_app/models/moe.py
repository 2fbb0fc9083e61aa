"""Mixture-of-experts layers with tensor-parallel experts, written the way an engine writes them.

A sparse block computes, for token ``t`` routed to experts ``e_1..e_k`` with weights
``w_1..w_k``::

    y_t = sum_j w_j * down_e_j(act(gate_e_j(x_t), up_e_j(x_t)))  [+ s_t * shared(x_t)]

Every expert (and the shared expert) is split over the MoE group like a dense MLP: ``gate``/``up``
column-parallel, ``down`` row-parallel. Each rank therefore holds a *partial* ``y_t``, and the
whole block owes exactly one sum over the MoE output group (routed experts and shared expert
together). The block honours the exit scope's flags as ``RowParallelLinear`` does:

=========================  ======================================================================
flag on ``get_forward()``  what the block returns
=========================  ======================================================================
none                       ``y``, summed over the group
``fuse_mlp_allreduce``     ``y``, partial: the next boundary input completes the sum
``mlp_reduce_scatter``     ``y``, partial: the exit reduce-scatters it to the DP group's rows
``defer_moe_finalize``     a ``HandoffOutput``: ``complete()`` runs the top-k combine (plus the
                           shared expert) and returns the partial ``y``; the boundary owes its sum
=========================  ======================================================================

Shapes on a rank of ``R`` (``T`` tokens, ``H`` hidden, ``E`` experts, ``k`` experts per token,
``I`` expert width):

| tensor              | shape          | note                                          |
| ------------------- | -------------- | --------------------------------------------- |
| router weight       | ``[E, H]``     | replicated                                    |
| expert gate_up      | ``[2 I/R, H]`` | this rank's gate columns, then its up columns |
| expert down         | ``[H, I/R]``   | this rank's input columns                     |
| ``topk_weights``    | ``[T, k]``     | replicated, model dtype                       |
| ``expert_out``      | ``[T, k, H]``  | partial over the group, handoff payload       |
| ``shared_out``      | ``[T, H]``     | partial over the group (or ``None``)          |
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from layer_boundary import get_forward, GroupInfo, HandoffOutput
from layer_boundary.plugin_api import moe_finalize

from .comm import all_reduce
from .moe_experts import ACTIVATIONS, experts_op, run_experts, silu_and_mul
from .layers import MergedColumnParallelLinear, RowParallelLinear, default_weight_loader, set_weight_loader

__all__ = [
    "silu_and_mul",
    "ExpertMLP",
    "TopKRouter",
    "SparseMoeBlock",
    "moe_finalize",
    "DeferFinalize",
]

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]




class ExpertMLP(nn.Module):
    """``down(act(gate(x), up(x)))`` sharded over ``group``; never reduces (its block sums once).

    Parameter names follow HF checkpoints after the usual merge: ``gate_up_proj`` takes
    ``gate_proj`` (shard 0) and ``up_proj`` (shard 1); ``down_proj`` is ``down_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        group: GroupInfo,
        *,
        act: Activation = silu_and_mul,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        n = intermediate_size
        self.act = act
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [n, n], False, group, dtype=dtype)
        self.down_proj = RowParallelLinear(n, hidden_size, False, group, reduce_results=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up))


class TopKRouter(nn.Module):
    """``p = softmax(x Wg^T)`` over experts (in FP32, or FP64), keep the top ``k``; with ``renormalize``
    divide them by their sum. Returns ``(weights [T, k] in x's dtype, expert ids [T, k])``.

    ``weight`` is replicated: every rank routes its (identical) rows the same way.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        # FP32 at least (as transformers routes bf16 models); a float64 model keeps float64.
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        probs = torch.softmax(logits, dim=-1, dtype=acc)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The combine runs in the model dtype, as the routed outputs it weighs are.
        return weights.to(x.dtype), ids

    def extra_repr(self) -> str:
        e, h = self.weight.shape
        return f"hidden={h}, experts={e}, top_k={self.top_k}, renormalize={self.renormalize}"


class SparseMoeBlock(nn.Module):
    """Router, ``E`` tensor-parallel experts and an optional shared expert; one sum over ``group``.

    ``shared_intermediate_size`` adds a shared expert every token runs through; with
    ``shared_gate`` its output is scaled by ``sigmoid(x w_s)`` per token (a replicated
    ``[1, H]`` weight named ``shared_expert_gate``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        group: GroupInfo,
        *,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        act: Activation = silu_and_mul,
        router: Optional[nn.Module] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = router if router is not None else TopKRouter(
            hidden_size, num_experts, top_k, renormalize=renormalize, dtype=dtype
        )
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, intermediate_size, group, act=act, dtype=dtype) for _ in range(num_experts)
        )
        self.shared_expert = (
            ExpertMLP(hidden_size, shared_intermediate_size, group, act=act, dtype=dtype)
            if shared_intermediate_size else None
        )
        self.shared_expert_gate = None
        if shared_gate:
            if self.shared_expert is None:
                raise ValueError("shared_gate=True needs a shared expert (shared_intermediate_size > 0)")
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype)

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(expert_out [T, k, H] partial, topk_weights [T, k], topk_ids [T, k])``."""
        weights, ids = self.gate(x)
        act = self._act_name
        if torch.compiler.is_compiling():
            if act is None:
                raise TypeError(
                    f"the experts' activation {self._expert_list[0].act!r} has no name in "
                    "moe_experts.ACTIVATIONS, so the compiled forward's expert operator cannot carry "
                    "it: register it there under a name")
            return experts_op(x, ids, self._gate_up, self._down, act, self.top_k), weights, ids
        if act is None:  # an activation the operator cannot name still runs eagerly
            out = x.new_zeros(x.shape[0], self.top_k, x.shape[-1])
            for e in (torch.unique(ids).tolist() if x.shape[0] else ()):
                tokens, slots = torch.where(ids == e)
                out[tokens, slots] = self.experts[e](x[tokens])
            return out, weights, ids
        return run_experts(x, ids, self._gate_up, self._down, act, self.top_k), weights, ids

    @property
    def _expert_list(self) -> list[ExpertMLP]:
        return [cast(ExpertMLP, e) for e in self.experts]

    @property
    def _act_name(self) -> Optional[str]:
        act = self._expert_list[0].act
        return next((n for n, f in ACTIVATIONS.items() if f is act), None)

    @property
    def _gate_up(self) -> list[torch.Tensor]:
        return [e.gate_up_proj.weight for e in self._expert_list]

    @property
    def _down(self) -> list[torch.Tensor]:
        return [e.down_proj.weight for e in self._expert_list]

    def shared(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if self.shared_expert is None:
            return None
        y = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            y = torch.sigmoid(self.shared_expert_gate(x)) * y
        return y

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, HandoffOutput]:
        flags = get_forward()
        expert_out, weights, ids = self.routed(x)
        shared_out = self.shared(x)
        # The sum over the group runs here unless a boundary took it over; a deferred finalize
        # always comes with the sum deferred too when the group has more than one rank.
        reduce = self.group.size > 1 and not (flags.fuse_mlp_allreduce or flags.mlp_reduce_scatter)
        group = self.group

        def finalize() -> torch.Tensor:
            y = moe_finalize(expert_out, weights, shared_out)
            return all_reduce(y, group) if reduce else y

        if flags.defer_moe_finalize:
            return HandoffOutput(
                finalize, num_tokens=x.shape[0], expert_out=expert_out, topk_weights=weights,
                topk_ids=ids, shared_out=shared_out,
            )
        return finalize()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, tp={self.group.size}"


class DeferFinalize:
    """A fusion provider that lets every sparse FFN exit return a finalize handoff.

    It offers no fused consumer: the next layer's input (or the final norm) completes the
    handoff unfused, then the owed sum. Useful to exercise the handoff path end to end; a
    backend provider answers ``can_defer_finalize`` from what its fused kernel supports.
    """

    name = "defer-moe-finalize"

    def __init__(self) -> None:
        self.asked = 0

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        self.asked += 1
        return True
