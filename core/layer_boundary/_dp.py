"""Attention data parallelism: the row movement of the ORDINARY variant when attention DP > 1.

Under attention DP a rank's residual holds its own DP group's rows (``T_d`` of them, replicated
over the group's attention-TP ranks) while the FFN runs tensor-parallel over every rank on all
groups' rows. ``DpRows`` holds the per-batch row counts and implements the moves between the two:

============================  =====================================================  ===========
move                          shapes                                                  collective
============================  =====================================================  ===========
``gather``                    [T_d, H] -> [ΣT, H] (all groups, DP-rank order)         all-gather over attention DP (padded to max T)
``joined_sum``                partial [T_d, H] (+ residual on attn-TP rank 0)         all-reduce over TP
                              -> complete [ΣT, H]
``take_local``                complete [ΣT, H] -> [T_d, H]                            none
``reduce_scatter``            partial [ΣT, H] -> complete [T_d, H]                    reduce-scatter over TP (padded),
                                                                                      all-gather over attention TP when > 1
``reduce_scatter_v``          partial [ΣT, H] -> complete [T_d, H]                    all-to-all over TP, local FP32 sum
============================  =====================================================  ===========

Padded moves need every group's rows padded to ``max T`` (a multiple of the attention-TP size
for ``reduce_scatter``); padding rows are zeros and never reach the residual.

``AttentionDpRows`` is the variant's ``BatchRows``: an FFN input is moved to every group's rows
("join": the attention sum, the plain add and the gather in one all-reduce; "read_first": read on
the local rows, gather the normalized input), and an FFN output returns to its group's rows at
``finish()`` by the first return the reduction policy allows (``reduction.return_paths``). An
attention stage reads and publishes on its group's rows, as in an ordinary batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from . import _ops as ops
from ._batch_rows import BatchRows, Capture
from ._contracts import OwedKind
from ._edges import check_edge
from ._errors import BoundaryError
from ._layout import SumGroup
from ._output import Contribution
from ._prepare import run_entry
from .residual._stream import ResidualStream, StreamState
from ._rows import check_counts_agree, check_rows, move_input
from ._topology import Topology

if TYPE_CHECKING:
    from ._plan import EntryPath, StagePlan

__all__ = ["DpRows", "AttentionDpRows", "dp_rows"]


class DpRows:
    """Row bookkeeping of one batch under attention DP (built once per batch per stage)."""

    __slots__ = ("counts", "dp_rank", "offsets", "total", "max_rows", "topology")

    def __init__(self, counts: Sequence[int], topology: Topology) -> None:
        dp = topology.attn_dp
        if len(counts) != dp.size:
            raise ValueError(
                f"ForwardBatch.dp_num_tokens has {len(counts)} entries but attention DP has "
                f"{dp.size} groups; give the row count of every DP group in DP-rank order"
            )
        self.counts = tuple(int(c) for c in counts)
        self.dp_rank = dp.rank
        offs = [0]
        for c in self.counts:
            offs.append(offs[-1] + c)
        self.offsets = tuple(offs)
        self.total = offs[-1]
        self.max_rows = max(self.counts) if self.counts else 0
        self.topology = topology

    @property
    def local(self) -> int:
        return self.counts[self.dp_rank]

    def _padded_to(self, multiple: int) -> int:
        m = self.max_rows
        return -(-m // multiple) * multiple if m else 0

    def _pad_groups(self, x_all: torch.Tensor, rows: int) -> torch.Tensor:
        """[ΣT, H] in group order -> [D * rows, H], group d at rows [d*rows, d*rows + T_d)."""
        out = x_all.new_zeros((len(self.counts) * rows, *x_all.shape[1:]))
        for d, c in enumerate(self.counts):
            if c:
                out[d * rows : d * rows + c] = x_all[self.offsets[d] : self.offsets[d + 1]]
        return out

    def _compact(self, padded: torch.Tensor, rows: int) -> torch.Tensor:
        """Inverse of ``_pad_groups``."""
        if all(c == rows for c in self.counts):
            return padded
        return torch.cat([padded[d * rows : d * rows + c] for d, c in enumerate(self.counts)])

    def _check_local(self, x: torch.Tensor, what: str) -> None:
        check_rows(x, self.local, what, f"ForwardBatch.dp_num_tokens gives this DP group (rank {self.dp_rank})",
                   "pass the group's own rows (num_tokens and dp_num_tokens count them)")

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """Every group's rows, in DP-rank order, on every rank."""
        self._check_local(x_local, "the stage input")
        dp = self.topology.attn_dp
        rows = self.max_rows
        if x_local.shape[0] != rows:
            pad = x_local.new_zeros((rows, *x_local.shape[1:]))
            pad[: x_local.shape[0]] = x_local
            x_local = pad
        return self._compact(ops.all_gather_rows(x_local, dp), rows)

    def joined_sum(
        self, value_local: torch.Tensor, residual: Optional[torch.Tensor], *, partial: bool = True
    ) -> torch.Tensor:
        """Complete an attention-TP sum and gather all groups' rows in one all-reduce over TP.

        ``residual`` (this group's rows) joins the sum on attention-TP rank 0 only, so the result
        is ``residual + Σ value`` for every group: the plain add rides on the collective. A value
        that is already complete (``partial=False``) also enters on attention-TP rank 0 only.
        """
        self._check_local(value_local, "the attention output")
        rows = self.max_rows
        buf = value_local.new_zeros((len(self.counts) * rows, *value_local.shape[1:]))
        lo = self.dp_rank * rows
        mine = buf[lo : lo + self.local]
        first = self.topology.attn_tp.rank == 0
        if partial or first:
            mine.copy_(value_local)
        if residual is not None and first:
            mine.add_(residual)
        ops.all_reduce(buf, self.topology.tp)
        return self._compact(buf, rows)

    def take_local(self, x_all: torch.Tensor) -> torch.Tensor:
        return x_all[self.offsets[self.dp_rank] : self.offsets[self.dp_rank + 1]]

    def reduce_scatter(self, partial_all: torch.Tensor) -> torch.Tensor:
        """Fixed-size (padded) reduce-scatter over TP back to this group's rows."""
        a = self.topology.attn_tp.size
        rows = self._padded_to(a)
        padded = self._pad_groups(partial_all, rows)
        mine = ops.reduce_scatter_rows(padded, self.topology.tp)  # [rows / a, H]: slice a of group d
        if a > 1:
            mine = ops.all_gather_rows(mine, self.topology.attn_tp)
        return mine[: self.local]

    def reduce_scatter_v(self, partial_all: torch.Tensor) -> torch.Tensor:
        """Variable-size reduce-scatter over TP (attention TP 1): each rank receives exactly its
        group's rows from every rank and sums them in FP32 (FP64 for FP64 data)."""
        tp = self.topology.tp
        assert self.topology.attn_tp.size == 1, "eligibility keeps RSv to attention TP 1"
        recv = [self.local] * tp.size
        got = ops.all_to_all_rows(partial_all, list(self.counts), recv, tp)
        acc = torch.promote_types(got.dtype, torch.float32)
        return got.view(tp.size, self.local, *got.shape[1:]).to(acc).sum(0).to(got.dtype)


def dp_rows(stream: ResidualStream, plan: StagePlan, forward_batch: Any) -> DpRows:
    """The batch's DP row bookkeeping, built once per stream (once per forward or microbatch)."""
    rows = stream.dp_rows
    if rows is None:
        counts = getattr(forward_batch, "dp_num_tokens", None)
        if counts is None:
            raise BoundaryError(
                f"attention DP has {plan.topology.attn_dp.size} groups but forward_batch.dp_num_tokens "
                "is not set; give the row count of every DP group (in DP-rank order) for this batch"
            )
        rows = DpRows(counts, plan.topology)
        check_counts_agree(rows.counts, plan.topology)
        if rows.local != forward_batch.num_tokens:
            raise BoundaryError(
                f"forward_batch.num_tokens={forward_batch.num_tokens} but dp_num_tokens gives this DP "
                f"group (rank {rows.dp_rank}) {rows.local} rows; they must agree"
            )
        stream.dp_rows = rows
    return rows


def _joinable(c: Contribution) -> bool:
    return (
        c.update.plain_add and c.transform is None and isinstance(c.value, torch.Tensor)
        and all(o.kind is OwedKind.SUM and o.group_name is SumGroup.ATTN_TP for o in c.owed)
    )


# The FFN output returns, by the policy's first permitted path (bound once per stage).
_RETURNS: dict[str, Callable[[DpRows, torch.Tensor], torch.Tensor]] = {
    "ar": DpRows.take_local,  # compute summed over TP: the exit's flags asked it to
    "rs": DpRows.reduce_scatter,
    "rsv": DpRows.reduce_scatter_v,
}


class AttentionDpRows(BatchRows):
    """Row movement of a stage under attention DP.

    ``gather``: an FFN's input move, ``"join"`` or ``"read_first"`` (``None`` for an attention or
    mixer stage, which computes on its group's rows). ``output_return``: an FFN's return
    (``"ar"``, ``"rs"``, ``"rsv"``), ``None`` for other stages.
    """

    __slots__ = ("input_move", "output_return", "reduce_scatters", "every_group_input", "_join",
                 "_return")

    def __init__(self, gather: Optional[str], output_return: Optional[str]) -> None:
        assert gather in (None, "join", "read_first") and (output_return is None or output_return in _RETURNS)
        self.input_move = gather
        self._join = gather == "join"
        self.every_group_input = gather is not None
        self.output_return = output_return
        self.reduce_scatters = output_return in ("rs", "rsv")
        self._return = _RETURNS[output_return] if output_return is not None else None

    def enter(self, plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any,
              capture: Optional[Capture], collector: Any, forward_batch: Any) -> Any:
        if self.input_move is None:
            return run_entry(plan, entry, stream, hidden, capture, collector, forward_batch)
        # FFN input: every group's rows, normalized, on every rank.
        rows = dp_rows(stream, plan, forward_batch)
        if self._join and stream.state is StreamState.PENDING:
            stream.expect(hidden, plan.name)
            c = stream.pending
            assert c is not None
            check_edge(plan, entry, c)
            if _joinable(c):
                assert isinstance(c.value, torch.Tensor)  # _joinable checked it
                stream.consume()
                residual_all = rows.joined_sum(c.value, stream.residual, partial=bool(c.owed))
                x_all = plan.read.read(residual_all)
                stream.write(rows.take_local(residual_all))
                return x_all
        x_local = run_entry(plan, entry, stream, hidden, None, None, forward_batch)
        return move_input(rows.gather, x_local)

    def give_back(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                  value: torch.Tensor) -> torch.Tensor:
        assert self._return is not None
        return self._return(dp_rows(stream, plan, forward_batch), value)

    def postprocess(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                    value: torch.Tensor) -> torch.Tensor:
        if self._return is None:
            return value
        # Fully reduced on every group's rows: keep this group's.
        return dp_rows(stream, plan, forward_batch).take_local(value)

    def __repr__(self) -> str:
        return f"AttentionDpRows(gather={self.input_move}, return={self.output_return})"
