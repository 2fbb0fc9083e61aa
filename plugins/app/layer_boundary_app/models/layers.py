"""Tensor-parallel layers written the way an inference engine writes them.

Every layer takes the :class:`~layer_boundary._topology.GroupInfo` it is sharded over; a group of
one holds the whole tensor, so the same model code runs on one rank and on many. Each parameter
that is sharded carries a ``weight_loader(param, full_tensor[, shard_id])`` attribute that takes
the *full* checkpoint tensor and copies this rank's slice (the convention of vLLM and SGLang).

| Layer                      | weight of rank r of R                      | input     | output           |
| -------------------------- | ------------------------------------------ | --------- | ---------------- |
| ColumnParallelLinear       | rows [r*O/R, (r+1)*O/R) of [O, I]          | [T, I]    | [T, O/R]         |
| MergedColumnParallelLinear | that slice of each merged output, in order | [T, I]    | [T, sum(O_i)/R]  |
| QKVParallelLinear          | q heads / R; kv heads / R or replicated    | [T, I]    | [T, q + 2 kv]    |
| RowParallelLinear          | columns [r*I/R, (r+1)*I/R) of [O, I]       | [T, I/R]  | [T, O] summed    |
| VocabParallelEmbedding     | vocab rows [r*V', (r+1)*V'), V'=ceil(V/R)  | [T] ids   | [T, H] summed    |
| ParallelLMHead             | the embedding's vocab rows                 | [T, H]    | [T, V] gathered  |
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layer_boundary import get_forward, GroupInfo, Topology

from .comm import all_reduce

__all__ = [
    "all_gather_last_dim",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RotaryEmbedding",
    "default_weight_loader",
    "rope_type_of",
    "WeightLoader",
    "set_weight_loader",
    "head_group",
]

# ``weight_loader(param, full)`` or, for a fused parameter, ``weight_loader(param, full, shard_id)``
# (the shard id is a merged output's index or a QKV letter): the two conventions of vLLM and SGLang.
WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach ``loader`` as ``param.weight_loader``, the attribute the checkpoint loader looks up.
    A dynamic attribute that ``nn.Parameter`` does not declare, hence ``setattr``."""
    setattr(param, "weight_loader", loader)


def all_gather_last_dim(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Concatenate equal-shaped ``[..., D]`` slices of every rank along the last dim, in group order."""
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=-1)


def head_group(topology: Topology) -> GroupInfo:
    """``topology.attn_heads``, the group attention heads and the vocabulary are sharded over
    (attention TP without CP). ``Topology.__post_init__`` always sets it: ``None`` is only the
    constructor's default, meaning "attn_tp"."""
    heads = topology.attn_heads
    if heads is None:
        raise ValueError("Topology.attn_heads is unset; build the topology with Topology(...) or "
                         "Topology.from_sizes(), which set it")
    return heads


def local_head_counts(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """Query and kv heads per rank of an attention sharded over ``tp`` ranks (kv heads replicated
    when there are fewer than ranks); ``ValueError`` naming the fix for a layout that cannot be.
    Pure, so a launcher can check a layout before starting any rank."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}; "
            "grouped-query attention needs whole groups of query heads per kv head"
        )
    local_heads = _divide(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp:
        return local_heads, _divide(num_kv_heads, tp, "num_key_value_heads")
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {tp} is neither a divisor nor a multiple of "
            f"num_key_value_heads={num_kv_heads}; choose a TP size that is one or the other"
        )
    return local_heads, 1


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(
            f"{what}={n} is not divisible by the tensor-parallel size {d}; "
            f"choose a TP size that divides {n}"
        )
    return n // d


def _check_full(param: torch.Tensor, full: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(full.shape) != expected:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(full.shape)}, expected {expected}; "
            "the checkpoint does not match the model config"
        )


def _copy(param: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(src.to(dtype=param.dtype, device=param.device))


def _make_params(
    module: nn.Module, rows: int, cols: int, bias: bool, dtype: Optional[torch.dtype], loader: WeightLoader
) -> None:
    """Register ``weight [rows, cols]`` and optional ``bias [rows]``, both loaded by ``loader``."""
    weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype))
    set_weight_loader(weight, loader)
    module.weight = weight
    if bias:
        b = nn.Parameter(torch.empty(rows, dtype=dtype))
        set_weight_loader(b, loader)
        module.bias = b
    else:
        module.register_parameter("bias", None)


def default_weight_loader(param: torch.Tensor, full: torch.Tensor) -> None:
    """Load a replicated parameter: the whole checkpoint tensor on every rank."""
    _check_full(param, full, tuple(param.shape), "replicated parameter")
    _copy(param, full)


class ColumnParallelLinear(nn.Module):
    """``y = x W_r^T + b_r``: this rank's slice of the output features; no communication."""

    weight: nn.Parameter
    bias: Optional[nn.Parameter]  # registered as None without a bias

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        group: GroupInfo,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, group.size, "output_size")
        _make_params(self, self.output_size_per_partition, input_size, bias, dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, full: torch.Tensor) -> None:
        _check_full(param, full, (self.output_size, *param.shape[1:]), type(self).__name__)
        n = self.output_size_per_partition
        _copy(param, full.narrow(0, self.group.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out = f"{self.output_size_per_partition}/{self.output_size}"
        return f"in={self.input_size}, out={out}, tp={self.group.size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (``gate_up_proj``).

    The rank's output is ``[T, sum(output_sizes) / R]``: its slice of output 0, then of output 1, ...
    ``weight_loader(param, full, shard_id)`` loads output ``shard_id`` from its full tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        group: GroupInfo,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        sizes = tuple(int(s) for s in output_sizes)
        for s in sizes:
            _divide(s, group.size, "merged output size")
        super().__init__(input_size, sum(sizes), bias, group, dtype=dtype)
        self.output_sizes = sizes

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, full: torch.Tensor, shard_id: int
    ) -> None:
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} is outside the {len(self.output_sizes)} merged outputs")
        size = self.output_sizes[shard_id]
        _check_full(param, full, (size, *param.shape[1:]), f"{type(self).__name__}[{shard_id}]")
        n = size // self.group.size
        offset = sum(self.output_sizes[:shard_id]) // self.group.size
        _copy(param.narrow(0, offset, n), full.narrow(0, self.group.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, sharded by heads.

    Query heads split evenly over the group (``num_heads % R == 0``). Key/value heads split evenly
    when ``num_kv_heads >= R`` (``num_kv_heads % R == 0``); otherwise each kv head is replicated on
    ``R / num_kv_heads`` consecutive ranks (``R % num_kv_heads == 0``), so every rank holds exactly
    the kv head its query heads attend to.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        group: GroupInfo,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        tp = group.size
        local_heads, local_kv_heads = local_head_counts(num_heads, num_kv_heads, tp)
        # output_size counts replicated kv heads once per rank: [q + 2 kv] per rank, times R.
        per_rank = (local_heads + 2 * local_kv_heads) * head_dim
        super().__init__(hidden_size, per_rank * tp, bias, group, dtype=dtype)
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = local_heads
        self.num_kv_heads = local_kv_heads
        self.kv_replicas = max(tp // num_kv_heads, 1)  # ranks sharing one kv head
        self.q_size = local_heads * head_dim
        self.kv_size = local_kv_heads * head_dim

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, full: torch.Tensor, shard_id: str
    ) -> None:
        rank = self.group.rank
        hd = self.head_dim
        if shard_id == "q":
            total, offset, size = self.total_num_heads * hd, 0, self.q_size
            start = rank * self.q_size
        elif shard_id in ("k", "v"):
            total, size = self.total_num_kv_heads * hd, self.kv_size
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            start = (rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _check_full(param, full, (total, *param.shape[1:]), f"QKVParallelLinear[{shard_id}]")
        _copy(param.narrow(0, offset, size), full.narrow(0, start, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q + 2 kv] -> q [T, q], k [T, kv], v [T, kv]`` (views)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.input_size}, heads={self.num_heads}/{self.total_num_heads}, "
            f"kv_heads={self.num_kv_heads}/{self.total_num_kv_heads}, head_dim={self.head_dim}, "
            f"tp={self.group.size}"
        )


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T (+ b)``: input features sharded, output summed over the group.

    The sum is skipped, leaving a partial contribution for the boundary to complete, when
    ``reduce_results=False`` or an exit scope publishes ``fuse_mlp_allreduce`` or
    ``mlp_reduce_scatter``. The bias is added on group rank 0 only, before any sum, so the
    (possibly deferred) sum includes it exactly once.
    """

    weight: nn.Parameter
    bias: Optional[nn.Parameter]  # registered as None without a bias

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        group: GroupInfo,
        *,
        reduce_results: bool = True,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.input_size_per_partition = _divide(input_size, group.size, "input_size")
        _make_params(self, output_size, self.input_size_per_partition, bias, dtype, self.weight_loader)
        if self.bias is not None:  # the bias is replicated (added on rank 0 only), not sharded
            set_weight_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: torch.Tensor, full: torch.Tensor) -> None:
        _check_full(param, full, (self.output_size, self.input_size), type(self).__name__)
        n = self.input_size_per_partition
        _copy(param, full.narrow(1, self.group.rank * n, n))

    def skips_reduction(self) -> bool:
        """Whether this call leaves its sum to someone else (the flags are read per call)."""
        if not self.reduce_results:
            return True
        flags = get_forward()
        return flags.fuse_mlp_allreduce or flags.mlp_reduce_scatter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.group.rank == 0 else None
        y = F.linear(x, self.weight, bias)
        if self.group.size > 1 and not self.skips_reduction():
            y = all_reduce(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}/{self.input_size}, out={self.output_size}, "
            f"tp={self.group.size}, reduce_results={self.reduce_results}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary sharded: masked lookup of this rank's rows, then a sum.

    Rank ``r`` holds rows ``[r*V', min((r+1)*V', V))`` with ``V' = ceil(V / R)``; the shard is
    padded with zero rows to ``V'`` so every rank's weight has the same shape.
    """

    weight: nn.Parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: GroupInfo,
        *,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = math.ceil(num_embeddings / group.size)
        self.vocab_start = group.rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype))
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, full: torch.Tensor) -> None:
        _check_full(param, full, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        n = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param.zero_()
        _copy(param.narrow(0, 0, n), full.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.vocab_start}:{self.vocab_end}/{self.num_embeddings}, "
            f"dim={self.embedding_dim}, tp={self.group.size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """``logits = x W^T`` with the vocabulary sharded; every rank gets the full ``[T, V]``.

    Shares the embedding's shard layout so tied weights are the same parameter.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.group.size == 1:
            return logits
        return all_gather_last_dim(logits, self.group)[..., : self.num_embeddings]


_DEFAULT_ROPE_TYPES = (None, "default")


def rope_type_of(rope: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The ``rope_type`` of a HF ``rope_scaling``/``rope_parameters`` dict (legacy key ``type``)."""
    if not rope:
        return None
    return rope.get("rope_type", rope.get("type"))


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Hugging Face Llama/Qwen3 apply it.

    ``inv_freq_i = base^(-2i/d)``;  ``cos, sin = cos(p * inv_freq), sin(p * inv_freq)`` repeated
    over both halves;  ``x' = x cos + rotate_half(x) sin``. cos/sin are computed in FP32 and
    rounded to the query dtype before the rotation, as transformers and vLLM do, so a bf16 model
    rotates in bf16 exactly like the reference.

    Only the unscaled (``default``) rope is implemented; any other ``rope_type`` is rejected.
    """

    cos_cache: torch.Tensor  # buffers [max_position_embeddings, head_dim]
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().__init__()
        rope_type = rope_type_of(rope_scaling)
        if rope_type not in _DEFAULT_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (only unscaled 'default' rope is); "
                "use a checkpoint without rope scaling or add that rope type to RotaryEmbedding"
            )
        if head_dim % 2:
            raise ValueError(f"rotary head_dim={head_dim} must be even")
        self.head_dim = head_dim
        self.base = float(base)
        self.max_position_embeddings = max_position_embeddings
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, d]: both halves use the same angles
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, d]`` and ``k [T, Hk, d]`` at ``positions [T]``."""
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, max_position={self.max_position_embeddings}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
