"""Seeded random weights for a Qwen3 config, identical on every rank.

The full, HF-named tensors are drawn from one CPU generator and loaded through the same weight
loaders as a checkpoint, so rank ``r`` of ``R`` holds exactly its slice of the single-rank model.
Parameters a residual scheme owns (``model.residual_modules()``, not in HF checkpoints) are drawn
by each module's ``init_random(generator)`` from a second CPU generator, in module order.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Qwen3Config
from .loader import load_tensors

__all__ = ["random_state_dict", "init_random_weights"]

_RESIDUAL_STREAM = 0x5EED  # offsets the residual scheme's generator from the weights' one


def random_state_dict(config: Qwen3Config, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full FP32 tensors under Hugging Face names.

    Linear weights ~ N(0, 1/fan_in) so activations keep unit scale; norm weights ~ 1 + N(0, 0.1^2)
    so a norm that ignored its weight would show; the embedding ~ N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)
    c = config

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g)
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(c.hidden_size)
        sd[p + "self_attn.q_proj.weight"] = linear(c.q_size, c.hidden_size)
        sd[p + "self_attn.k_proj.weight"] = linear(c.kv_size, c.hidden_size)
        sd[p + "self_attn.v_proj.weight"] = linear(c.kv_size, c.hidden_size)
        sd[p + "self_attn.o_proj.weight"] = linear(c.hidden_size, c.q_size)
        if c.attention_bias:
            for name, n in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size), ("o", c.hidden_size)):
                sd[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n, generator=g)
        sd[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
        sd[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
        sd[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
        sd[p + "mlp.gate_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.up_proj.weight"] = linear(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.down_proj.weight"] = linear(c.hidden_size, c.intermediate_size)
    sd["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = linear(c.vocab_size, c.hidden_size)
    return sd


def init_random_weights(model: nn.Module, *, seed: int = 0) -> None:
    """Fill a Qwen3 model (any topology) with this rank's slice of ``random_state_dict(seed)``."""
    config = getattr(model, "config")
    load_tensors(model, random_state_dict(config, seed=seed).items(), source=f"random weights (seed {seed})")
    residual_modules: list[tuple[str, nn.Module]] = getattr(model, "residual_modules", lambda: [])()
    if residual_modules:
        g = torch.Generator().manual_seed(seed + _RESIDUAL_STREAM)
        for _, module in residual_modules:
            init = getattr(module, "init_random", None)
            if init is not None:
                init(g)
