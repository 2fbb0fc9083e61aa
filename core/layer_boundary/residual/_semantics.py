"""The plain residual scheme as a ``ResidualSemantics``: every stage adds and reads with RMSNorm."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._providers import StageResidual
from ._add_norm import ADD_NORM, PLAIN_ADD

__all__ = ["PlainResidual", "PLAIN_RESIDUAL"]


class PlainResidual:
    """``r' = r + y``; the read is the stage's own norm (fused add+RMSNorm where possible)."""

    name = "plain"

    def describe(self) -> str:
        return "plain: r' = r + y, add+RMSNorm reads"

    def stage(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual:
        return StageResidual(PLAIN_ADD, ADD_NORM, None)

    def exit(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual:
        return StageResidual(PLAIN_ADD, ADD_NORM, None)


PLAIN_RESIDUAL = PlainResidual()
