"""A LongCat-style decoder on the layer boundaries: a MoE branch beside a dense chain.

Each layer is two Qwen3 attention/FFN halves with a shortcut-connected MoE that reads the first
half's FFN input (the LongCat-Flash layout, built from the Qwen3 and MoE reference blocks; random
weights, no checkpoint)::

    r1 = r0 + attn_0(n_0(r0))                   x = m_0(r1)          (n_i input, m_i post-attn norms)
    r2 = r1 + mlp_0(x)
    r3 = r2 + attn_1(n_1(r2))
    r4 = r3 + (mlp_1(m_1(r3)) + moe(x))         the MoE output joins at the layer's end

Stages and boundaries:

==================  ==============================================  ============================
stage               declaration                                     entered with
==================  ==============================================  ============================
``attn_boundary``   ``declare_attn()``, previous: the last FFN      ``prepare()``
``moe_boundary``    ``declare_ffn(sparse=True)``                    ``prepare()`` (reads m_0)
``first_ffn``       ``declare_ffn()``, ``prepared_from`` the MoE    ``branch_input()``: x again,
                                                                    m_0 is not applied twice
``second_attn``     ``declare_attn()``                              ``prepare()``
``second_ffn``      ``declare_ffn()``, terminal on the last layer   ``prepare()``
==================  ==============================================  ============================

The MoE finishes first and its complete output is set aside (``branch_output``); the dense chain
owns the residual and ``merge_branch`` adds the MoE output to its last output, still pending, so
the next layer's input completes any sum left and applies one update. Attention runs over the
attention-TP group, dense FFNs and experts over TP (under attention DP on every group's rows).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional, Union

import torch
from torch import nn

from layer_boundary import (
    BoundaryContext, branch_output, declare_attn, declare_ffn, make_stages, merge_branch, RMSNorm, Topology,
)

from .config import Qwen3Config, small_random_config
from .layers import RotaryEmbedding, head_group
from .moe import SparseMoeBlock
from .qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model

__all__ = [
    "LongcatConfig",
    "small_random_longcat_config",
    "LongcatDecoderLayer",
    "LongcatModel",
    "LongcatForCausalLM",
    "random_longcat_state_dict",
    "init_random_longcat_weights",
    "plain_forward",
]


@dataclass(frozen=True, slots=True)
class LongcatConfig(Qwen3Config):
    """Qwen3 shapes per half-layer plus the shortcut MoE's: ``num_experts`` tensor-parallel
    experts of width ``moe_intermediate_size``, the top ``num_experts_per_tok`` of a softmax
    router (renormalized with ``norm_topk_prob``). ``num_hidden_layers`` counts LongCat layers
    (two attentions, two dense FFNs and one MoE each)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    model_type: str = "longcat"

    MODEL_TYPE: ClassVar[str] = "longcat"
    ARCHITECTURE: ClassVar[str] = "LongcatForCausalLM"
    _what: ClassVar[str] = "LongCat-style"

    def __post_init__(self) -> None:
        Qwen3Config.__post_init__(self)
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LongcatConfig.{name}={v!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")


def small_random_longcat_config() -> LongcatConfig:
    """The embedded LongCat-style model: two layers (four attentions), the Qwen3 default's shapes,
    8 experts, top 2."""
    base = small_random_config()
    kw = {f.name: getattr(base, f.name) for f in fields(base) if f.name != "model_type"}
    kw["num_hidden_layers"] = 2
    return LongcatConfig(**kw)


class LongcatDecoderLayer(nn.Module):
    def __init__(
        self,
        config: LongcatConfig,
        layer_id: int,
        context: BoundaryContext,
        *,
        rotary_emb: RotaryEmbedding,
        dtype: Optional[torch.dtype] = None,
        fusions: Any = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        topo = context.topology
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList(Qwen3Attention(config, head_group(topo), rotary_emb, dtype=dtype)
                                       for _ in range(2))
        self.mlps = nn.ModuleList(Qwen3MLP(config, topo.tp, dtype=dtype) for _ in range(2))
        self.mlp = SparseMoeBlock(h, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, topo.moe_out,
                                  renormalize=config.norm_topk_prob, dtype=dtype)
        self.input_layernorm = nn.ModuleList(RMSNorm(h, eps, dtype=dtype) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(h, eps, dtype=dtype) for _ in range(2))
        options = {"fusions": fusions} if fusions is not None else {}
        self.attn_boundary, self.moe_boundary = make_stages(
            (declare_attn(), self.input_layernorm[0], options),
            (declare_ffn(sparse=True), self.post_attention_layernorm[0], options),
            previous=declare_ffn() if layer_id != 0 else None,
            context=context,
        )
        # The dense chain starts from the input the MoE stage read; its first norm is the MoE's
        # and is never applied again.
        self.first_ffn, self.second_attn, self.second_ffn = make_stages(
            (declare_ffn(), self.post_attention_layernorm[0], options),
            (declare_attn(), self.input_layernorm[1], options),
            (declare_ffn(), self.post_attention_layernorm[1], options),
            prepared_from=self.moe_boundary.declaration,
            terminal=layer_id == config.num_hidden_layers - 1,
            context=context,
        )

    @property
    def boundaries(self) -> tuple[Any, ...]:
        return (self.attn_boundary, self.moe_boundary, self.first_ffn, self.second_attn, self.second_ffn)

    def forward(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn[0](positions, hidden_states, forward_batch)
        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)

        moe_input = self.moe_boundary.prepare(hidden_states, forward_batch)
        with self.moe_boundary.exit(forward_batch) as output:
            shortcut = self.mlp(moe_input)
        shortcut = branch_output(output.finish(shortcut), forward_batch)

        hidden_states = self.first_ffn.branch_input(self.moe_boundary, moe_input, forward_batch)
        with self.first_ffn.exit(forward_batch) as output:
            hidden_states = self.mlps[0](hidden_states)
        hidden_states = output.finish(hidden_states)

        hidden_states = self.second_attn.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn[1](positions, hidden_states, forward_batch)
        hidden_states = self.second_attn.finish(hidden_states, forward_batch)

        hidden_states = self.second_ffn.prepare(hidden_states, forward_batch)
        with self.second_ffn.exit(forward_batch) as output:
            hidden_states = self.mlps[1](hidden_states)
        hidden_states = output.finish(hidden_states)
        return merge_branch(hidden_states, forward_batch, shortcut)


class LongcatModel(Qwen3Model):
    """Embedding, LongCat-style layers, final norm; the forward (pipeline stages included) is
    :class:`Qwen3Model`'s. No two-batch-overlap schedule."""

    tbo_overlap = None

    def __init__(self, config: LongcatConfig, context: BoundaryContext, *,
                 dtype: Optional[torch.dtype] = None, fusions: Any = None) -> None:
        nn.Module.__init__(self)  # the layers differ; the rest is built as Qwen3Model does
        self._build(config, context, context.semantics("plain"), dtype,
                    lambda i, rotary_emb: LongcatDecoderLayer(config, i, context, rotary_emb=rotary_emb,
                                                              dtype=dtype, fusions=fusions))


class LongcatForCausalLM(Qwen3ForCausalLM):
    """``forward(input_ids [T], positions [T], forward_batch) -> logits [T, vocab]`` (FP32).

    Plain residual only (the branches meet by addition). Weights come from
    :func:`init_random_longcat_weights`; there is no checkpoint format.
    """

    config: LongcatConfig

    stacked_params_mapping: tuple[tuple[str, str, Any], ...] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(
        self,
        config: LongcatConfig,
        topology: Optional[Topology] = None,
        *,
        context: Optional[BoundaryContext] = None,
        dtype: torch.dtype = torch.float32,
        residual: Union[str, Any] = "plain",
        fusions: Any = None,
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, LongcatConfig):
            raise TypeError(f"LongcatForCausalLM needs a LongcatConfig, got {type(config).__name__}")
        if getattr(residual, "name", residual) != "plain":
            raise ValueError(f"the LongCat-style model has the plain residual only, not {residual!r}: "
                             "its two branches meet by addition")
        self._build(config, topology, context, "plain", dtype=dtype, architecture=config.model_type,
                    make_model=lambda context, _: LongcatModel(config, context, dtype=dtype, fusions=fusions))

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "LongcatForCausalLM":
        raise NotImplementedError("the LongCat-style reference has random weights only "
                                  "(init_random_longcat_weights); it reads no checkpoint")


def random_longcat_state_dict(config: LongcatConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full FP32 tensors from one CPU generator (every rank draws the same): linear weights
    ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2), the embedding and router as in the Qwen3
    references (router ~ N(0, 1/H): O(1) logits spread tokens over the experts)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    h = c.hidden_size

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    def mlp(p: str, width: int) -> None:
        sd[p + "gate_proj.weight"] = linear(width, h)
        sd[p + "up_proj.weight"] = linear(width, h)
        sd[p + "down_proj.weight"] = linear(h, width)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(c.vocab_size, h, generator=g)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for j in range(2):
            sd[p + f"input_layernorm.{j}.weight"] = norm(h)
            a = p + f"self_attn.{j}."
            sd[a + "q_proj.weight"] = linear(c.q_size, h)
            sd[a + "k_proj.weight"] = linear(c.kv_size, h)
            sd[a + "v_proj.weight"] = linear(c.kv_size, h)
            sd[a + "o_proj.weight"] = linear(h, c.q_size)
            sd[a + "q_norm.weight"] = norm(c.head_dim)
            sd[a + "k_norm.weight"] = norm(c.head_dim)
            sd[p + f"post_attention_layernorm.{j}.weight"] = norm(h)
            mlp(p + f"mlps.{j}.", c.intermediate_size)
        sd[p + "mlp.gate.weight"] = torch.randn(c.num_experts, h, generator=g) * h**-0.5
        for e in range(c.num_experts):
            mlp(p + f"mlp.experts.{e}.", c.moe_intermediate_size)
    sd["model.norm.weight"] = norm(h)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = linear(c.vocab_size, h)
    return sd


def init_random_longcat_weights(model: LongcatForCausalLM, *, seed: int = 0) -> None:
    """Fill ``model`` (any topology) with this rank's slice of ``random_longcat_state_dict(seed)``."""
    from .loader import load_tensors

    load_tensors(model, random_longcat_state_dict(model.config, seed=seed).items(),
                 source=f"random weights (seed {seed})")


def plain_forward(model: LongcatForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  forward_batch: Any) -> torch.Tensor:
    """``logits [T, vocab]`` of ``model`` written out without boundaries (the layer formula in
    the module docstring, with the add+norm references); one pipeline stage, no attention DP."""
    from layer_boundary.plugin_api import fused_add_rmsnorm_ref
    from .qwen3_plain import attention_half

    topo = model.topology
    if topo.attn_dp.size != 1 or topo.pp.size != 1:
        raise ValueError("plain_forward moves no rows between ranks: use a topology without "
                         "attention DP or pipeline stages (model.forward runs those)")
    m = model.model
    # one pipeline stage (checked above) holds the embedding, the final norm and the LM head
    assert m.embed_tokens is not None and m.norm is not None and model.lm_head is not None
    hidden_states = m.embed_tokens(input_ids)
    residual = None
    for layer in m.layers:
        assert isinstance(layer, LongcatDecoderLayer)  # LongcatModel builds only these
        shortcut = None
        for j in range(2):
            input_norm, post_norm = layer.input_layernorm[j], layer.post_attention_layernorm[j]
            assert isinstance(input_norm, RMSNorm) and isinstance(post_norm, RMSNorm)
            x, residual = attention_half(layer.self_attn[j], input_norm, post_norm, hidden_states, residual,
                                         positions, forward_batch, head_group(topo))
            if j == 0:
                shortcut = layer.mlp(x)  # no exit scope: the block sums its own output
            hidden_states = layer.mlps[j](x)
        hidden_states = hidden_states + shortcut
    assert residual is not None
    x, _ = fused_add_rmsnorm_ref(hidden_states, residual, m.norm.weight, m.norm.eps)
    return model.lm_head(x).float()
