"""Reference models built on the layer boundaries, and the tensor-parallel layers they use."""

from .config import Qwen3Config, Qwen3MoeConfig, load_config, small_random_config, small_random_moe_config
from .hetero import (
    HeteroConfig,
    HeteroForCausalLM,
    HeteroModel,
    LayerKind,
    hetero_state_dict,
    init_hetero_weights,
    parse_pattern,
)
from .loader import CheckpointMismatch, load_checkpoint, load_tensors
from .longcat import LongcatConfig, LongcatForCausalLM, init_random_longcat_weights, small_random_longcat_config
from .moe import DeferFinalize, SparseMoeBlock
from .qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from .qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeModel, init_random_moe_weights, random_moe_state_dict
from .qwen3_plain import plain_forward
from .random_init import init_random_weights, random_state_dict

__all__ = [
    "Qwen3Config",
    "Qwen3MoeConfig",
    "load_config",
    "small_random_config",
    "small_random_moe_config",
    "HeteroConfig",
    "HeteroForCausalLM",
    "HeteroModel",
    "LayerKind",
    "hetero_state_dict",
    "init_hetero_weights",
    "parse_pattern",
    "CheckpointMismatch",
    "load_checkpoint",
    "load_tensors",
    "LongcatConfig",
    "LongcatForCausalLM",
    "init_random_longcat_weights",
    "small_random_longcat_config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3Model",
    "DeferFinalize",
    "SparseMoeBlock",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
    "init_random_moe_weights",
    "random_moe_state_dict",
    "plain_forward",
    "init_random_weights",
    "random_state_dict",
]
