"""The collective the reference models' tensor-parallel layers run themselves, as an engine's
own parallel layers do: the all-reduce of a row-parallel output.

It takes a :class:`~layer_boundary.GroupInfo`; on a group of one it starts nothing. It runs under
``no_grad``: collectives are not differentiable, and a caller that forgot inference mode must not
trip autograd's view checks inside gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layer_boundary import GroupInfo

__all__ = ["all_reduce"]


@torch.no_grad()
def all_reduce(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.group)
    return x
