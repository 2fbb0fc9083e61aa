"""The Qwen3 forward without boundaries: same modules, same kernels, an explicit residual.

Used to measure what the boundaries cost on the host. It calls the add+norm references directly,
so on one rank it matches :meth:`Qwen3ForCausalLM.forward` bit for bit in FP32. Attention data
parallelism (rows that differ between TP ranks) needs the boundaries' row movement and is rejected.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from layer_boundary import GroupInfo, RMSNorm
from layer_boundary.plugin_api import fused_add_rmsnorm_ref, rmsnorm_ref

from .comm import all_reduce
from .layers import head_group
from .qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

__all__ = ["plain_forward", "attention_half"]


def attention_half(
    attn: nn.Module, input_norm: RMSNorm, post_norm: RMSNorm, hidden_states: torch.Tensor,
    residual: Optional[torch.Tensor], positions: torch.Tensor, forward_batch: Any, group: GroupInfo,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(post_norm(r'), r')`` with ``r = residual + hidden_states`` (``hidden_states`` at the
    stack's entry) and ``r' = r + sum_group(attn(input_norm(r)))``: the input of the FFN after
    ``attn``, and the residual it adds to."""
    if residual is None:
        residual = hidden_states
        x = rmsnorm_ref(hidden_states, input_norm.weight, input_norm.eps)
    else:
        x, residual = fused_add_rmsnorm_ref(hidden_states, residual, input_norm.weight, input_norm.eps)
    if x.shape[0] != 0:
        x = attn(positions=positions, hidden_states=x, forward_batch=forward_batch)
    hidden_states = all_reduce(x, group)  # o_proj leaves its sum (PARTIAL)
    return fused_add_rmsnorm_ref(hidden_states, residual, post_norm.weight, post_norm.eps)


def plain_forward(
    model: Qwen3ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any
) -> torch.Tensor:
    """``logits [T, vocab]`` (FP32) of ``model`` computed without its boundaries."""
    if model.residual.name != "plain":
        raise ValueError(
            f"plain_forward writes out the plain residual (r' = r + y), but the model was built "
            f"with residual={model.residual.name!r}; use model.forward (the boundary path)"
        )
    if model.topology.attn_dp.size != 1:
        raise ValueError(
            f"plain_forward runs without row movement, but the topology has attention DP "
            f"{model.topology.attn_dp.size}; use model.forward (the boundary path) for attention DP"
        )
    m = model.model
    if m.embed_tokens is None or m.norm is None or model.lm_head is None:
        raise ValueError(
            f"plain_forward runs the whole stack on one pipeline stage, but the topology has "
            f"pp={model.topology.pp.size}; use model.forward (the boundary path) for pipeline stages"
        )
    attn_tp = head_group(model.topology)  # the ranks o_proj shards heads over (attention TP without CP)
    hidden_states = m.embed_tokens(input_ids)
    residual = None
    for layer in m.layers:
        if not isinstance(layer, Qwen3DecoderLayer):
            raise TypeError(f"plain_forward writes out the Qwen3 decoder layer, not {type(layer).__name__}")
        x, residual = attention_half(layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm,
                                     hidden_states, residual, positions, forward_batch, attn_tp)
        hidden_states = layer.mlp(x)  # down_proj reduces: no exit scope publishes a skip
    if residual is None:
        x = rmsnorm_ref(hidden_states, m.norm.weight, m.norm.eps)
    else:
        x, _ = fused_add_rmsnorm_ref(hidden_states, residual, m.norm.weight, m.norm.eps)
    return model.lm_head(x).float()
