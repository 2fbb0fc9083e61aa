"""Resolved contracts: producer reductions, stage kinds and the work an output still owes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from ._layout import SumGroup
from ._topology import GroupInfo

__all__ = ["ProducerReduction", "StageKind", "OwedKind", "Owed"]


class ProducerReduction(enum.Enum):
    """How a producer's compute cooperates with the boundary's reduction decision.

    PARTIAL: attention only; compute always returns an unreduced contribution (``finish()``).
    SCOPED: compute obeys the exit scope's decision (``exit()``); FFN default, or a mixer.
    LOCAL_TAIL: FFN only; compute adds a replicated component after its internal sum, so the sum
    is never deferred to the next layer (reduce-scatter permissions remain).
    """

    PARTIAL = "PARTIAL"
    SCOPED = "SCOPED"
    LOCAL_TAIL = "LOCAL_TAIL"


class StageKind(enum.Enum):
    ATTN = "attn"
    FFN = "ffn"


class OwedKind(enum.Enum):
    FINALIZE = "finalize"  # a producer handoff (e.g. deferred MoE finalize) still to complete
    SUM = "sum"  # an all-reduce over ``group``


@dataclass(frozen=True, slots=True)
class Owed:
    """One piece of work an output still needs before the residual update.

    ``static`` marks work declared at construction (a PARTIAL sum), as opposed to work an exit
    decided per batch; snapshots treat the two differently.
    """

    kind: OwedKind
    group_name: Optional[SumGroup] = None
    group: Optional[GroupInfo] = field(default=None, compare=False)
    static: bool = False

    def __post_init__(self) -> None:
        if self.kind is OwedKind.SUM and (self.group is None or self.group_name is None):
            raise ValueError("an owed sum needs its SumGroup and GroupInfo")

    def describe(self) -> str:
        if self.kind is OwedKind.FINALIZE:
            return "a producer finalize"
        assert self.group is not None and self.group_name is not None
        return f"a sum over {self.group_name.name} ({self.group.size} ranks)"
