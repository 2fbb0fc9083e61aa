"""A heterogeneous decoder on the layer boundaries: one single-stage layer per pattern character.

======  =====================================  ==================================================  ==========
char    layer                                  declaration                                         output
======  =====================================  ==================================================  ==========
``M``   gated short convolution (token mixer)  ``declare_attn(reduction=SCOPED,                    SCOPED
                                               gathers_tp_input=False)``
``*``   Qwen3 attention                        ``declare_attn()``                                  PARTIAL
``-``   Qwen3 dense FFN                        ``declare_ffn()``                                   SCOPED
======  =====================================  ==================================================  ==========

Every layer is ``r' = r + f(RMSNorm(r))``. It builds its one stage the way Nemotron-H does,
``make_stages((decl, norm), previous=<previous layer's declaration>, following=<next layer's
declaration>, terminal=...)``, so a mixer knows its consumer: before an FFN it always leaves its
attention-TP sum to the FFN's input; before another mixer it may, per batch, when a fusion
provider accepts (never under attention DP); elsewhere it sums in compute.

The mixer, with ``C`` conv channels and kernel ``K`` (shapes per rank of an attention-TP group
of ``R``):

==================  =======================================  ===========================
step                formula                                  shape
==================  =======================================  ===========================
``in_proj``         ``[u, g] = x [W_u; W_g]^T`` (column)     [T, H] -> 2 x [T, C/R]
``conv``            ``v_t = b + sum_j w_j * u_{t-K+1+j}``    [T, C/R], per channel, causal,
                                                             zero before a sequence's start
gate                ``y = v * silu(g)``                      [T, C/R]
``out_proj``        ``sum_r y_r W_o,r^T`` (row)              [T, C/R] -> [T, H], summed unless
                                                             the exit skips the reduction
==================  =======================================  ===========================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from layer_boundary import (
    BoundaryContext, context_parallel_split, declare_attn, declare_ffn, GroupInfo, make_stages,
    ProducerReduction, RMSNorm, StageDeclaration, Topology,
)
from layer_boundary.residual import batch as residual_batch

from .layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_group,
    set_weight_loader,
)
from .loader import load_tensors
from .qwen3 import Qwen3Attention, Qwen3MLP

__all__ = [
    "LayerKind",
    "HeteroConfig",
    "parse_pattern",
    "layer_declaration",
    "causal_conv",
    "ShortConvMixer",
    "MixerLayer",
    "AttentionLayer",
    "FfnLayer",
    "HeteroModel",
    "HeteroForCausalLM",
    "hetero_state_dict",
    "init_hetero_weights",
]


class LayerKind(enum.Enum):
    MIXER = "M"
    ATTENTION = "*"
    FFN = "-"




def parse_pattern(pattern: str) -> tuple[LayerKind, ...]:
    """``"M-M*-"`` -> one :class:`LayerKind` per character (``M`` mixer, ``*`` attention, ``-`` FFN)."""
    legend = "M (gated short-convolution mixer), * (attention), - (dense FFN)"
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a string such as 'M-M*-', got {type(pattern).__name__}")
    if not pattern:
        raise ValueError(f"the layer pattern is empty; give one character per layer: {legend}, e.g. 'M-M*-'")
    kinds = []
    for i, ch in enumerate(pattern):
        try:
            kinds.append(LayerKind(ch))
        except ValueError:
            raise ValueError(
                f"layer pattern {pattern!r} has {ch!r} at position {i}; each character is one layer: "
                f"{legend}"
            ) from None
    return tuple(kinds)


def layer_declaration(kind: LayerKind) -> StageDeclaration:
    """The declaration a layer of ``kind`` builds its stage with (and its neighbours describe it by)."""
    if kind is LayerKind.MIXER:
        return declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    if kind is LayerKind.ATTENTION:
        return declare_attn()
    return declare_ffn()


@dataclass(frozen=True, slots=True)
class HeteroConfig:
    """Shapes of the heterogeneous reference; the attention and FFN fields mean what Qwen3's do."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    conv_size: int = 64  # C: channels of the mixer's convolution (and of its gate)
    conv_kernel: int = 3  # K
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "hetero"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "conv_size", "conv_kernel",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HeteroConfig.{name}={v!r} must be a positive integer")
        if self.head_dim % 2:
            raise ValueError(f"HeteroConfig.head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def sequence_offsets(num_tokens: int, seq_lens: Optional[tuple[int, ...]], device: Any) -> torch.Tensor:
    """Row index of each packed row inside its own sequence: ``[T]`` (``None``: one sequence).

    Without a convolution state cache every sequence starts at its first row (position 0).
    """
    rows = torch.arange(num_tokens, device=device)
    if seq_lens is None or len(seq_lens) <= 1:
        return rows
    lens = torch.tensor(seq_lens, device=device)
    starts = torch.cumsum(lens, 0) - lens
    return rows - torch.repeat_interleave(starts, lens)


def causal_conv(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                offsets: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution over packed sequences.

    ``v[t, c] = b[c] + sum_{s=0}^{K-1} w[c, K-1-s] * u[t-s, c]``, where a term whose row
    ``t - s`` lies before the start of row ``t``'s sequence (``offsets[t] < s``) is zero.
    ``u [T, C]``, ``weight [C, K]``, ``bias [C]``, ``offsets [T]`` -> ``[T, C]``.
    """
    k = weight.shape[1]
    v = u * weight[:, k - 1]
    for s in range(1, min(k, u.shape[0])):
        shifted = torch.zeros_like(u)
        shifted[s:] = u[:-s]
        shifted = shifted.masked_fill((offsets < s).unsqueeze(-1), 0)
        v = v + shifted * weight[:, k - 1 - s]
    return v + bias if bias is not None else v


class ShortConv(nn.Module):
    """Per-channel causal kernel ``weight [C/R, K]`` and ``bias [C/R]``: this rank's channels."""

    def __init__(self, channels: int, kernel: int, group: GroupInfo, *, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if channels % group.size:
            raise ValueError(
                f"conv_size={channels} is not divisible by the attention-TP size {group.size}; "
                "choose a TP size that divides it"
            )
        self.group = group
        self.channels = channels
        self.local = channels // group.size
        self.weight = nn.Parameter(torch.empty(self.local, kernel, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.local, dtype=dtype))
        set_weight_loader(self.weight, self.weight_loader)
        set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, full: torch.Tensor) -> None:
        if full.shape[0] != self.channels or tuple(full.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(
                f"ShortConv: checkpoint tensor has shape {tuple(full.shape)}, expected "
                f"{(self.channels, *param.shape[1:])}"
            )
        with torch.no_grad():
            param.copy_(full.narrow(0, self.group.rank * self.local, self.local).to(param.dtype))

    def forward(self, u: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return causal_conv(u, self.weight, self.bias, offsets)


class ShortConvMixer(nn.Module):
    """``out_proj(conv(u) * silu(g))`` with ``[u, g] = in_proj(x)``; sharded over attention TP.

    ``out_proj`` is a ``RowParallelLinear`` with ``reduce_results=True``: it sums over attention TP
    unless the mixer's exit scope publishes ``fuse_mlp_allreduce`` (``MixerExit.skips_reduction``).
    """

    def __init__(self, config: HeteroConfig, group: GroupInfo, *, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        c = config.conv_size
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, [c, c], False, group, dtype=dtype)
        self.conv = ShortConv(c, config.conv_kernel, group, dtype=dtype)
        self.out_proj = RowParallelLinear(c, config.hidden_size, False, group, reduce_results=True, dtype=dtype)

    def forward(self, x: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        u, g = self.in_proj(x).chunk(2, dim=-1)
        offsets = sequence_offsets(x.shape[0], getattr(forward_batch, "seq_lens", None), x.device)
        return self.out_proj(self.conv(u, offsets) * F.silu(g))


class _Layer(nn.Module):
    """One single-stage layer: its norm, its compute and its boundary."""

    kind: LayerKind

    def __init__(self, decl: StageDeclaration, previous: Optional[LayerKind], following: Optional[LayerKind],
                 config: HeteroConfig, context: BoundaryContext, options: dict[str, Any],
                 dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        item: tuple = (decl, self.norm, options) if options else (decl, self.norm)
        (self.boundary,) = make_stages(
            item,
            previous=layer_declaration(previous) if previous is not None else None,
            following=layer_declaration(following) if following is not None else None,
            terminal=following is None,
            context=context,
        )

    @property
    def boundaries(self) -> tuple[Any, ...]:
        return (self.boundary,)


class MixerLayer(_Layer):
    kind = LayerKind.MIXER

    def __init__(self, config: HeteroConfig, context: BoundaryContext, previous: Optional[LayerKind],
                 following: Optional[LayerKind], *, options: dict[str, Any],
                 dtype: Optional[torch.dtype] = None, **_: Any) -> None:
        super().__init__(layer_declaration(self.kind), previous, following, config, context, options, dtype)
        self.mixer = ShortConvMixer(config, head_group(context.topology), dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        with self.boundary.exit(forward_batch) as output:
            hidden_states = self.mixer(hidden_states, forward_batch)
        return output.finish(hidden_states)


class AttentionLayer(_Layer):
    kind = LayerKind.ATTENTION

    def __init__(self, config: HeteroConfig, context: BoundaryContext, previous: Optional[LayerKind],
                 following: Optional[LayerKind], *, options: dict[str, Any],
                 rotary_emb: RotaryEmbedding, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(layer_declaration(self.kind), previous, following, config, context, options, dtype)
        self.self_attn = Qwen3Attention(config, head_group(context.topology), rotary_emb, dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        # A CP rank without tokens still joins the key/value gather of the others.
        if hidden_states.shape[0] != 0 or context_parallel_split(forward_batch) is not None:
            hidden_states = self.self_attn(
                positions=positions, hidden_states=hidden_states, forward_batch=forward_batch
            )
        return self.boundary.finish(hidden_states, forward_batch)


class FfnLayer(_Layer):
    kind = LayerKind.FFN

    def __init__(self, config: HeteroConfig, context: BoundaryContext, previous: Optional[LayerKind],
                 following: Optional[LayerKind], *, options: dict[str, Any],
                 dtype: Optional[torch.dtype] = None, **_: Any) -> None:
        super().__init__(layer_declaration(self.kind), previous, following, config, context, options, dtype)
        self.mlp = Qwen3MLP(config, context.topology.tp, dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        with self.boundary.exit(forward_batch) as output:
            hidden_states = self.mlp(hidden_states)
        return output.finish(hidden_states)


_LAYERS = {LayerKind.MIXER: MixerLayer, LayerKind.ATTENTION: AttentionLayer, LayerKind.FFN: FfnLayer}


class HeteroModel(nn.Module):
    def __init__(self, config: HeteroConfig, pattern: str, context: BoundaryContext, *,
                 dtype: Optional[torch.dtype] = None, fusions: Any = None) -> None:
        super().__init__()
        self.config = config
        self.pattern = pattern
        kinds = parse_pattern(pattern)
        topology = self.topology = context.topology
        options = {"fusions": fusions} if fusions is not None else {}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, head_group(topology), dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            _LAYERS[kind](
                config, context,
                kinds[i - 1] if i > 0 else None,
                kinds[i + 1] if i + 1 < len(kinds) else None,
                options=options, rotary_emb=self.rotary_emb, dtype=dtype,
            )
            for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        residual_batch.bind_final_norm(self.norm, context=context)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        residual_batch.start(forward_batch)
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, forward_batch)
        return residual_batch.norm(hidden_states, forward_batch, self.norm, skip_empty=True)


class HeteroForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> logits [T, vocab]`` (FP32).

    ``pattern``: one character per layer (see :func:`parse_pattern`). ``fusions``: a fusion
    provider given to every stage (its ``can_defer_all_reduce`` decides a mixer-to-mixer deferral).
    """

    stacked_params_mapping: tuple[tuple[str, str, Any], ...] = (
        (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
        (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
        (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
        (".mixer.conv_proj.", ".mixer.in_proj.", 0),
        (".mixer.gate_proj.", ".mixer.in_proj.", 1),
    )

    def __init__(
        self,
        config: HeteroConfig,
        pattern: str,
        topology: Optional[Topology] = None,
        *,
        context: Optional[BoundaryContext] = None,
        dtype: torch.dtype = torch.float32,
        fusions: Any = None,
    ) -> None:
        super().__init__()
        if context is None:
            context = BoundaryContext(topology, architecture=config.model_type)
        elif topology is not None and topology is not context.topology:
            raise ValueError("give either topology= or context= (which has its own topology), not both")
        self.config = config
        self.pattern = pattern
        self.context = context
        self.topology = context.topology
        self.residual = context.semantics("plain")
        self.model = HeteroModel(config, pattern, context, dtype=dtype, fusions=fusions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, head_group(self.topology), dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def ignored_checkpoint_name(self, name: str) -> bool:
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def boundaries(self) -> Iterator[Any]:
        for layer in self.model.layers:
            assert isinstance(layer, _Layer)  # HeteroModel builds its layers from _LAYERS
            yield from layer.boundaries

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.lm_head(hidden_states).float()


def hetero_state_dict(config: HeteroConfig, pattern: str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full FP32 tensors of the model ``pattern`` names, from one CPU generator (any rank draws
    the same). Linear weights ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1^2); the embedding
    ~ N(0, 1); conv weights ~ N(0, 1/K) and conv biases ~ N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g)}
    for i, kind in enumerate(parse_pattern(pattern)):
        p = f"model.layers.{i}."
        sd[p + "norm.weight"] = norm(c.hidden_size)
        if kind is LayerKind.MIXER:
            sd[p + "mixer.conv_proj.weight"] = linear(c.conv_size, c.hidden_size)
            sd[p + "mixer.gate_proj.weight"] = linear(c.conv_size, c.hidden_size)
            sd[p + "mixer.conv.weight"] = torch.randn(c.conv_size, c.conv_kernel, generator=g) * c.conv_kernel**-0.5
            sd[p + "mixer.conv.bias"] = 0.1 * torch.randn(c.conv_size, generator=g)
            sd[p + "mixer.out_proj.weight"] = linear(c.hidden_size, c.conv_size)
        elif kind is LayerKind.ATTENTION:
            sd[p + "self_attn.q_proj.weight"] = linear(c.q_size, c.hidden_size)
            sd[p + "self_attn.k_proj.weight"] = linear(c.kv_size, c.hidden_size)
            sd[p + "self_attn.v_proj.weight"] = linear(c.kv_size, c.hidden_size)
            sd[p + "self_attn.o_proj.weight"] = linear(c.hidden_size, c.q_size)
            sd[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
        else:
            sd[p + "mlp.gate_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
            sd[p + "mlp.up_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
            sd[p + "mlp.down_proj.weight"] = linear(c.hidden_size, c.intermediate_size)
    sd["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = linear(c.vocab_size, c.hidden_size)
    return sd


def init_hetero_weights(model: HeteroForCausalLM, *, seed: int = 0) -> None:
    """Fill ``model`` (any topology) with this rank's slice of ``hetero_state_dict(seed)``."""
    sd = hetero_state_dict(model.config, model.pattern, seed=seed)
    load_tensors(model, sd.items(), source=f"random weights (seed {seed})")
