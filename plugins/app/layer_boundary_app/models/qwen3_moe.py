"""Qwen3-MoE decoder built on the layer boundaries; loads a Hugging Face checkpoint folder.

The layer is the dense Qwen3 layer with the MLP replaced by a sparse block on the layers
``Qwen3MoeConfig.is_sparse`` names (``decoder_sparse_step``, ``mlp_only_layers``). Its forward
is still prepare -> compute -> finish: the sparse block reads the exit scope's flags and either
sums its output over the MoE group, leaves that sum to the next boundary, or returns a finalize
handoff (``defer_moe_finalize``) that the next layer's input, or the final norm, completes.

Declarations: a sparse layer's FFN is ``declare_ffn(sparse=True, next_sparse=<next layer>)``,
and each layer's ``previous`` is built with the arguments the previous layer's FFN uses, so both
neighbours describe the same edge (a sparse FFN's output sum is over ``SumGroup.MOE_OUTPUT``).

``fusions``: a fusion provider given to both stages of every layer (for example one whose
``can_defer_finalize`` lets the sparse FFNs return handoffs); by default the context's plugins.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from torch import nn

from layer_boundary import BoundaryContext, declare_ffn, Topology
from layer_boundary.plugin_api import ResidualSemantics

from .config import Qwen3Config, Qwen3MoeConfig
from .layers import RotaryEmbedding
from .moe import SparseMoeBlock
from .qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model

__all__ = [
    "Qwen3MoeDecoderLayer",
    "Qwen3MoeModel",
    "Qwen3MoeForCausalLM",
    "ffn_declaration",
    "random_moe_state_dict",
    "init_random_moe_weights",
]


def ffn_declaration(config: Qwen3MoeConfig, layer_id: int, update: Any = None, read: Any = None) -> Any:
    """The FFN declaration of layer ``layer_id``: what that layer builds and what the next layer
    passes as ``previous`` (the same arguments, so the two sides agree)."""
    return declare_ffn(sparse=config.is_sparse(layer_id), next_sparse=config.is_sparse(layer_id + 1),
                       update=update, read=read)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """The dense layer (its forward included) with a sparse block on the layers
    ``config.is_sparse`` names, declared ``sparse`` (see :func:`ffn_declaration`)."""

    def __init__(
        self,
        config: Qwen3MoeConfig,
        layer_id: int,
        context: BoundaryContext,
        *,
        rotary_emb: RotaryEmbedding,
        dtype: Optional[torch.dtype] = None,
        residual: Optional[ResidualSemantics] = None,
        fusions: Any = None,
    ) -> None:
        nn.Module.__init__(self)  # as Qwen3DecoderLayer, with the fusions given to its stages
        self.is_sparse = config.is_sparse(layer_id)
        self._build(config, layer_id, context, rotary_emb=rotary_emb, dtype=dtype, residual=residual,
                    options={"fusions": fusions} if fusions is not None else {})

    def _make_ffn(self, config: Qwen3Config, layer_id: int, topology: Topology,
                  dtype: Optional[torch.dtype]) -> nn.Module:
        config = _moe_config(config)
        if not self.is_sparse:
            return Qwen3MLP(config, topology.tp, dtype=dtype)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, topology.moe_out, renormalize=config.norm_topk_prob,
            dtype=dtype,
        )

    @staticmethod
    def _ffn_declaration(config: Qwen3Config, layer_id: int, update: Any = None, read: Any = None) -> Any:
        return ffn_declaration(_moe_config(config), layer_id, update, read)


def _moe_config(config: Qwen3Config) -> Qwen3MoeConfig:
    """``config``, which the MoE layer is built with, checked to be a ``Qwen3MoeConfig`` (the base
    layer's hooks take the dense config)."""
    if not isinstance(config, Qwen3MoeConfig):
        raise TypeError(f"a Qwen3-MoE layer needs a Qwen3MoeConfig, got {type(config).__name__}")
    return config


class Qwen3MoeModel(Qwen3Model):
    """Embedding, Qwen3-MoE layers, final norm; the forward (pipeline stages included) is
    :class:`Qwen3Model`'s."""

    # Under two-batch overlap the sparse layers run as two microbatches (their expert
    # communication is what the other microbatch hides); a dense layer runs on the whole batch.
    tbo_overlap = "sparse"

    def __init__(
        self,
        config: Qwen3MoeConfig,
        context: BoundaryContext,
        *,
        dtype: Optional[torch.dtype] = None,
        residual: Optional[ResidualSemantics] = None,
        fusions: Any = None,
    ) -> None:
        nn.Module.__init__(self)  # the layers differ; everything else is built as Qwen3Model does
        if residual is None:
            residual = context.semantics("plain")
        self._build(config, context, residual, dtype, lambda i, rotary_emb: Qwen3MoeDecoderLayer(
            config, i, context, rotary_emb=rotary_emb, dtype=dtype, residual=residual, fusions=fusions))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``forward(input_ids [T], positions [T], forward_batch) -> logits [T, vocab]`` (FP32).

    Checkpoint names are HF's: per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (the
    layout ``save_pretrained`` writes and hub checkpoints use) and the router ``mlp.gate.weight``.
    """

    config: Qwen3MoeConfig

    # The dense merge, applied wherever an MLP sits (dense layers and every expert).
    stacked_params_mapping: tuple[tuple[str, str, Any], ...] = (
        (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
        (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
        (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(
        self,
        config: Qwen3MoeConfig,
        topology: Optional[Topology] = None,
        *,
        context: Optional[BoundaryContext] = None,
        dtype: torch.dtype = torch.float32,
        residual: Union[str, ResidualSemantics] = "plain",
        fusions: Any = None,
    ) -> None:
        nn.Module.__init__(self)  # as Qwen3ForCausalLM, with the MoE model inside
        if not isinstance(config, Qwen3MoeConfig):
            raise TypeError(f"Qwen3MoeForCausalLM needs a Qwen3MoeConfig, got {type(config).__name__}; "
                            "a dense config builds Qwen3ForCausalLM")
        self._build(config, topology, context, residual, dtype=dtype,
                    make_model=lambda context, residual: Qwen3MoeModel(config, context, dtype=dtype,
                                                                       residual=residual, fusions=fusions))

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike[str],
        topology: Optional[Topology] = None,
        *,
        context: Optional[BoundaryContext] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        residual: Union[str, ResidualSemantics] = "plain",
        fusions: Any = None,
    ) -> "Qwen3MoeForCausalLM":
        model = cls(Qwen3MoeConfig.from_folder(folder), topology, context=context, dtype=dtype,
                    residual=residual, fusions=fusions)
        model.load_weights(folder)
        if device is not None:
            model.to(device)
        return model.eval().requires_grad_(False)


_EXPERT_STREAM = 0xE0E  # offsets the experts' generator from the dense weights' one


def random_moe_state_dict(config: Qwen3MoeConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full FP32 tensors under HF names: the dense Qwen3 draw (``random_state_dict``) with each
    sparse layer's MLP replaced by a router and per-expert MLPs from a second generator.

    Router weights ~ N(0, 1/H), so logits are O(1) and tokens spread over the experts.
    """
    from .random_init import random_state_dict

    sd = random_state_dict(config, seed=seed)
    g = torch.Generator().manual_seed(seed + _EXPERT_STREAM)
    h, n = config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_hidden_layers):
        if not config.is_sparse(i):
            continue
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[p + f"{name}.weight"]
        sd[p + "gate.weight"] = torch.randn(config.num_experts, h, generator=g) * h**-0.5
        for e in range(config.num_experts):
            q = f"{p}experts.{e}."
            sd[q + "gate_proj.weight"] = torch.randn(n, h, generator=g) * h**-0.5
            sd[q + "up_proj.weight"] = torch.randn(n, h, generator=g) * h**-0.5
            sd[q + "down_proj.weight"] = torch.randn(h, n, generator=g) * n**-0.5
    return sd


def init_random_moe_weights(model: Qwen3MoeForCausalLM, *, seed: int = 0) -> None:
    """Fill a Qwen3-MoE model (any topology) with this rank's slice of
    ``random_moe_state_dict(seed)``; a residual scheme's own parameters as ``init_random_weights``."""
    from .loader import load_tensors
    from .random_init import _RESIDUAL_STREAM

    load_tensors(model, random_moe_state_dict(model.config, seed=seed).items(),
                 source=f"random weights (seed {seed})")
    modules = model.residual_modules()
    if modules:
        g = torch.Generator().manual_seed(seed + _RESIDUAL_STREAM)
        for _, module in modules:
            init = getattr(module, "init_random", None)
            if init is not None:
                init(g)
