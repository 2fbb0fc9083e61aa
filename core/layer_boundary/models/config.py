"""The Qwen3 configuration, read from a Hugging Face ``config.json`` without transformers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .layers import rope_type_of

__all__ = ["Qwen3Config", "small_random_config"]

_DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta when a config names none


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    """Shapes and constants of a dense Qwen3 decoder (the fields of HF ``Qwen3Config`` we use)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    model_type: str = "qwen3"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen3Config.{name}={v!r} must be a positive integer; fix config.json")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; each kv head serves a whole group of "
                "query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"Qwen3Config.{name}={v!r} must be a positive number; fix config.json")
        if self.model_type != "qwen3":
            raise ValueError(
                f"model_type={self.model_type!r} is not a dense Qwen3 checkpoint; "
                "this reference model loads model_type 'qwen3' only"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Qwen3Config":
        """Build from a parsed HF ``config.json`` (transformers 4 or 5 layout).

        ``rope_theta`` is read from ``rope_parameters`` (transformers 5) or the top level
        (transformers 4). Features this model does not implement are rejected, never ignored:
        rope scaling, sliding-window layers and activations other than SiLU.
        """
        model_type = d.get("model_type", "qwen3")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"config.json lacks {missing}; a Qwen3 config names every one of them")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; the Qwen3 MLP is SiLU-gated ('silu')")
        if d.get("use_sliding_window", False):
            raise ValueError(
                "use_sliding_window=true is not supported by this reference model; "
                "set it to false (Qwen3 checkpoints ship with it off)"
            )
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"layer_types {sorted(set(layer_types))} include a non full-attention layer; "
                "only 'full_attention' is supported"
            )
        rope_theta = _read_rope_theta(d)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        # transformers' Qwen3Config defaults head_dim to 128 (not hidden/heads) when config.json
        # omits it; the same checkpoint must give the same model here.
        head_dim = d.get("head_dim") or 128
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            attention_bias=bool(d.get("attention_bias", False)),
            model_type=model_type,
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "Qwen3Config":
        path = os.path.join(os.fspath(folder), "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no config.json in {os.fspath(folder)!r}; pass a Hugging Face checkpoint folder"
            )
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """A transformers-5 style ``config.json`` dict for this config."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        del d["rope_theta"]
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["hidden_act"] = "silu"
        d["architectures"] = ["Qwen3ForCausalLM"]
        return d


def _read_rope_theta(d: Mapping[str, Any]) -> float:
    rope = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    for name, value in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"{name}={value!r} must be a JSON object or null")
        if "full_attention" in value and isinstance(value["full_attention"], Mapping):
            raise ValueError(
                f"{name} is given per layer type; only one rope for all layers is supported"
            )
        kind = rope_type_of(value)
        if kind not in (None, "default"):
            raise ValueError(
                f"{name} has rope_type {kind!r}; only unscaled 'default' rope is supported. "
                "Use a checkpoint without rope scaling"
            )
    theta = None
    if rope is not None:
        theta = rope.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
    return theta


def small_random_config() -> Qwen3Config:
    """The embedded default model: tiny, GQA, tied embeddings; runs in milliseconds on CPU."""
    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
