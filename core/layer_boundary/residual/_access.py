"""Completion and materialization of contributions (shared by boundaries and batch helpers)."""

from __future__ import annotations

import torch

from .. import _ops as ops
from .._contracts import OwedKind
from .._output import Contribution, HandoffOutput

__all__ = ["complete", "completed_copy", "check_shape"]


def complete(c: Contribution) -> torch.Tensor:
    """Run every owed step of ``c`` in order, exactly once, then its transform; return the value."""
    value = c.value
    if not c.owed and c.transform is None and isinstance(value, torch.Tensor):
        return value  # the common case: a complete output, nothing to run
    for owed in c.owed:
        if owed.kind is OwedKind.FINALIZE:
            assert isinstance(value, HandoffOutput)
            value = value.complete()
        else:
            assert isinstance(value, torch.Tensor) and owed.group is not None
            value = ops.all_reduce(value, owed.group)
    if isinstance(value, HandoffOutput):  # a handoff with no sum left still needs its finalize
        value = value.complete()
    if c.transform is not None:
        value = c.transform.fn(value)
    c.value, c.owed, c.transform = value, (), None
    return value


def completed_copy(c: Contribution) -> torch.Tensor:
    """The completed value computed on a copy; ``c`` and its owed work are left untouched."""
    assert isinstance(c.value, torch.Tensor), "callers refuse handoffs before copying"
    value = c.value.clone()
    for owed in c.owed:
        assert owed.kind is OwedKind.SUM and owed.group is not None
        value = ops.all_reduce(value, owed.group)
    if c.transform is not None:
        value = c.transform.fn(value)
    return value


def check_shape(what: str, value: torch.Tensor, like: torch.Tensor) -> None:
    if value.shape != like.shape:
        raise ValueError(
            f"{what} has shape {tuple(value.shape)} but the residual rows have shape "
            f"{tuple(like.shape)}; give one row per token of this rank's batch"
        )
