"""Dense Qwen3 decoder built on the layer boundaries; loads a Hugging Face checkpoint folder.

A decoder layer's forward is the spec's prepare -> compute -> finish and nothing else: the
boundaries own the residual, the norms' add+read and every sum the compute leaves unfinished.

Tensor parallelism: attention (q/k/v by heads, ``o_proj`` by its input) is sharded over the
head group (``Topology.attn_heads``: the attention-TP group, less the context-parallel ranks that
split its tokens), the MLP over the full TP group, the embedding and LM head (by vocabulary) over
the head group, whose ranks hold the same token rows. ``o_proj`` never reduces (the ``PARTIAL``
attention contract: the next boundary completes the sum); ``down_proj`` reduces unless the FFN
exit scope tells it not to. Context-parallel prefill: see ``Qwen3Attention``.

Residual schemes: ``residual="plain"`` (the default) is ``r' = r + y`` with fused add+RMSNorm
reads; another name (for example ``"mhc"`` from the ``layer-boundary-mhc`` plugin) is looked up in
the context's plugins. A scheme that owns parameters registers them per stage as
``attn_residual`` / ``ffn_residual`` (and ``model.final_residual`` for its exit): checkpoints
without them still load, and the scheme's own init fills them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from layer_boundary import (
    BoundaryContext, context_parallel_split, declare_attn, declare_ffn, GemmaRMSNorm, GroupInfo, make_stages,
    model_forward_stages, plan_overlap, recv_tensors, RMSNorm, send_tensors, StageBoundary, Topology,
)
from layer_boundary.plugin_api import ResidualSemantics, residual_part
from layer_boundary.residual import batch as residual_batch

from .config import Qwen3Config
from .layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_group,
)
from .loader import load_checkpoint

__all__ = [
    "Qwen3Attention",
    "Qwen3MLP",
    "Qwen3DecoderLayer",
    "Qwen3Model",
    "Qwen3ForCausalLM",
    "causal_attention",
    "pp_layer_range",
    "RESIDUAL_MODULES",
]

# Attribute names of the parameter modules a residual scheme owns (none for the plain residual).
RESIDUAL_MODULES = ("attn_residual", "ffn_residual", "final_residual")


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``pp_rank``: equal parts, the remainder on the
    last stage."""
    per = num_layers // pp_size
    if per == 0:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages; "
                         "every stage needs at least one layer")
    start = pp_rank * per
    return start, (num_layers if pp_rank == pp_size - 1 else start + per)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Optional[tuple[int, ...]],
    scale: float,
    *,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention over packed sequences: ``q [T, Hq, d]``, ``k, v [T, Hk, d]`` -> ``[T, Hq, d]``.

    ``seq_lens`` splits the ``T`` rows into consecutive sequences (block-diagonal causal mask);
    ``None`` or one length is a single sequence. ``Hq`` is a multiple of ``Hk`` (grouped-query).
    ``mask [Tq, Tk]`` (bool, True where a query may attend) replaces both for queries that are
    not the key rows: under context parallelism ``q`` holds this rank's tokens and ``k, v`` every
    token's (``CpSplit.causal_mask()``).
    """
    if mask is not None:
        if q.shape[0] == 0:  # a CP rank without tokens: it only joined the key/value gather
            return q.new_zeros(0, q.shape[1], v.shape[2])
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(0).transpose(0, 1)
    if seq_lens is not None and len(seq_lens) == q.shape[0] and q.shape[0] > 1:
        # Every sequence is one token (a decode step with an empty cache): each row attends to
        # itself only. Built without host data so the step can be captured in a CUDA graph.
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, d]
    gqa = q.shape[1] != k.shape[1]
    if seq_lens is None or len(seq_lens) <= 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        seq = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=q.device),
            torch.tensor(seq_lens, device=q.device),
        )
        rows = torch.arange(q.shape[0], device=q.device)
        mask = (seq[:, None] == seq[None, :]) & (rows[:, None] >= rows[None, :])
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def stack_norm(config: Qwen3Config, dtype: Optional[torch.dtype]) -> RMSNorm:
    """A layer or final norm: zero-centered (Gemma) where the config asks for it."""
    cls = GemmaRMSNorm if getattr(config, "zero_centered_norms", False) else RMSNorm
    return cls(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class AttentionConfig(Protocol):
    """What :class:`Qwen3Attention` reads from a config (``Qwen3Config``, ``HeteroConfig``, ...)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def q_size(self) -> int: ...


class MlpConfig(Protocol):
    """What :class:`Qwen3MLP` reads from a config."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


class Qwen3Attention(nn.Module):
    """``o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))``, a partial sum over the head group.

    Heads are sharded over ``Topology.attn_heads`` (attention TP without CP). In a context-parallel
    batch the rows are this rank's tokens: their keys and values are gathered over the CP group
    through the batch's token mapping, and each rank attends for its own query rows.
    """

    def __init__(
        self,
        config: AttentionConfig,
        group: GroupInfo,
        rotary_emb: RotaryEmbedding,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        self.scaling = hd**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            hd,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
            group,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, config.attention_bias, group, reduce_results=False, dtype=dtype
        )
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = rotary_emb

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any
    ) -> torch.Tensor:
        t, hd = hidden_states.shape[0], self.head_dim
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # explicit: t may be 0
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = self.q_norm(q.reshape(t, heads, hd))
        k = self.k_norm(k.reshape(t, kv_heads, hd))
        q, k = self.rotary_emb(positions, q, k)
        v = v.reshape(t, kv_heads, hd)
        cp = context_parallel_split(forward_batch)
        if cp is not None:
            kv = cp.gather(torch.cat((k, v), dim=-1))  # one gather: every token's keys and values
            k, v = kv.split(hd, dim=-1)
            out = causal_attention(q, k, v, None, self.scaling, mask=cp.causal_mask())
        else:
            out = causal_attention(q, k, v, getattr(forward_batch, "seq_lens", None), self.scaling)
        return self.o_proj(out.reshape(t, heads * hd))


class Qwen3MLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``down_proj`` honours the exit scope's flags."""

    def __init__(self, config: MlpConfig, group: GroupInfo, *, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        n = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [n, n], False, group, dtype=dtype)
        self.down_proj = RowParallelLinear(
            n, config.hidden_size, False, group, reduce_results=True, dtype=dtype
        )

    def forward(self, x: torch.Tensor, forward_batch: Any = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Qwen3Config,
        layer_id: int,
        context: BoundaryContext,
        *,
        rotary_emb: Optional[RotaryEmbedding] = None,
        dtype: Optional[torch.dtype] = None,
        residual: Optional[ResidualSemantics] = None,
    ) -> None:
        super().__init__()
        self._build(config, layer_id, context, rotary_emb=rotary_emb, dtype=dtype, residual=residual)

    def _build(
        self,
        config: Qwen3Config,
        layer_id: int,
        context: BoundaryContext,
        *,
        rotary_emb: Optional[RotaryEmbedding],
        dtype: Optional[torch.dtype],
        residual: Optional[ResidualSemantics],
        options: Optional[dict[str, Any]] = None,
    ) -> None:
        """The layer's modules and stages; a subclass (the MoE layer) swaps only the FFN block
        (``_make_ffn``) and its declaration (``_ffn_declaration``). ``options``: given to both stages."""
        self.layer_id = layer_id
        if residual is None:
            residual = context.semantics("plain")
        if rotary_emb is None:
            rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        options = options or {}
        topology = context.topology
        self.self_attn = Qwen3Attention(config, head_group(topology), rotary_emb, dtype=dtype)
        self.mlp = self._make_ffn(config, layer_id, topology, dtype)
        self.input_layernorm = stack_norm(config, dtype)
        self.post_attention_layernorm = stack_norm(config, dtype)
        attn_res = residual_part(residual, "stage", config.hidden_size, dtype=dtype)
        ffn_res = residual_part(residual, "stage", config.hidden_size, dtype=dtype)
        if attn_res.params is not None:
            self.attn_residual = attn_res.params
        if ffn_res.params is not None:
            self.ffn_residual = ffn_res.params
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(update=attn_res.update, read=attn_res.read), self.input_layernorm, options),
            (self._ffn_declaration(config, layer_id, ffn_res.update, ffn_res.read),
             self.post_attention_layernorm, options),
            # The previous layer's FFN is declared as that layer declares it (same scheme, same
            # update, same sparsity), so both neighbours describe the same edge.
            previous=self._ffn_declaration(config, layer_id - 1, ffn_res.update) if layer_id != 0 else None,
            terminal=layer_id == config.num_hidden_layers - 1,
            context=context,
        )

    def _make_ffn(self, config: Qwen3Config, layer_id: int, topology: Topology,
                  dtype: Optional[torch.dtype]) -> nn.Module:
        return Qwen3MLP(config, topology.tp, dtype=dtype)

    @staticmethod
    def _ffn_declaration(config: Qwen3Config, layer_id: int, update: Any = None, read: Any = None) -> Any:
        return declare_ffn(update=update, read=read)

    def forward(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        # A CP rank without tokens still joins the key/value gather of the others.
        if hidden_states.shape[0] != 0 or context_parallel_split(forward_batch) is not None:
            hidden_states = self.self_attn(
                positions=positions,
                hidden_states=hidden_states,
                forward_batch=forward_batch,
            )
        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)

        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)
        with self.ffn_boundary.exit(forward_batch) as output:
            hidden_states = self.mlp(hidden_states)
        hidden_states = output.finish(hidden_states)
        return hidden_states

    def forward_stages(self, positions: torch.Tensor, hidden_states: Any, forward_batch: Any) -> Any:
        """The layer as the two-batch-overlap schedule runs it (a generator returning the layer
        output): it yields where the other microbatch may run while this one's sum is owed.

        The FFN is operation-scheduled: no exit scope, so it reduces its own output, and
        ``postprocess()`` hands that output on without owed work.
        """
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn(
                positions=positions,
                hidden_states=hidden_states,
                forward_batch=forward_batch,
            )
        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)
        yield "attn"
        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)
        yield "ffn_input"
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.ffn_boundary.postprocess(hidden_states, forward_batch)
        yield "ffn"
        return hidden_states


@runtime_checkable
class PipelineEntryLayer(Protocol):
    """A decoder layer whose first stage is ``attn_boundary``: a non-first pipeline stage
    rebuilds the batch through its first layer's ``attn_boundary.from_pp()``."""

    attn_boundary: StageBoundary


class Qwen3Model(nn.Module):
    # Layers that run as two microbatches under two-batch overlap: every layer of a dense stack
    # (see layer_boundary._adapters.tbo.plan_overlap).
    tbo_overlap: Optional[str] = "all"
    # The service a backend's install_*_fusion(model, terminal_finalize=True) returned: the final
    # norm then fuses a terminal MoE finalize handoff (residual_batch.norm(handoff_norm=...)).
    handoff_norm: Any = None
    embed_tokens: Optional[VocabParallelEmbedding]  # on the first pipeline stage only
    norm: Optional[RMSNorm]  # on the last pipeline stage only
    layers: nn.ModuleList

    def __init__(
        self,
        config: Qwen3Config,
        context: BoundaryContext,
        *,
        dtype: Optional[torch.dtype] = None,
        residual: Optional[ResidualSemantics] = None,
    ) -> None:
        super().__init__()
        if residual is None:
            residual = context.semantics("plain")
        self._build(config, context, residual, dtype, lambda i, rotary_emb: Qwen3DecoderLayer(
            config, i, context, rotary_emb=rotary_emb, dtype=dtype, residual=residual))

    def _build(
        self,
        config: Qwen3Config,
        context: BoundaryContext,
        residual: ResidualSemantics,
        dtype: Optional[torch.dtype],
        make_layer: Callable[[int, RotaryEmbedding], nn.Module],
    ) -> None:
        """Everything but the layers, which ``make_layer(layer_id, rotary_emb)`` builds: the
        decoders that differ only in their layers (MoE, LongCat) share the rest and the forward.
        ``tbo_overlap = None``: layers without a two-batch-overlap schedule (no plan)."""
        self.config = config
        topology = self.topology = context.topology
        pp = topology.pp
        # A pipeline stage holds layers [start_layer, end_layer) (local indices from 0), the
        # embedding on the first stage and the final norm on the last.
        self.pp_first, self.pp_last = pp.rank == 0, pp.rank == pp.size - 1
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp.rank, pp.size)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, head_group(topology), dtype=dtype)
            if self.pp_first else None
        )
        # One cos/sin table shared by every layer.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            make_layer(i, self.rotary_emb) for i in range(self.start_layer, self.end_layer)
        )
        self.norm = None
        if self.pp_last:
            self.norm = stack_norm(config, dtype)
            final = residual_part(residual, "exit", config.hidden_size, dtype=dtype)
            if final.params is not None:
                self.final_residual = final.params
            residual_batch.bind_final_norm(self.norm, context=context, read=final.read)
        self.tbo_plan = plan_overlap(self.layers, overlap=self.tbo_overlap) if self.tbo_overlap else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: Any,
        pp_proxy_tensors: Optional[dict[str, torch.Tensor]] = None,
    ) -> Union[torch.Tensor, dict[str, torch.Tensor]]:
        """The final-normed hidden states on the last pipeline stage; elsewhere the tensors
        ``to_pp()`` hands to the next stage. A non-first stage takes the previous stage's tensors."""
        if self.pp_first:
            assert self.embed_tokens is not None  # built on the first pipeline stage
            residual_batch.start(forward_batch)
            hidden_states = self.embed_tokens(input_ids)
        else:
            first = self.layers[0]
            if not isinstance(first, PipelineEntryLayer):
                raise TypeError(f"{type(first).__name__} has no stage boundaries to receive the "
                                "previous pipeline stage's tensors")
            if pp_proxy_tensors is None:
                raise ValueError("a non-first pipeline stage needs pp_proxy_tensors, the tensors "
                                 "the previous stage sent")
            hidden_states = first.attn_boundary.from_pp(pp_proxy_tensors, forward_batch)
        split = getattr(forward_batch, "tbo_split", None)
        if split is not None:
            if self.tbo_plan is None:
                raise ValueError(f"{type(self).__name__} has no two-batch-overlap schedule "
                                 "(tbo_overlap = None); run it without forward_batch.tbo_split")
            hidden_states = model_forward_stages(self.layers, positions, hidden_states, forward_batch,
                                                 split=split, plan=self.tbo_plan)
        else:
            for layer in self.layers:
                hidden_states = layer(positions, hidden_states, forward_batch)
        if not self.pp_last:
            return residual_batch.to_pp(hidden_states, forward_batch)
        assert self.norm is not None  # built on the last pipeline stage
        hidden_states = residual_batch.norm(hidden_states, forward_batch, self.norm, skip_empty=True,
                                            handoff_norm=self.handoff_norm)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> logits [T, vocab]`` (FP32).

    ``residual``: the residual scheme's name, looked up with ``context.semantics(residual)``
    (``"plain"`` is built in; a plugin's scheme such as ``"mhc"`` needs a context built with
    ``BoundaryContext.discover()``), or a ``ResidualSemantics`` object.
    """

    # HF checkpoint name fragment -> our fused parameter and the shard it fills.
    stacked_params_mapping: tuple[tuple[str, str, Any], ...] = (
        (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
        (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
        (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
    )

    def __init__(
        self,
        config: Qwen3Config,
        topology: Optional[Topology] = None,
        *,
        context: Optional[BoundaryContext] = None,
        dtype: torch.dtype = torch.float32,
        residual: Union[str, ResidualSemantics] = "plain",
    ) -> None:
        super().__init__()
        self._build(config, topology, context, residual, dtype=dtype,
                    make_model=lambda context, residual: Qwen3Model(config, context, dtype=dtype,
                                                                    residual=residual))

    def _build(
        self,
        config: Qwen3Config,
        topology: Optional[Topology],
        context: Optional[BoundaryContext],
        residual: Union[str, ResidualSemantics],
        *,
        dtype: torch.dtype,
        make_model: Callable[[BoundaryContext, ResidualSemantics], Qwen3Model],
        architecture: Optional[str] = None,
    ) -> None:
        """The context, residual scheme, LM head and tied weights around the stack that
        ``make_model(context, residual)`` builds (the part the MoE and LongCat decoders change).
        ``architecture``: given to a context built here."""
        owns_context = context is None
        if context is None:
            context = BoundaryContext(topology, architecture=architecture)
        elif topology is not None and topology is not context.topology:
            raise ValueError("give either topology= or context= (which has its own topology), not both")
        topology = context.topology
        self.config = config
        self.topology = topology
        self.context = context
        if not isinstance(residual, str) and not callable(getattr(residual, "stage", None)):
            raise TypeError(f"residual must be a scheme's name (for example 'plain' or 'mhc') or a "
                            f"ResidualSemantics object, got {residual!r}")
        self.residual = context.semantics(residual) if isinstance(residual, str) else residual
        if topology.pp.size > 1 and getattr(self.residual, "name", None) != "plain":
            raise ValueError(
                f"residual scheme {getattr(self.residual, 'name', self.residual)!r} is not a plain "
                "add; nonlinear updates are not supported across pipeline stages yet (use pp=1)"
            )
        self.model = make_model(context, self.residual)
        # The LM head lives on the last pipeline stage only.
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, head_group(topology), dtype=dtype)
                        if self.model.pp_last else None)
        if config.tie_word_embeddings and self.model.pp_first and self.model.pp_last:
            # one stage holds both the embedding and the LM head
            assert self.lm_head is not None and self.model.embed_tokens is not None
            self.lm_head.weight = self.model.embed_tokens.weight
        self._residual_prefixes = tuple(name + "." for name, _ in self.residual_modules())
        if owns_context:
            context.freeze()  # construction is over; a caller's own context is theirs to freeze

    def ignored_checkpoint_name(self, name: str) -> bool:
        """Checkpoint tensors that carry nothing for this model (rope tables, tied copies)."""
        if "rotary_emb.inv_freq" in name:
            return True
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def local_checkpoint_name(self, name: str) -> Optional[str]:
        """This pipeline stage's name for a checkpoint tensor, or None for another stage's."""
        m = self.model
        if self.topology.pp.size == 1:
            return name
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if not m.start_layer <= int(i) < m.end_layer:
                return None
            return f"model.layers.{int(i) - m.start_layer}.{rest}"
        if name.startswith("model.embed_tokens."):
            if m.embed_tokens is not None:
                return name
            # Tied embeddings: the last stage's LM head loads the embedding's tensor.
            return "lm_head.weight" if self.config.tie_word_embeddings and self.lm_head is not None else None
        if name.startswith("model.norm.") or name.startswith("model.final_residual."):
            return name if m.pp_last else None
        if name.startswith("lm_head."):
            return name if self.lm_head is not None else None
        return name

    def residual_modules(self) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of each parameter module the residual scheme owns (plain: none)."""
        return [(n, m) for n, m in self.named_modules() if n.rpartition(".")[2] in RESIDUAL_MODULES]

    def optional_parameter(self, name: str) -> bool:
        """Parameters a checkpoint may lack: the residual scheme's (HF checkpoints have none;
        the scheme's init fills them). A checkpoint that has them loads them."""
        return name.startswith(self._residual_prefixes)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any
    ) -> Optional[torch.Tensor]:
        """Logits on the last pipeline stage; ``None`` on the others (they send their output on).

        A non-first stage first receives the previous stage's tensors over ``topology.pp``.
        """
        pp = self.topology.pp
        tensors = recv_tensors(pp, device=input_ids.device) if pp.rank > 0 else None
        hidden_states = self.model(input_ids, positions, forward_batch, tensors)
        if pp.rank < pp.size - 1:
            send_tensors(hidden_states, pp)
            return None
        assert self.lm_head is not None  # built on the last pipeline stage
        return self.lm_head(hidden_states).float()

    def load_weights(self, folder: str | os.PathLike[str]) -> None:
        """Load a HF safetensors folder (single file or sharded with an index) into this rank's shards."""
        load_checkpoint(self, folder)

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
    ) -> "Qwen3ForCausalLM":
        model = cls(Qwen3Config.from_folder(folder), topology, context=context, dtype=dtype, residual=residual)
        model.load_weights(folder)
        if device is not None:
            model.to(device)
        return model.eval().requires_grad_(False)
