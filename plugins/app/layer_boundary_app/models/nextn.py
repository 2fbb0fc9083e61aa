"""A NextN / multi-token-prediction (MTP) draft on the reference Qwen3.

A draft step predicts one token further from the target's hidden state ``h`` of each row and the
embedding of the row's next token::

    x = eh_proj([enorm(embed(ids)), hnorm(h)])        [T, 2H] -> [T, H], replicated
    r = decoder layers(x)                              their own residual stream
    logits = lm_head(norm(r))                          embedding and head shared with the target

The draft is its own layer stack, so its layers reuse the target's decoder class with the
draft's layer count: the first enters with ``previous=None`` and the last is terminal, exactly as
``terminal=layer_id == (1 if is_nextn else config.num_hidden_layers) - 1`` reads in the spec.
It leaves the stack through an internal fold and ``take_output()`` (the MTP exit) rather than
``residual_batch.norm()``: its head norm is its own module, applied after the stream is released.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from layer_boundary import BoundaryContext, RMSNorm
from layer_boundary.residual import batch as residual_batch

from .config import Qwen3Config
from .layers import RotaryEmbedding
from .loader import load_tensors
from .qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

__all__ = ["Qwen3NextN", "Qwen3NextNForCausalLM", "nextn_random_state_dict", "init_random_nextn_weights"]


class Qwen3NextN(nn.Module):
    """``forward(input_embeds [T, H], target_hidden [T, H], positions, forward_batch) -> [T, H]``:
    the draft's normalized hidden states on the rows the model gave (this DP group's)."""

    stacked_params_mapping = Qwen3ForCausalLM.stacked_params_mapping

    def __init__(self, config: Qwen3Config, context: BoundaryContext, *, num_layers: int = 1,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"a NextN draft needs at least one layer, got num_layers={num_layers}")
        # The draft's own layer count decides which of its layers is terminal.
        self.config = dataclasses.replace(config, num_hidden_layers=num_layers)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(self.config, i, context, rotary_emb=self.rotary_emb, dtype=dtype)
            for i in range(num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                forward_batch: Any) -> torch.Tensor:
        if input_embeds.shape != target_hidden.shape:
            raise ValueError(
                f"the draft takes one target hidden state per input row: embeddings "
                f"{tuple(input_embeds.shape)}, target hidden states {tuple(target_hidden.shape)}"
            )
        residual_batch.start(forward_batch)  # the draft's own stack, not the target's stream
        fused = torch.cat([self.enorm(input_embeds), self.hnorm(target_hidden)], dim=-1)
        hidden_states: Any = self.eh_proj(fused)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, forward_batch)
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        hidden_states = residual_batch.take_output(hidden_states, forward_batch)
        return self.norm(hidden_states)


class Qwen3NextNForCausalLM(nn.Module):
    """A draft beside ``target``: ``forward(input_ids, positions, target_hidden, forward_batch)``
    -> FP32 logits ``[T, vocab]``; the embedding and LM head are the target's (not parameters of
    the draft). ``context``: the draft's own (a separate draft resolves its own reduction policy);
    by default a plain context on the target's topology."""

    def __init__(self, target: Qwen3ForCausalLM, *, context: Optional[BoundaryContext] = None,
                 num_layers: int = 1, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        topology = target.topology
        if topology.pp.size > 1:
            raise ValueError(
                "the NextN draft runs where the target's embedding and LM head both live; with "
                f"pp={topology.pp.size} they are on different pipeline stages (use pp=1)"
            )
        owns_context = context is None
        if context is None:
            context = BoundaryContext(topology)
        self.topology = topology
        self.config = target.config
        self.model = Qwen3NextN(target.config, context, num_layers=num_layers, dtype=dtype)
        # Shared with the target, which owns (and loads) them: kept out of this module's parameters.
        embed, head = target.model.embed_tokens, target.lm_head
        assert embed is not None and head is not None  # pp=1 (checked above): one stage holds both
        self._shared = (embed, head)
        if owns_context:
            context.freeze()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                forward_batch: Any) -> torch.Tensor:
        embed, head = self._shared
        hidden_states = self.model(embed(input_ids), target_hidden, positions, forward_batch)
        return head(hidden_states).float()


def nextn_random_state_dict(config: Qwen3Config, *, num_layers: int = 1,
                            seed: int = 0) -> dict[str, torch.Tensor]:
    """Full FP32 tensors under the draft's own names (``layers.{i}.*`` as Qwen3 names them)."""
    from .random_init import random_state_dict

    draft = dataclasses.replace(config, num_hidden_layers=num_layers, tie_word_embeddings=True)
    sd = {name[len("model."):]: t for name, t in random_state_dict(draft, seed=seed).items()
          if name.startswith("model.layers.")}
    g = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    sd["enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    sd["hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    sd["eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    sd["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    return sd


def init_random_nextn_weights(draft: Qwen3NextNForCausalLM, *, seed: int = 0) -> None:
    """Fill a draft (any topology) with this rank's slice of ``nextn_random_state_dict(seed)``."""
    model = draft.model
    tensors = nextn_random_state_dict(model.config, num_layers=len(model.layers), seed=seed)
    load_tensors(model, tensors.items(), source=f"random draft weights (seed {seed})")
