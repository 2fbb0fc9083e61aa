"""Token-row movement under attention data parallelism.

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
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from . import ops
from .quant import QuantizedRows
from .topology import Topology

__all__ = ["DpRows", "ScatterRows", "check_rows", "move_input", "check_counts_agree", "ENV_CHECK_DP_COUNTS"]

# On: every batch's dp_num_tokens is compared across the TP group before its first row move (a
# gather and a host sync a batch, so off by default). Ranks that disagree otherwise fail inside
# the collective (gloo aborts on mismatched sizes) or, worse, move the wrong rows.
ENV_CHECK_DP_COUNTS = "LAYER_BOUNDARY_CHECK_DP_COUNTS"
_CHECKING: list[bool] = []  # the variable, read once a process (not on every forward)


def _checking() -> bool:
    if not _CHECKING:
        import os

        from .plugins.discovery import _truthy

        _CHECKING.append(_truthy(os.environ.get(ENV_CHECK_DP_COUNTS), ENV_CHECK_DP_COUNTS))
    return _CHECKING[0]


def check_counts_agree(counts: Sequence[int], topology: Topology, *, dp: bool = True) -> None:
    """With ``LAYER_BOUNDARY_CHECK_DP_COUNTS`` on (read once a process), raise ``BoundaryError`` on
    every rank of the TP group unless all of them give this batch the same ``dp_num_tokens``
    (``dp=False``: the same ``num_tokens``, which every rank of a TP group without attention DP
    computes on: ranks given different batches otherwise abort in gloo or hang in NCCL)."""
    tp = topology.tp
    if tp.size == 1 or not _checking():
        return
    from .errors import BoundaryError
    from .ops import gather_objects

    mine = tuple(int(c) for c in counts)
    every = gather_objects(mine, tp.group)
    for rank, theirs in zip(tp.ranks, every):
        if theirs != mine and not dp:
            raise BoundaryError(
                f"ForwardBatch.num_tokens disagrees across the TP group: rank {tp.ranks[tp.rank]} has {mine[0]}, "
                f"rank {rank} has {theirs[0]}; without attention DP every rank of a TP group runs the same "
                f"batch (its rows, in the same order) ({ENV_CHECK_DP_COUNTS} found this)"
            )
        if theirs != mine:
            raise BoundaryError(
                f"ForwardBatch.dp_num_tokens disagrees across the TP group: rank {tp.ranks[tp.rank]} has {mine}, "
                f"rank {rank} has {theirs}; every rank must give every DP group's row count, in DP-rank "
                f"order, the same ({ENV_CHECK_DP_COUNTS} found this)"
            )


def check_rows(x: torch.Tensor, expected: int, what: str, source: str, fix: str) -> None:
    """A row-count check before a row move: wrong rows otherwise fail inside the collective (as
    torch's copy error, or a size mismatch on the other ranks) or, where the move pads, are
    silently zero-padded or cut. Trailing dimensions are the caller's (an MHC stream is
    [tokens, n, hidden])."""
    if x.shape[0] == expected:
        return
    from .errors import BoundaryError

    # A [batch, seq, hidden] tensor (transformers' layout) runs unnoticed on one rank and reaches
    # the first row move as "1 rows": name its shape and the fix.
    hint = (f" (shape {tuple(x.shape)}: boundaries move token rows, [tokens, hidden]; flatten a "
            "[batch, seq, hidden] tensor with x.view(-1, x.shape[-1]))"
            if x.dim() > 2 and x.shape[:-1].numel() == expected else "")
    raise BoundaryError(f"{what} has {x.shape[0]} rows{hint}, but {source} {expected}: {fix}")


def move_input(move: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """Apply a row move to a stage input: a tensor, or a quantized input's codes and scales.

    FP8 codes travel as bytes: gathers only copy them, and not every backend knows the dtype.
    """
    if isinstance(x, QuantizedRows):
        data = move(x.data.view(torch.uint8)).view(x.data.dtype)
        return QuantizedRows(data, move(x.scale))
    return move(x)


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


class ScatterRows:
    """Row bookkeeping of an input-scattered batch (``ATTN_TP_SCATTER``).

    Each attention-TP rank holds a slice of its DP group's rows: group ``d`` is padded to
    ``A * S`` rows (``A`` attention-TP ranks, ``S = ceil(max_d T_d / A)``) and attention-TP rank
    ``a`` holds rows ``[a*S, (a+1)*S)``. Padding rows are zeros and are dropped by every gather.

    ===========================  ===========================================  ======================
    move                         shapes                                       collective
    ===========================  ===========================================  ======================
    ``my_slice``                 [T_d, H] -> [S, H]                           none
    ``gather_group``             [S, H] -> [T_d, H]                           all-gather, attention TP
    ``gather_all``               [S, H] -> [ΣT, H]                            all-gather, TP
    ``reduce_scatter_group``     partial [T_d, H] -> complete [S, H]          reduce-scatter, attention TP
    ``reduce_scatter_all``       partial [ΣT, H] -> complete [S, H]           reduce-scatter, TP
    ===========================  ===========================================  ======================
    """

    __slots__ = ("counts", "offsets", "slice_rows", "topology", "d", "a")

    def __init__(self, counts: Sequence[int], topology: Topology) -> None:
        a = topology.attn_tp.size
        self.counts = tuple(int(c) for c in counts)
        offs = [0]
        for c in self.counts:
            offs.append(offs[-1] + c)
        self.offsets = tuple(offs)
        self.slice_rows = -(-max(self.counts) // a) if self.counts else 0
        self.topology = topology
        self.d = topology.attn_dp.rank
        self.a = topology.attn_tp.rank

    @property
    def local(self) -> int:
        return self.counts[self.d]

    def _check(self, x: torch.Tensor, what: str, *, every_group: bool = False) -> None:
        if self.topology.attn_dp.size > 1:
            source = ("ForwardBatch.dp_num_tokens sums to" if every_group else
                      f"ForwardBatch.dp_num_tokens gives this DP group (rank {self.d})")
            fix = ("pass every group's rows, in DP-rank order" if every_group else
                   "pass the group's own rows (num_tokens and dp_num_tokens count them)")
        else:
            source = "ForwardBatch.num_tokens is"
            fix = ("pass the batch's rows, all of them on every attention-TP rank: the boundary "
                   "scatters them")
        check_rows(x, self.offsets[-1] if every_group else self.local, what, source, fix)

    def _pad_group(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.topology.attn_tp.size * self.slice_rows
        if x.shape[0] == rows:
            return x
        out = x.new_zeros((rows, *x.shape[1:]))
        out[: x.shape[0]] = x
        return out

    def my_slice(self, x_group: torch.Tensor, what: str = "the stage input") -> torch.Tensor:
        self._check(x_group, what)
        s = self.slice_rows
        return self._pad_group(x_group)[self.a * s : (self.a + 1) * s]

    def gather_group(self, x_slice: torch.Tensor) -> torch.Tensor:
        return ops.all_gather_rows(x_slice, self.topology.attn_tp)[: self.local]

    def gather_all(self, x_slice: torch.Tensor) -> torch.Tensor:
        full = ops.all_gather_rows(x_slice, self.topology.tp)  # group d at [d*A*S, (d+1)*A*S)
        span = self.topology.attn_tp.size * self.slice_rows
        if all(c == span for c in self.counts):
            return full
        return torch.cat([full[d * span : d * span + c] for d, c in enumerate(self.counts)])

    def reduce_scatter_group(self, partial_group: torch.Tensor) -> torch.Tensor:
        self._check(partial_group, "the stage output")
        return ops.reduce_scatter_rows(self._pad_group(partial_group), self.topology.attn_tp)

    def take_group(self, x_all: torch.Tensor, what: str = "the stage output") -> torch.Tensor:
        """This group's rows of every group's rows."""
        self._check(x_all, what, every_group=True)
        return x_all[self.offsets[self.d] : self.offsets[self.d + 1]]

    def reduce_scatter_all(self, partial_all: torch.Tensor) -> torch.Tensor:
        self._check(partial_all, "the stage output", every_group=True)
        span = self.topology.attn_tp.size * self.slice_rows
        padded = partial_all.new_zeros((len(self.counts) * span, *partial_all.shape[1:]))
        for d, c in enumerate(self.counts):
            if c:
                padded[d * span : d * span + c] = partial_all[self.offsets[d] : self.offsets[d + 1]]
        return ops.reduce_scatter_rows(padded, self.topology.tp)
