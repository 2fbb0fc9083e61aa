"""LoRA adapter: the rows a stage's compute input lives on in the selected path.

A LoRA layer applies a per-token adapter (``y += B[a_t] A[a_t] x_t``), so it must know which token
each row of its input is. The boundary may move rows between the residual and the compute input;
which rows arrive depends on the batch variant and the stage, all fixed by the path the batch
selects:

====================  =====================================  =====================================
path                  compute-input rows                     residual rows (the read's, and where
                                                             the output returns)
====================  =====================================  =====================================
ordinary              this DP group's ``T_d`` rows            the same ``T_d`` rows
FFN, attention DP     every group's rows, ``ΣT``, DP order    ``T_d`` (the exit returns them)
input-scattered attn  the group's ``T_d`` (gathered slices)   slice ``[a*S, (a+1)*S)`` of ``T_d``
input-scattered FFN   every group's rows, ``ΣT``, DP order    the same slice
====================  =====================================  =====================================

(``S = ceil(max_d T_d / A)`` for ``A`` attention-TP ranks; ``a`` is this rank's attention-TP rank.)

A model asks the stage once per forward, ``rows = boundary.input_rows(forward_batch)``, and hands
``rows`` to its LoRA layers, which map their per-token adapter indices with ``rows.select`` (the
engine knows every group's tokens: no communication) or ``rows.gather`` (this group's tokens only:
the same all-gather over attention DP the input took). Row arithmetic stays here, not in models.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._dp import DpRows
from .._errors import BoundaryError, no_path
from .._forward import active_variant
from .._layout import BatchVariant
from .._topology import Topology

__all__ = ["RowKind", "InputRows", "input_rows"]


class RowKind(enum.Enum):
    LOCAL = "local"  # this DP group's rows, in the model's order
    ALL_GROUPS = "all_groups"  # every DP group's rows, concatenated in DP-rank order


@dataclass(frozen=True, slots=True, eq=False)
class InputRows:
    """Where one stage's compute input lives for one batch.

    ``counts``: rows of every DP group in DP-rank order; ``dp_rank``: this rank's group;
    ``residual_rows``: ``[lo, hi)`` of this group's rows that this rank's residual holds (all of
    them except in the input-scattered variant, where it is this rank's slice, clipped to real
    rows).
    """

    variant: BatchVariant
    kind: RowKind
    counts: tuple[int, ...]
    dp_rank: int
    residual_rows: tuple[int, int]
    topology: Topology

    @property
    def local_rows(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def num_rows(self) -> int:
        return sum(self.counts) if self.kind is RowKind.ALL_GROUPS else self.local_rows

    def _offset(self, d: int) -> int:
        return sum(self.counts[:d])

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """``(dp_rank, first input row, rows)`` for each DP group whose tokens the input holds;
        group ``d``'s local row ``j`` is input row ``first + j``."""
        if self.kind is RowKind.LOCAL:
            return ((self.dp_rank, 0, self.local_rows),)
        return tuple((d, self._offset(d), c) for d, c in enumerate(self.counts))

    def token_index(self, device: Any = None) -> torch.Tensor:
        """``[num_rows]`` int64: each input row's token index in DP order (group ``d``'s tokens
        numbered from ``sum(counts[:d])``)."""
        if self.kind is RowKind.ALL_GROUPS:
            return torch.arange(sum(self.counts), device=device)
        lo = self._offset(self.dp_rank)
        return torch.arange(lo, lo + self.local_rows, device=device)

    def select(self, values_all: torch.Tensor) -> torch.Tensor:
        """Per-token values of every DP group's tokens ``[ΣT, ...]`` (DP order) -> the input's rows."""
        total = sum(self.counts)
        if values_all.shape[0] != total:
            raise ValueError(
                f"select() takes one row per token of every DP group ({total} = sum of "
                f"{self.counts}), got {values_all.shape[0]}; use gather() for this group's tokens"
            )
        if self.kind is RowKind.ALL_GROUPS or len(self.counts) == 1:
            return values_all
        lo = self._offset(self.dp_rank)
        return values_all[lo : lo + self.local_rows]

    def gather(self, values_local: torch.Tensor) -> torch.Tensor:
        """Per-token values of this DP group's tokens ``[T_d, ...]`` -> the input's rows.

        For every-group inputs this is an all-gather over attention DP (padded to the largest
        group), so every rank of the attention-DP group must call it, as the input move did.
        """
        if values_local.shape[0] != self.local_rows:
            raise ValueError(
                f"gather() takes one row per token of this DP group ({self.local_rows}), got "
                f"{values_local.shape[0]}"
            )
        if self.kind is RowKind.LOCAL or len(self.counts) == 1:
            return values_local
        return DpRows(self.counts, self.topology).gather(values_local)

    def __repr__(self) -> str:
        return (f"InputRows({self.variant.name}, {self.kind.value}, rows={self.num_rows}, "
                f"counts={self.counts}, residual_rows={self.residual_rows})")


def input_rows(boundary: Any, forward_batch: Any) -> InputRows:
    """The rows ``boundary``'s compute input lives on for this batch (see the module table).

    Host-side bookkeeping only: no collective, no device work; valid before or after
    ``prepare()`` of the same batch.
    """
    plan = boundary.plan
    variant = active_variant(forward_batch)
    entry = plan.entries.get(variant)
    if entry is None:
        raise no_path(variant.name, plan.name, plan.refusals.get(variant))
    topo: Topology = plan.topology
    rows = entry.rows
    if rows.token_gather:
        raise BoundaryError(
            f"{plan.name}: LoRA input rows of a context-parallel FFN are not supported yet: its input "
            "is gathered to every token of the CP group through the batch's CP token mapping "
            "(layer_boundary._cp.CpSplit), which InputRows does not describe"
        )
    counts = _counts(topo, forward_batch, plan.name)
    d = topo.attn_dp.rank if topo.attn_dp.size > 1 else 0
    every_group = rows.every_group_input and len(counts) > 1
    local = counts[d]
    residual = (0, local)
    if rows.sliced_residual:
        a = topo.attn_tp.size
        s = -(-max(counts) // a) if counts else 0
        lo = topo.attn_tp.rank * s
        residual = (min(lo, local), min(lo + s, local))
    return InputRows(variant, RowKind.ALL_GROUPS if every_group else RowKind.LOCAL, counts, d,
                     residual, topo)


def _counts(topo: Topology, forward_batch: Any, stage: str) -> tuple[int, ...]:
    dp = topo.attn_dp
    if dp.size == 1:
        return (int(forward_batch.num_tokens),)
    counts: Optional[Any] = getattr(forward_batch, "dp_num_tokens", None)
    if counts is None:
        raise BoundaryError(
            f"attention DP has {dp.size} groups but forward_batch.dp_num_tokens is not set; give "
            f"the row count of every DP group (in DP-rank order) for this batch ({stage})"
        )
    counts = tuple(int(c) for c in counts)
    if len(counts) != dp.size or counts[dp.rank] != forward_batch.num_tokens:
        raise BoundaryError(
            f"forward_batch.dp_num_tokens={counts} does not fit attention DP of {dp.size} groups "
            f"with num_tokens={forward_batch.num_tokens} on DP rank {dp.rank}; give every group's "
            "row count in DP-rank order"
        )
    return counts
