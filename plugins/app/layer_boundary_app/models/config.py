"""The Qwen3 configuration, read from a Hugging Face ``config.json`` without transformers."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping, TypeVar, Union

from .layers import rope_type_of

__all__ = [
    "Qwen3Config",
    "Qwen3MoeConfig",
    "SUPPORTED_MODEL_TYPES",
    "load_config",
    "small_random_config",
    "small_random_moe_config",
]

_DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta when a config names none


_Config = TypeVar("_Config", bound="Qwen3Config")  # the class a classmethod constructor builds
_MoeConfig = TypeVar("_MoeConfig", bound="Qwen3MoeConfig")


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
    # Not a HF Qwen3 field: True builds zero-centered (Gemma, weight + 1) RMSNorms as Qwen3-Next
    # and Qwen3.5 use, which a fused finalize at the final norm needs (``handoff_norm``).
    zero_centered_norms: bool = False

    MODEL_TYPE: ClassVar[str] = "qwen3"
    ARCHITECTURE: ClassVar[str] = "Qwen3ForCausalLM"
    _what: ClassVar[str] = "dense Qwen3"

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
        if self.model_type != self.MODEL_TYPE:
            raise ValueError(
                f"model_type={self.model_type!r} is not a {self._what} checkpoint; "
                f"{type(self).__name__} reads model_type {self.MODEL_TYPE!r} only (load_config() "
                f"picks the config class from model_type: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )


    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls: type[_Config], d: Mapping[str, Any]) -> _Config:
        """Build from a parsed HF ``config.json`` (transformers 4 or 5 layout).

        ``rope_theta`` is read from ``rope_parameters`` (transformers 5) or the top level
        (transformers 4). Features this model does not implement are rejected, never ignored:
        rope scaling, sliding-window layers and activations other than SiLU.
        """
        return cls(**_common_fields(d, cls.MODEL_TYPE))

    @classmethod
    def from_folder(cls: type[_Config], folder: str | os.PathLike[str]) -> _Config:
        path = os.path.join(os.fspath(folder), "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no config.json in {os.fspath(folder)!r}; pass a Hugging Face checkpoint folder"
            )
        return cls._from_file(path, _read_config(path))

    @classmethod
    def _from_file(cls: type[_Config], path: str, d: Mapping[str, Any]) -> _Config:
        config = cls.from_dict(d)
        _check_architectures(path, d, cls)
        return config

    def to_dict(self) -> dict[str, Any]:
        """A transformers-5 style ``config.json`` dict for this config."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        del d["rope_theta"]
        del d["zero_centered_norms"]  # ours: transformers' Qwen3 has plain RMSNorms
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["hidden_act"] = "silu"
        d["architectures"] = [self.ARCHITECTURE]
        return d


def _common_fields(d: Mapping[str, Any], default_model_type: str) -> dict[str, Any]:
    """The fields dense Qwen3 and Qwen3-MoE share, read and checked from a HF config dict."""
    model_type = d.get("model_type", default_model_type)
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
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or len(layer_types) != d["num_hidden_layers"]):
        raise ValueError(f"layer_types must list one type for each of the num_hidden_layers="
                         f"{d['num_hidden_layers']!r} layers; fix config.json")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"layer_types {sorted(set(layer_types))} include a non full-attention layer; "
            "only 'full_attention' is supported"
        )
    rope_theta = _read_rope_theta(d)
    heads = d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads  # absent or null: one kv head a query head
    # transformers' Qwen3Config defaults head_dim to 128 (not hidden/heads) when config.json
    # omits it; the same checkpoint must give the same model here.
    head_dim = d.get("head_dim")
    head_dim = 128 if head_dim is None else head_dim
    # Numbers and flags are passed as given: the config's own checks name a wrong type or value
    # (a str "1e-6" or a null was once converted or a traceback).
    eps = d.get("rms_norm_eps", 1e-6)
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps) if _is_number(eps) else eps,
        rope_theta=float(rope_theta) if _is_number(rope_theta) else rope_theta,
        tie_word_embeddings=_flag(d, "tie_word_embeddings"),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        attention_bias=_flag(d, "attention_bias"),
        model_type=model_type,
    )


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: the dense Qwen3 fields plus the sparse FFN's (HF ``Qwen3MoeConfig``).

    Layer ``i`` is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
    == 0`` (and ``num_experts > 0``); other layers run the dense MLP of ``intermediate_size``.
    The router is a softmax over ``num_experts`` logits, the top ``num_experts_per_tok`` kept and,
    with ``norm_topk_prob``, renormalized to sum to one. Qwen3-MoE has no shared expert.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    model_type: str = "qwen3_moe"

    MODEL_TYPE: ClassVar[str] = "qwen3_moe"
    ARCHITECTURE: ClassVar[str] = "Qwen3MoeForCausalLM"
    _what: ClassVar[str] = "Qwen3-MoE"

    def __post_init__(self) -> None:
        Qwen3Config.__post_init__(self)
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_experts" else 1):
                raise ValueError(f"Qwen3MoeConfig.{name}={v!r} must be a positive integer; fix config.json")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}; "
                "a token cannot be routed to more experts than there are"
            )
        if any(isinstance(i, bool) or not isinstance(i, int) for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)!r} must list layer indices")

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` runs the MoE block (HF ``Qwen3MoeDecoderLayer``'s rule)."""
        if not 0 <= layer_id < self.num_hidden_layers:
            return False  # past either end of the stack: no FFN there at all
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls: type[_MoeConfig], d: Mapping[str, Any]) -> _MoeConfig:
        """Build from a parsed HF ``config.json``; the expert count is ``num_experts``
        (transformers 4, hub checkpoints) or ``num_local_experts`` (transformers 5 saves)."""
        kw = _common_fields(d, cls.MODEL_TYPE)
        experts = d.get("num_experts", d.get("num_local_experts"))
        if experts is None:
            raise ValueError("config.json names neither num_experts nor num_local_experts; "
                             "a Qwen3-MoE config gives the expert count")
        missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks {missing}; a Qwen3-MoE config names every one of them")
        if d.get("shared_expert_intermediate_size"):
            raise ValueError(
                "config.json declares a shared expert (shared_expert_intermediate_size), which "
                "Qwen3-MoE does not have; this is another architecture's checkpoint"
            )
        return cls(
            **kw,
            num_experts=experts,
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=_flag(d, "norm_topk_prob"),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        )

    def to_dict(self) -> dict[str, Any]:
        d = Qwen3Config.to_dict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d


# model_type -> config class; the model classes are chosen from the config (models/runner.py).
SUPPORTED_MODEL_TYPES: dict[str, type[Qwen3Config]] = {
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
}


def load_config(folder: str | os.PathLike[str]) -> Union[Qwen3Config, Qwen3MoeConfig]:
    """The config of a HF checkpoint folder, its class picked by ``config.json``'s ``model_type``."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no config.json in {os.fspath(folder)!r}; pass a Hugging Face checkpoint folder"
        )
    d = _read_config(path)
    model_type = d.get("model_type")
    cls = SUPPORTED_MODEL_TYPES.get(model_type)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; the reference models load "
            f"model_type {', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}"
        )
    return cls._from_file(path, d)


_WARNED: set[tuple[str, str]] = set()


def _check_architectures(path: str, d: Mapping[str, Any], cls: type["Qwen3Config"]) -> None:
    """Warn (once a file) when config.json's ``architectures`` does not name the class loaded:
    transformers too picks the class from model_type, so a different head (a classifier, say) or a
    mislabelled conversion would load here as a causal LM without a word."""
    arch = d.get("architectures")
    key = (path, cls.ARCHITECTURE)
    if isinstance(arch, list) and arch and cls.ARCHITECTURE not in arch and key not in _WARNED:
        _WARNED.add(key)
        logging.getLogger(__name__).warning(
            "%s: architectures %s does not name %s, which model_type %r loads here; check that the "
            "checkpoint is a causal LM of that model type", path, arch, cls.ARCHITECTURE, d.get("model_type"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_config(path: str) -> dict[str, Any]:
    """The JSON object in ``path``, or a ValueError that names the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON in UTF-8 ({e}); fix or replace the file") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object of config fields")
    return d


def _flag(d: Mapping[str, Any], name: str) -> bool:
    """A true/false field (absent or null: false); a string such as "false" is refused, not read as
    true."""
    v = d.get(name)
    if v is None or isinstance(v, bool):
        return bool(v)
    raise ValueError(f"{name}={v!r} must be true or false (a JSON boolean); fix config.json")


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


def small_random_moe_config() -> Qwen3MoeConfig:
    """The embedded MoE model: 8 experts, top 2 renormalized, a dense MLP on layer 1 so that
    both neighbour kinds (sparse after dense and dense after sparse) are built."""
    base = small_random_config()
    kw = {f.name: getattr(base, f.name) for f in fields(base) if f.name != "model_type"}
    return Qwen3MoeConfig(
        **kw,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(1,),
    )
