"""The core's fusion providers and the shared contract of fused all-reduce + add + norm candidates.

Plugins' providers come first in selection; the core's follow, so a vendor's faster fusion wins
where it is eligible and the core's symmetric-memory kernel serves where none is.
"""

from __future__ import annotations

from typing import Any

from .allreduce_norm import (
    AllReduceNormCandidate,
    AllReduceNormProvider,
    FusedSum,
    RefusedCandidate,
    WorkspaceUnavailable,
    agree,
    group_backend,
)
# The core's fused kernel under the vendor SDK's names (plain ``launch`` says nothing there).
from .symm_mem import launch as symm_mem_launch
from .symm_mem import make_symm_workspace

__all__ = [
    "AllReduceNormCandidate",
    "AllReduceNormProvider",
    "FusedSum",
    "RefusedCandidate",
    "WorkspaceUnavailable",
    "agree",
    "group_backend",
    "core_fusion_providers",
    "make_symm_workspace",
    "symm_mem_launch",
]


def core_fusion_providers() -> list[Any]:
    """Fresh instances (each holds the workspaces of the model it is built into)."""
    from .symm_mem import SymmMemAllReduceNorm

    return [SymmMemAllReduceNorm()]
