"""Context parallelism (``ATTN_CP``): the token mapping of a CP batch and the row moves paired
through it.

Under a CP batch each rank of the attention-CP group holds a subset of every sequence's tokens.
Which subset is the batch's :class:`CpSplit`; every move below goes through that one mapping, so
a gather, the return to local rows and the reduce-scatter can never disagree about a row.

Token mapping (``CpSplit.zigzag``, the default): each sequence of length ``L`` is cut into ``2C``
chunks (``C`` CP ranks) of ``L // 2C`` or one more tokens, the longer ones first; CP rank ``r``
holds chunks ``r`` and ``2C - 1 - r`` of every sequence, in sequence order. Causal attention over
an early chunk is cheap and over a late one expensive, so pairing them balances the ranks' work.
Sequences shorter than ``2C`` leave some ranks without rows of theirs; a rank may hold no rows at
all and still joins every collective. ``CpSplit.contiguous`` (rank ``r`` holds the ``r``-th of
``C`` consecutive chunks) and any other partition (``CpSplit(seq_lens, owners, topology)``) run
through the same moves.

``T`` tokens of the batch in packed order, ``T_r`` rows on CP rank ``r``, ``S = max_r T_r``:

=====================  ===============================  ==============================================
move                   shapes                           collective
=====================  ===============================  ==============================================
``take_local``         [T, ...] -> [T_r, ...]           none (return to local rows)
``gather``             [T_r, ...] -> [T, ...]           all-gather over attention CP (padded to S),
                                                        then rows in packed token order
``reduce_scatter``     partial [T, ...] -> [T_r, ...]   reduce-scatter over the sum group (TP): group
                                                        rank ``t`` receives CP rank ``t % C``'s rows
=====================  ===============================  ==============================================

What the boundary does with them in a CP batch (``CpRows``, bound at construction):

* attention input: read on the local rows; the attention itself gathers its keys and values
  through ``gather`` and computes causal attention for its local query rows (``causal_mask``);
  its output is a partial sum over the head group (``Topology.attn_heads``) on the local rows;
* FFN input: complete that sum and read on the local rows, then ``gather`` the normalized input
  (the FFN is tensor-parallel over TP and needs the same rows on every rank);
* FFN output: ``reduce_scatter`` sums over TP and lands each rank's rows in one collective (compute
  skips its sum: ``mlp_reduce_scatter``); an output compute already reduced (``postprocess``)
  returns through ``take_local``.

CP is a prefill variant: a decode batch (one token per sequence) is refused; run it ordinary.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import _ops as ops
from ._batch_rows import BatchRows, Capture
from ._errors import BoundaryError
from ._forward import ForwardMode, active_variant
from ._layout import BatchVariant
from ._prepare import run_entry
from ._rows import move_input
from ._topology import GroupInfo, Topology

__all__ = ["CpSplit", "CpRows", "context_parallel_split", "checked_split"]


def _zigzag_chunks(length: int, c: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the ``2c`` chunks of one sequence (longer chunks first)."""
    n = 2 * c
    base, extra = divmod(length, n)
    out, lo = [], 0
    for k in range(n):
        hi = lo + base + (1 if k < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class CpSplit:
    """How one batch's tokens are spread over the attention-CP group, and the moves through it.

    ``seq_lens``: the batch's sequences (packed in this order, ``T`` tokens in all).
    ``owners[r]``: the packed token indices CP rank ``r`` holds, in the order of its rows.
    Built once per batch on every rank of the CP group (with the same arguments).
    """

    __slots__ = ("seq_lens", "num_tokens", "topology", "cp", "rank", "counts", "slot_rows",
                 "device", "local_index", "_owners", "_gather_order", "_rs", "_mask", "_seq_id")

    def __init__(self, seq_lens: Sequence[int], owners: Sequence[Sequence[int]], topology: Topology,
                 *, device: Any = "cpu") -> None:
        self.seq_lens = tuple(int(n) for n in seq_lens)
        if any(n < 0 for n in self.seq_lens):
            raise ValueError(f"CpSplit: seq_lens {self.seq_lens} must be non-negative")
        self.num_tokens = sum(self.seq_lens)
        self.topology = topology
        self.cp: GroupInfo = topology.attn_cp
        if len(owners) != self.cp.size:
            raise ValueError(f"CpSplit: {len(owners)} owner lists for a CP group of {self.cp.size} ranks; "
                             "give the token indices of every CP rank in CP-rank order")
        flat = sorted(int(i) for o in owners for i in o)
        if flat != list(range(self.num_tokens)):
            raise ValueError(f"CpSplit: the owner lists must hold every token 0..{self.num_tokens - 1} "
                             "exactly once")
        self.rank = self.cp.rank
        self.device = torch.device(device)
        self._owners = [torch.tensor([int(i) for i in o], dtype=torch.long) for o in owners]
        self.counts = tuple(len(o) for o in self._owners)
        self.slot_rows = max(self.counts) if self.counts else 0
        self.local_index = self._owners[self.rank].to(self.device)
        order = torch.empty(self.num_tokens, dtype=torch.long)
        for r, o in enumerate(self._owners):
            order[o] = r * self.slot_rows + torch.arange(len(o))
        self._gather_order = order.to(self.device)
        self._rs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask: Optional[torch.Tensor] = None
        self._seq_id: Optional[torch.Tensor] = None

    @classmethod
    def zigzag(cls, seq_lens: Sequence[int], topology: Topology, *, device: Any = "cpu") -> "CpSplit":
        """The load-balanced mapping: rank ``r`` holds chunks ``r`` and ``2C-1-r`` of each sequence."""
        c = topology.attn_cp.size
        owners: list[list[int]] = [[] for _ in range(c)]
        start = 0
        for length in seq_lens:
            chunks = _zigzag_chunks(int(length), c)
            for r in range(c):
                for k in (r, 2 * c - 1 - r):
                    lo, hi = chunks[k]
                    owners[r].extend(range(start + lo, start + hi))
            start += int(length)
        return cls(seq_lens, owners, topology, device=device)

    @classmethod
    def contiguous(cls, seq_lens: Sequence[int], topology: Topology, *, device: Any = "cpu") -> "CpSplit":
        """Rank ``r`` holds the ``r``-th of ``C`` consecutive chunks of each sequence."""
        c = topology.attn_cp.size
        owners: list[list[int]] = [[] for _ in range(c)]
        start = 0
        for length in seq_lens:
            base, extra = divmod(int(length), c)
            lo = 0
            for r in range(c):
                hi = lo + base + (1 if r < extra else 0)
                owners[r].extend(range(start + lo, start + hi))
                lo = hi
            start += int(length)
        return cls(seq_lens, owners, topology, device=device)

    @property
    def local_rows(self) -> int:
        return self.counts[self.rank]

    def owners(self, rank: int) -> torch.Tensor:
        """Packed token indices CP rank ``rank`` holds (CPU)."""
        return self._owners[rank]

    # -- moves ---------------------------------------------------------------------------------

    def take_local(self, x_all: torch.Tensor) -> torch.Tensor:
        """Rows of every token ``[T, ...]`` -> this rank's rows ``[T_r, ...]`` (a copy)."""
        if x_all.shape[0] != self.num_tokens:
            raise ValueError(f"take_local() takes one row per token of the batch ({self.num_tokens}), "
                             f"got {x_all.shape[0]}")
        return x_all.index_select(0, self.local_index.to(x_all.device))

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[T_r, ...]`` -> every token's rows ``[T, ...]`` in packed order, on
        every rank of the CP group (one all-gather over attention CP)."""
        if x_local.shape[0] != self.local_rows:
            raise ValueError(f"gather() takes this CP rank's {self.local_rows} rows, got {x_local.shape[0]}")
        if self.num_tokens == 0:  # every rank holds the same empty split: nothing to exchange
            return x_local
        s = self.slot_rows
        if x_local.shape[0] != s:
            pad = x_local.new_zeros((s, *x_local.shape[1:]))
            pad[: x_local.shape[0]] = x_local
            x_local = pad
        full = ops.all_gather_rows(x_local, self.cp)
        return full.index_select(0, self._gather_order.to(full.device))

    def reduce_scatter(self, partial_all: torch.Tensor, group: GroupInfo) -> torch.Tensor:
        """A partial sum over ``group`` on every token's rows -> the complete sum on this rank's
        rows, in one reduce-scatter. Group rank ``t`` receives CP rank ``t % C``'s rows, so when the
        group is larger than CP (heads sharded too) each CP partition's rows travel once per head
        rank; the sum over the group is still taken exactly once."""
        if partial_all.shape[0] != self.num_tokens:
            raise ValueError(f"reduce_scatter() takes one row per token of the batch ({self.num_tokens}), "
                             f"got {partial_all.shape[0]}")
        g = group.size
        if g == 1 or self.num_tokens == 0:
            return self.take_local(partial_all)
        src, dst = self._rs_index(g, partial_all.device)
        buf = partial_all.new_zeros((g * self.slot_rows, *partial_all.shape[1:]))
        if src.numel():
            buf.index_copy_(0, dst, partial_all.index_select(0, src))
        return ops.reduce_scatter_rows(buf, group)[: self.local_rows]

    def _rs_index(self, g: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._rs.get(g)
        if got is None or got[0].device != device:
            c = self.cp.size
            if g % c:
                raise BoundaryError(f"a CP reduce-scatter over {g} ranks: the group must be a whole "
                                    f"number of CP groups of {c}")
            src = torch.cat([self._owners[t % c] for t in range(g)])
            dst = torch.cat([t * self.slot_rows + torch.arange(self.counts[t % c]) for t in range(g)])
            got = (src.to(device), dst.to(device))
            self._rs[g] = got
        return got

    # -- attention facts -----------------------------------------------------------------------

    def seq_ids(self) -> torch.Tensor:
        """``[T]``: the sequence each packed token belongs to."""
        if self._seq_id is None:
            self._seq_id = torch.repeat_interleave(
                torch.arange(len(self.seq_lens)), torch.tensor(self.seq_lens, dtype=torch.long)
            ).to(self.device)
        return self._seq_id

    def causal_mask(self) -> torch.Tensor:
        """``[T_r, T]`` bool: local query row ``i`` may attend to token ``j`` (packed order) when both
        belong to one sequence and ``j`` is not later than ``i``'s token."""
        if self._mask is None:
            seq = self.seq_ids()
            q = self.local_index
            keys = torch.arange(self.num_tokens, device=self.device)
            self._mask = (seq[None, :] == seq[q][:, None]) & (keys[None, :] <= q[:, None])
        return self._mask

    def __repr__(self) -> str:
        return (f"CpSplit(seq_lens={self.seq_lens}, cp={self.cp.size}, rank={self.rank}, "
                f"rows={self.counts})")


def context_parallel_split(forward_batch: Any) -> Optional[CpSplit]:
    """The batch's :class:`CpSplit` when it runs in the CP variant, else ``None``.

    Attention compute calls it to decide whether to gather keys and values; the variant priority
    (``active_variant``) is applied, so a batch that also sets a variant of higher priority is not
    treated as CP here.
    """
    if not getattr(forward_batch, "context_parallel", False):
        return None
    if active_variant(forward_batch) is not BatchVariant.CP:
        return None
    split = getattr(forward_batch, "cp_split", None)
    if split is None:
        raise BoundaryError(
            "a context-parallel batch has no forward_batch.cp_split; build the token mapping with "
            "layer_boundary._cp.CpSplit.zigzag(seq_lens, topology) and give this rank its rows"
        )
    return split


def checked_split(plan: Any, forward_batch: Any) -> CpSplit:
    """The CP batch's split, refused before any collective when it cannot be this stage's."""
    if getattr(forward_batch, "mode", None) is ForwardMode.DECODE:
        raise BoundaryError(
            f"{plan.name}: a DECODE batch cannot run context parallel. CP partitions the tokens of "
            "each sequence's prefill over the CP group; a decode step has one token per sequence. "
            "Run decode batches ordinary (context_parallel=False); the CP ranks then compute the "
            "same rows with the same heads"
        )
    split = context_parallel_split(forward_batch)
    assert split is not None
    if split.cp != plan.topology.attn_cp:
        raise BoundaryError(
            f"{plan.name}: forward_batch.cp_split was built for the CP group {split.cp.ranks}, but "
            f"this stage's CP group is {plan.topology.attn_cp.ranks}; build the split with the "
            "model's topology"
        )
    if forward_batch.num_tokens != split.local_rows:
        raise BoundaryError(
            f"{plan.name}: forward_batch.num_tokens={forward_batch.num_tokens} but cp_split gives CP "
            f"rank {split.rank} {split.local_rows} rows; a CP batch describes this rank's rows"
        )
    return split


class CpRows(BatchRows):
    """Row movement of a stage in a CP batch: every stage reads on this rank's tokens exactly as an
    ordinary batch does (the residual holds them); an FFN then gathers its normalized input to
    every token's rows and returns its output to the local tokens by a reduce-scatter over its sum
    group (``output_group``) at ``finish()``, so it leaves nothing owed. An attention's (or
    mixer's) output stays on the local rows, owing its sum over the head group.
    """

    __slots__ = ("token_gather", "input_move", "output_return", "reduce_scatters", "_group")

    def __init__(self, output_group: Optional[GroupInfo]) -> None:
        self._group = output_group
        ffn = output_group is not None
        self.token_gather = ffn
        self.input_move = "gather" if ffn else "local"
        self.output_return = "cp" if ffn else None
        self.reduce_scatters = ffn

    @property
    def output_group(self) -> Optional[GroupInfo]:
        return self._group

    def enter(self, plan: Any, entry: Any, stream: Any, hidden: Any, capture: Optional[Capture],
              collector: Any, forward_batch: Any) -> Any:
        split = checked_split(plan, forward_batch)
        # (This batch's ranks hold different rows by design: its split is checked, not the counts.)
        x = run_entry(plan, entry, stream, hidden, capture, collector, forward_batch)
        return move_input(split.gather, x) if self.token_gather else x

    def give_back(self, plan: Any, stream: Any, forward_batch: Any, value: torch.Tensor) -> torch.Tensor:
        assert self._group is not None
        return checked_split(plan, forward_batch).reduce_scatter(value, self._group)

    def postprocess(self, plan: Any, stream: Any, forward_batch: Any, value: torch.Tensor) -> torch.Tensor:
        if self._group is None:
            return value
        # Fully reduced on every token's rows: keep this rank's.
        return checked_split(plan, forward_batch).take_local(value)

    def __repr__(self) -> str:
        return f"CpRows({self.input_move})"
