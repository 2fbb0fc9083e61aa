"""The input-scattered and sequence-parallel variants: the residual lives on this rank's row slice.

Input-scattered (``ATTN_TP_SCATTER``): each attention-TP rank holds a slice of its DP group's rows.
Sequence parallel (no attention DP) runs the same moves over the whole TP group: the residual
sharded over the TP rows between stages, all-gathered before the column-parallel projections and
reduce-scattered after the row-parallel ones.

``ScatteredRows`` is the variants' ``BatchRows``: every stage reads on the slice (an attention-TP
partial sum left to the input is reduce-scattered onto it), then gathers its input over attention
TP (an attention or mixer: ``"group"``) or over TP (an FFN: ``"all"``); an FFN output returns to
the slice by a reduce-scatter over TP at ``finish()``.

``ScatterRows`` is the batch's row bookkeeping, built by its first prepare() and held by the stream
as its ``ResidualRows`` (``residual._rows``): the batch helpers, publish, ``to_pp``,
``capture_output`` and two-batch overlap reach the slice through its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from . import _ops as ops
from ._batch_rows import BatchRows, Capture
from ._contracts import Owed, OwedKind
from ._edges import check_edge
from ._errors import BoundaryError
from ._layout import SumGroup
from ._output import Contribution, HandoffOutput
from ._prepare import aliases, enter_read, reread, update_read
from .residual._rows import ResidualRows
from .residual._stream import ResidualStream, StreamState
from ._rows import check_counts_agree, check_rows, move_input
from ._topology import Topology

if TYPE_CHECKING:
    from ._plan import EntryPath, StagePlan

__all__ = ["ScatterRows", "ScatteredRows", "scatter_rows", "complete_scattered"]


class ScatterRows(ResidualRows):
    """Row bookkeeping of an input-scattered batch (``ATTN_TP_SCATTER``): the stream's
    ``ResidualRows`` from the batch's first prepare() on.

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

    sliced = True

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

    # -- the residual side (``ResidualRows``) ---------------------------------------------------

    def complete(self, c: Contribution) -> torch.Tensor:
        return complete_scattered(c, self)

    def completed_copy(self, c: Contribution) -> torch.Tensor:
        assert isinstance(c.value, torch.Tensor), "callers refuse handoffs before copying"
        return complete_scattered(Contribution(c.value.clone(), c.update, c.owed, c.transform), self)

    def complete_dynamic_sums(self, c: Contribution, dynamic: list[Owed]) -> None:
        # The sum is a reduce-scatter onto this rank's residual slice.
        assert len(dynamic) == len(c.owed), "an output owes one sum, static or dynamic"
        complete_scattered(c, self)

    def to_model(self, value: torch.Tensor) -> torch.Tensor:
        return self.gather_group(value)

    def to_stream(self, value: torch.Tensor) -> torch.Tensor:
        if value.shape[0] != self.local:
            raise ValueError(
                f"got {value.shape[0]} rows but this input-scattered batch's DP group has {self.local}; "
                "give one row per token of the group (the rows the layer stack started with)"
            )
        return self.my_slice(value).clone()

    def cut(self, value: torch.Tensor) -> torch.Tensor:
        return self.my_slice(value)

    def model_copy(self, value: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
        return self.gather_group(value)  # the gather allocates

    def check_output_shape(self, what: str, value: torch.Tensor, residual: torch.Tensor) -> None:
        pass  # outputs sit on the group's rows while the residual holds a slice

    def check_leaves_pp(self) -> None:
        raise BoundaryError(
            "to_pp(): an input-scattered (or sequence-parallel) batch holds a row slice per "
            "attention-TP rank; these variants are not supported across pipeline stages yet"
        )

    def fusable_handoff(self, c: Contribution) -> Optional[HandoffOutput]:
        return None  # the fused finalize adds to whole rows

    def for_batch(self, forward_batch: Any) -> ScatterRows:
        counts = getattr(forward_batch, "dp_num_tokens", None)
        return ScatterRows(counts if counts is not None else (forward_batch.num_tokens,), self.topology)

    def __repr__(self) -> str:
        return f"ScatterRows(counts={self.counts}, slice_rows={self.slice_rows})"


def scatter_rows(stream: ResidualStream, plan: StagePlan, forward_batch: Any) -> ScatterRows:
    """The input-scattered row bookkeeping of this batch, built once per stream."""
    rows = stream.rows
    if not isinstance(rows, ScatterRows):
        topo = plan.topology
        counts = getattr(forward_batch, "dp_num_tokens", None)
        if topo.attn_dp.size > 1 and counts is None:
            raise BoundaryError(
                f"attention DP has {topo.attn_dp.size} groups but forward_batch.dp_num_tokens is not "
                "set; give the row count of every DP group (in DP-rank order) for this batch"
            )
        if counts is not None:
            check_counts_agree(counts, topo)
        else:
            check_counts_agree((forward_batch.num_tokens,), topo, dp=False)
        rows = ScatterRows(counts if counts is not None else (forward_batch.num_tokens,), topo)
        stream.rows = rows
    return rows


def complete_scattered(c: Contribution, rows: ScatterRows) -> torch.Tensor:
    """Complete a contribution onto this rank's slice: an attention-TP partial sum becomes a
    reduce-scatter; a complete output is already on the slice (FFNs return there at finish)."""
    value = c.value
    if isinstance(value, HandoffOutput):
        value = value.complete()
    for owed in c.owed:
        if owed.kind is OwedKind.SUM:
            if owed.group_name is not SumGroup.ATTN_TP:
                raise BoundaryError(
                    f"an input-scattered stage received an output owing {owed.describe()}; only "
                    "attention-TP sums are left to the next input in this variant"
                )
            value = rows.reduce_scatter_group(value)
    if c.transform is not None:
        value = c.transform.fn(value)
    c.value, c.owed, c.transform = value, (), None
    return value


class ScatteredRows(BatchRows):
    """Row movement of a stage in the input-scattered and sequence-parallel variants.

    ``ffn``: the stage gathers its input over TP (every group's rows) and returns its output to the
    slice by a reduce-scatter; otherwise it gathers over attention TP (its group's rows).
    """

    __slots__ = ("every_group_input", "output_return", "reduce_scatters", "input_move")

    sliced_residual = True

    def __init__(self, ffn: bool) -> None:
        self.every_group_input = ffn
        self.input_move = "all" if ffn else "group"
        self.output_return = "scatter" if ffn else None
        self.reduce_scatters = ffn

    def enter(self, plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any,
              capture: Optional[Capture], collector: Any, forward_batch: Any) -> Any:
        rows = scatter_rows(stream, plan, forward_batch)
        read = plan.read
        upd = None
        state = stream.state
        if state is StreamState.INITIAL:
            if plan.declaration.previous is not None:
                raise BoundaryError(
                    f"{plan.name} stage was built with previous={plan.declaration.previous.describe()} "
                    "but the residual stream is initial; only the stack's first stage starts it"
                )
            if capture is not None:
                capture(hidden, owned=False)
            if collector is not None:
                collector.capture(hidden, owned=False)  # the model's own input, on the group's rows
            x, residual, upd = enter_read(read, rows.my_slice(hidden))
        else:
            stream.expect(hidden, plan.name)
            if state is StreamState.WRITTEN:
                x, upd = reread(read, stream.residual)
                residual = stream.residual
            else:
                c = stream.pending
                assert c is not None
                check_edge(plan, entry, c)
                stream.consume()
                value = complete_scattered(c, rows)
                residual = stream.writable_residual(read)
                x, residual, upd = update_read(read, c.update, value, residual)
            if capture is not None or collector is not None:
                # Both want the group's rows (the producer's rows, and the attention's compute-input
                # rows after its gather): one gather, which allocates, serves both.
                mine = rows.gather_group(residual)
                if capture is not None:
                    capture(mine, owned=True)
                if collector is not None:
                    collector.capture(mine, owned=True)
        stream.write(residual)
        stream.borrowed = state is StreamState.INITIAL and aliases(residual, hidden)
        stream.next_update = upd
        return move_input(rows.gather_all if self.every_group_input else rows.gather_group, x)

    def give_back(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                  value: torch.Tensor) -> torch.Tensor:
        return scatter_rows(stream, plan, forward_batch).reduce_scatter_all(value)

    def postprocess(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                    value: torch.Tensor) -> torch.Tensor:
        if self.output_return is None:
            return value
        # Fully reduced on every group's rows: keep this rank's slice.
        rows = scatter_rows(stream, plan, forward_batch)
        return rows.my_slice(rows.take_group(value, "the postprocess input"))

    def __repr__(self) -> str:
        return f"ScatteredRows({self.input_move})"
