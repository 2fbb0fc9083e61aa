"""Spawned workers: quantized stage inputs moving between ranks (FP8 codes + per-token scales)."""

from __future__ import annotations

from typing import Any

import torch

from layer_boundary._kernels.reference import rmsnorm_fp8_ref
from layer_boundary._dp import DpRows
from layer_boundary._rows import move_input

import parallel_cases


def gather(rank: int, world: int) -> dict[str, Any]:
    """DP groups of uneven (and empty) sizes gather their quantized inputs: the result holds every
    group's codes and scales in DP-rank order, the same as quantizing all rows on one rank."""
    topo = parallel_cases.topology(world, world)
    counts = (3, 0, 5, 1)[:world]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(sum(counts), 16, generator=g)
    weight = torch.rand(16, generator=g) + 0.5
    want = rmsnorm_fp8_ref(full, weight, 1e-6)
    lo = sum(counts[:rank])
    mine = rmsnorm_fp8_ref(full[lo : lo + counts[rank]], weight, 1e-6)
    got = move_input(DpRows(counts, topo).gather, mine)
    return {
        "data": torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)),
        "scale": torch.equal(got.scale, want.scale),
        "dtype": str(got.data.dtype),
    }
