"""Collectives and token-row movement over torch.distributed.

Every function takes a :class:`~layer_boundary.topology.GroupInfo`; on a group of one it returns
its input untouched and starts nothing, which is what makes the single-rank model the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .topology import GroupInfo

__all__ = ["all_reduce", "all_gather_rows"]


def all_reduce(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.group)
    return x


def all_gather_rows(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Concatenate equal-shaped ``[T, ...]`` slices of every rank along dim 0, in group order."""
    if group.size == 1:
        return x
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group.group)
    return out
