"""Token axes, layouts and named sum groups.

A *layout* says which token axes partition a rank's rows; a *sum group* says over which ranks a
contribution still has to be summed. Keeping the two apart lets a boundary describe an unreduced
contribution together with the rows on which its completion must land.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["TokenAxis", "Layout", "SumGroup", "BatchVariant", "VARIANT_PRIORITY"]


class TokenAxis(enum.Enum):
    """Axes that can partition a rank's token rows. Size-one axes are never recorded."""

    ATTN_DP = "attn_dp"  # different attention data-parallel token sets
    ATTN_CP = "attn_cp"  # context-parallel partitions of an active CP batch
    ATTN_TP_SCATTER = "attn_tp_scatter"  # token slices spread across attention-TP ranks


@dataclass(frozen=True, slots=True)
class Layout:
    """Which token axes shard the rows a rank holds (``sharded`` is empty for replicated rows)."""

    sharded: frozenset[TokenAxis] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.sharded, frozenset):
            object.__setattr__(self, "sharded", frozenset(self.sharded))
        bad = [a for a in self.sharded if not isinstance(a, TokenAxis)]
        if bad:
            raise TypeError(f"Layout.sharded takes TokenAxis members, got {bad!r}")

    @classmethod
    def replicated(cls) -> "Layout":
        return cls()

    def __repr__(self) -> str:
        axes = ",".join(sorted(a.name for a in self.sharded)) or "replicated"
        return f"Layout({axes})"


class SumGroup(enum.Enum):
    """Ranks over which an unreduced contribution must be summed."""

    ATTN_TP = "attn_tp"
    TP = "tp"
    MOE_OUTPUT = "moe_output"


class BatchVariant(str, enum.Enum):
    """Row arrangements a forward may be in; a plan holds one path per supported variant."""

    # A str mixin for str's C hash: the stages look their path up by variant on every call, and
    # Enum.__hash__ (a Python function) cost about 0.2 µs a lookup. An overridden __hash__ would
    # do the same, but torch 2.11's Dynamo refuses to hash such an enum in a compiled forward.

    ORDINARY = "ORDINARY"
    SEQUENCE_PARALLEL = "SEQUENCE_PARALLEL"
    INPUT_SCATTERED = "INPUT_SCATTERED"
    CP = "CP"


# When several variants are active at once, the first one in this order is the one that runs.
VARIANT_PRIORITY: tuple[BatchVariant, ...] = (
    BatchVariant.SEQUENCE_PARALLEL,
    BatchVariant.INPUT_SCATTERED,
    BatchVariant.CP,
    BatchVariant.ORDINARY,
)
