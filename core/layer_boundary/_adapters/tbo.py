"""Two-batch overlap (TBO): a batch's tokens run as two microbatches whose stages interleave, so
that one microbatch's communication can be in flight while the other computes.

Each microbatch has its own ``ForwardBatch`` and its own ``ResidualStream``; no mutable stream is
shared between them, so passing one microbatch's output to the other's stream raises the spec's
``output does not belong to this residual stream`` error::

    children = split_batch(forward_batch, split, positions)        # two ForwardBatches
    parts = split_stream(hidden_states, forward_batch, children)   # ResidualStream.arrive() each
    outs = interleave([layer_stages(c, p) for c, p in zip(children, parts)])
    hidden_states = merge_streams(outs, children, forward_batch)   # token order, one stream

``model_forward_stages()`` does all of that for a run of decoder layers that each offer
``forward_stages(positions, hidden_states, forward_batch)``: a generator that yields a label
wherever the other microbatch may run next, and returns the layer's output. Its FFN runs in the
operation-scheduled form: compute without an ``exit()`` scope (so it reduces its own output) and
``boundary.postprocess()`` to publish it; never an ``exit()`` scope held open across a yield.

Which layers overlap, and so on which rows each layer's output is handed on, follows from the
producing FFN's declaration: ``sparse`` says whether its own layer overlaps, ``next_sparse``
whether the consuming layer does (under ``overlap="sparse"``; ``overlap="all"`` overlaps every
layer). ``handoff_rows()`` names the four cases:

==========  ==========================  ===================================================
rows        (producer, consumer)        what happens on the edge
==========  ==========================  ===================================================
BATCH       neither overlaps            the batch's rows, one stream
SPLIT       consumer only               the batch's rows are cut into the two microbatches
MICROBATCH  both                        each microbatch hands on its own rows, own stream
MERGE       producer only               the microbatches' rows join in token order
==========  ==========================  ===================================================

A split cuts at a sequence boundary (``TboSplit.seq_index``): attention needs a sequence's earlier
rows, which a microbatch without a KV cache would not have. Either microbatch may be empty; it
still runs every stage, because other ranks (other DP groups) may be waiting in its collectives.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, Iterable, Optional, Protocol, Sequence, TypeVar

import torch

from .._contracts import OwedKind, StageKind
from .._errors import BoundaryError
from .._forward import ForwardMode, get_forward
from .._output import Contribution, HandoffOutput
from ..residual._stream import Handle, ResidualStream, StreamState, started_stream


class LayerStack(Protocol):
    """The decoder layers in stack order: a list, or an ``nn.ModuleList`` (which torch's stubs do
    not make a ``Sequence``); only length, indexing and iteration are used."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

__all__ = [
    "TboRows",
    "TboSplit",
    "TboPlan",
    "balanced_split",
    "handoff_rows",
    "entry_rows",
    "plan_overlap",
    "split_batch",
    "split_stream",
    "merge_streams",
    "interleave",
    "model_forward_stages",
]

OVERLAP_POLICIES = ("sparse", "all")


class TboRows(enum.Enum):
    """The rows a layer's output is handed on under two-batch overlap."""

    BATCH = "batch"
    SPLIT = "split"
    MICROBATCH = "microbatch"
    MERGE = "merge"


_ROWS = {
    (False, False): TboRows.BATCH,
    (False, True): TboRows.SPLIT,
    (True, True): TboRows.MICROBATCH,
    (True, False): TboRows.MERGE,
}


def _overlaps(sparse: bool, overlap: str) -> bool:
    if overlap not in OVERLAP_POLICIES:
        raise ValueError(f"overlap={overlap!r}: use 'sparse' (the sparse FFNs' layers overlap) or "
                         "'all' (every layer overlaps)")
    return overlap == "all" or bool(sparse)


def handoff_rows(producer: Any, *, overlap: str = "sparse") -> TboRows:
    """The rows ``producer`` (an FFN declaration) hands its output on, from its ``sparse`` /
    ``next_sparse`` pair. A terminal producer hands on to the final norm: the batch's rows."""
    if producer is None or producer.kind is not StageKind.FFN:
        raise ValueError(
            f"handoff_rows() takes the FFN declaration that ends a layer (with its sparse and "
            f"next_sparse), got {producer!r}; for the stack's first layer use entry_rows()"
        )
    before = _overlaps(producer.sparse, overlap)
    after = not producer.terminal and _overlaps(producer.next_sparse, overlap)
    return _ROWS[before, after]


def entry_rows(first_ffn: Any, *, overlap: str = "sparse") -> TboRows:
    """The rows the stack's input (the batch's own rows) enters the first layer on."""
    return TboRows.SPLIT if _overlaps(first_ffn.sparse, overlap) else TboRows.BATCH


@dataclass(frozen=True)
class TboPlan:
    """Which layers of a (local) stack overlap, and the rows of every edge.

    ``edges[i]`` enters layer ``i``; ``edges[-1]`` leaves the last local layer. A pipeline
    partition starts from and ends on the batch's rows (``from_pp``/``to_pp`` carry one stream),
    so its first and last edges split and merge whatever its neighbours' declarations say.
    """

    overlap: str
    overlapped: tuple[bool, ...]
    edges: tuple[TboRows, ...]

    def describe(self) -> str:
        on = [i for i, o in enumerate(self.overlapped) if o]
        layers = ",".join(map(str, on)) if on else "none"
        return f"layers {layers} overlapped ({self.overlap}); handoff rows " + " > ".join(
            e.value for e in self.edges)


def plan_overlap(layers: LayerStack, *, overlap: str = "sparse") -> TboPlan:
    """The plan of decoder layers that each have ``attn_boundary`` and ``ffn_boundary``.

    Each layer's ``previous`` must describe the FFN before it with the same ``sparse`` and a
    ``next_sparse`` equal to this layer's own FFN: the two neighbours derive the edge's rows from
    that pair, and a disagreement would split or merge on one side only.
    """
    if not layers:
        raise ValueError("plan_overlap() needs at least one layer")
    ffns = [layer.ffn_boundary.declaration for layer in layers]
    overlapped = tuple(_overlaps(d.sparse, overlap) for d in ffns)
    edges = [TboRows.SPLIT if overlapped[0] else TboRows.BATCH]
    for i in range(1, len(layers)):
        prev = layers[i].attn_boundary.declaration.previous
        mine = ffns[i - 1]
        if prev is None or prev.kind is not StageKind.FFN or (prev.sparse, prev.next_sparse) != (
                mine.sparse, mine.next_sparse) or prev.next_sparse != ffns[i].sparse:
            got = "None" if prev is None else f"{prev.describe()} next_sparse={prev.next_sparse}"
            raise ValueError(
                f"layer {i}: previous= is {got}, but layer {i - 1}'s FFN is sparse={mine.sparse} "
                f"next_sparse={mine.next_sparse} and layer {i}'s FFN is sparse={ffns[i].sparse}; "
                "build previous= with the producing layer's own arguments, including next_sparse "
                "(the two-batch overlap rows of the edge derive from that pair)"
            )
        edges.append(handoff_rows(prev, overlap=overlap))
    edges.append(TboRows.MERGE if overlapped[-1] else TboRows.BATCH)
    return TboPlan(overlap, overlapped, tuple(edges))


# -- splitting a batch ---------------------------------------------------------------------------


def balanced_split(seq_lens: Sequence[int]) -> int:
    """How many leading sequences go to microbatch A so the two token counts are closest
    (ties give A more). One sequence goes whole to A, leaving B empty."""
    total = sum(seq_lens)
    best, best_k, prefix = None, 0, 0
    for k in range(len(seq_lens) + 1):
        gap = abs(2 * prefix - total)
        if best is None or gap <= best:
            best, best_k = gap, k
        if k < len(seq_lens):
            prefix += seq_lens[k]
    return best_k


@dataclass(frozen=True)
class TboSplit:
    """Where a batch splits: the first ``seq_index`` sequences of this rank's batch form
    microbatch A, the rest B.

    ``dp_num_tokens``: under attention DP, the rows of every DP group in microbatch A and in B
    (DP-rank order); each group splits its own sequences, and the FFN's row moves need all of
    them. ``trace``: a list the schedule appends ``(microbatch, layer, stage label)`` to.

    Every rank of a TP group must split the same way (the same ``seq_index`` of the same
    sequences): the microbatches' collectives are sized by their rows, and ranks that split
    differently issue collectives of different sizes (gloo aborts the process, NCCL hangs).
    Engines derive the split from the scheduler's batch, which every rank shares; with
    ``LAYER_BOUNDARY_CHECK_DP_COUNTS`` on, each microbatch's rows (``num_tokens``, or its DP row
    counts under attention DP) are compared across the TP group before its first collective.
    """

    seq_index: int
    dp_num_tokens: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None
    trace: Optional[list] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seq_index, int) or self.seq_index < 0:
            raise ValueError(f"TboSplit.seq_index={self.seq_index!r} must be a non-negative int")
        if self.dp_num_tokens is not None:
            a, b = (tuple(int(c) for c in part) for part in self.dp_num_tokens)
            if len(a) != len(b) or any(c < 0 for c in a + b):
                raise ValueError(f"TboSplit.dp_num_tokens={self.dp_num_tokens!r}: two tuples of "
                                 "non-negative row counts, one entry per DP group each")
            object.__setattr__(self, "dp_num_tokens", (a, b))

    @classmethod
    def balanced(cls, seq_lens_by_group: Sequence[Sequence[int]], dp_rank: int = 0, *,
                 trace: Optional[list] = None) -> "TboSplit":
        """Every DP group splits its sequences with ``balanced_split``; this rank's split, with
        every group's counts when there is more than one group."""
        ks = [balanced_split(lens) for lens in seq_lens_by_group]
        dp = None
        if len(seq_lens_by_group) > 1:
            a = tuple(sum(lens[:k]) for lens, k in zip(seq_lens_by_group, ks))
            b = tuple(sum(lens) - n for lens, n in zip(seq_lens_by_group, a))
            dp = (a, b)
        return cls(ks[dp_rank], dp, trace)


class SplittableBatch(Protocol):
    """What ``split_batch`` reads from a dataclass batch (``ForwardBatch`` has it)."""

    num_tokens: int
    seq_lens: Optional[tuple[int, ...]]
    positions: Any  # ForwardBatch.positions: a row-indexable positions tensor or None


_Batch = TypeVar("_Batch", bound=SplittableBatch)


def split_batch(forward_batch: _Batch, split: TboSplit,
                positions: Optional[torch.Tensor] = None) -> tuple[_Batch, _Batch]:
    """Two microbatch copies of ``forward_batch`` (a dataclass such as ``ForwardBatch``):
    rows, positions, sequence lengths and DP row counts of each part; no residual stream yet."""
    if not dataclasses.is_dataclass(forward_batch) or isinstance(forward_batch, type):
        raise TypeError(
            f"split_batch() builds microbatches by copying a dataclass batch (ForwardBatch); got "
            f"{type(forward_batch).__name__}. Build your engine's two microbatch objects yourself "
            "and pass them to split_stream()"
        )
    if getattr(forward_batch, "context_parallel", False):
        raise ValueError(
            "two-batch overlap with a context-parallel batch is not supported: TBO splits the batch "
            "at a sequence boundary, but a CP batch spreads every sequence's tokens over the CP group "
            "(its rows are not whole sequences); run CP prefill without tbo_split"
        )
    n = forward_batch.num_tokens
    lens = tuple(forward_batch.seq_lens) if forward_batch.seq_lens is not None else ((n,) if n else ())
    k = split.seq_index
    if k > len(lens):
        raise ValueError(f"TboSplit.seq_index={k} but this batch has {len(lens)} sequence(s)")
    na = sum(lens[:k])
    counts = getattr(forward_batch, "dp_num_tokens", None)
    if counts is not None:
        if split.dp_num_tokens is None:
            raise ValueError(
                "this batch runs under attention DP (dp_num_tokens is set) but the TboSplit has no "
                "dp_num_tokens; give every DP group's rows of each microbatch (TboSplit.balanced())"
            )
        a, b = split.dp_num_tokens
        if len(a) != len(counts) or any(x + y != c for x, y, c in zip(a, b, counts)):
            raise ValueError(f"TboSplit.dp_num_tokens {split.dp_num_tokens} do not add up to the "
                             f"batch's dp_num_tokens {tuple(counts)}")
    if positions is None:
        positions = forward_batch.positions
    parts = []
    for m, (lo, hi, seqs) in enumerate(((0, na, lens[:k]), (na, n, lens[k:]))):
        kw: dict[str, Any] = dict(
            num_tokens=hi - lo,
            positions=positions[lo:hi] if positions is not None else None,
            seq_lens=seqs or None,
            residual_stream=None,
        )
        if hi == lo:
            kw["mode"] = ForwardMode.IDLE
        if counts is not None:
            # The first row move checks this group's entry against num_tokens.
            kw["dp_num_tokens"] = split.dp_num_tokens[m]
        if any(f.name == "tbo_split" for f in dataclasses.fields(forward_batch)):
            kw["tbo_split"] = None  # a microbatch never splits again
        parts.append(dataclasses.replace(forward_batch, **kw))
    return parts[0], parts[1]


# -- splitting and merging streams ---------------------------------------------------------------


def _sliceable(stream: ResidualStream, c: Contribution) -> tuple[torch.Tensor, tuple]:
    """The contribution as a row-sliceable tensor and the sums it still owes.

    Sums are row-wise, so a partial output is cut as it is and each microbatch completes its
    own rows. A finalize handoff's payload has no generic row cut: its unfused finalize runs
    first. A transform may not be row-wise, and an input-scattered slice is not a microbatch's:
    those complete on the batch's rows first.
    """
    if c.transform is not None or stream.rows.sliced:
        return stream.rows.complete(c), ()
    value, owed = c.value, c.owed
    if isinstance(value, HandoffOutput):
        value = value.complete()
        owed = tuple(o for o in owed if o.kind is not OwedKind.FINALIZE)
        c.value, c.owed = value, owed
    return value, owed


def _not_plain(what: str, update: Any) -> BoundaryError:
    return BoundaryError(
        f"{what}: the pending update {update.name!r} is not a plain add; a nonlinear update's "
        "per-invocation state has no row cut, so two-batch overlap needs plain-add updates at its "
        "split and merge points"
    )


def _install(forward_batch: Any, stream: ResidualStream) -> None:
    old = getattr(forward_batch, "residual_stream", None)
    if old is not None and old is not stream:
        old.release()
    try:
        forward_batch.residual_stream = stream
    except AttributeError as e:
        raise TypeError(f"{type(forward_batch).__name__} has no settable residual_stream attribute; "
                        "the boundary owns that attribute of the engine's batch object") from e


def split_stream(hidden_states: Any, forward_batch: Any, children: Sequence[Any]) -> tuple[Handle, ...]:
    """Cut the batch's stream into one stream per microbatch (``ResidualStream.arrive()``);
    return each microbatch's handle. ``children`` cover the batch's rows in order.

    A written stream splits its residual; a pending one also its contribution, still owing its
    sums. The batch's stream is released (also when this raises): use the microbatches' streams
    until ``merge_streams()`` gives the batch a stream again.
    """
    stream = started_stream(forward_batch)
    try:
        if stream.branches:  # the microbatch streams would not carry a set-aside branch output
            from .branch import refuse_unmerged

            refuse_unmerged(stream, "split_stream()")
        sizes = [c.num_tokens for c in children]
        if sum(sizes) != forward_batch.num_tokens:
            raise ValueError(f"microbatches of {sizes} rows do not cover the batch's "
                             f"{forward_batch.num_tokens}")
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        if stream.state is StreamState.INITIAL:
            # The stack's input: each microbatch starts its own stream from its rows.
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"split_stream() on an initial stream takes the stack input tensor, "
                                f"got {type(hidden_states).__name__}")
            if hidden_states.shape[0] != forward_batch.num_tokens:
                raise ValueError(f"the stack input has {hidden_states.shape[0]} rows but the batch "
                                 f"has num_tokens={forward_batch.num_tokens}")
            handles: list[Handle] = []
            for child, lo, hi in zip(children, offsets, offsets[1:]):
                _install(child, ResidualStream())
                handles.append(hidden_states[lo:hi])
            return tuple(handles)
        stream.expect(hidden_states)
        if stream.next_update is not None:
            raise BoundaryError("split_stream() between a stage's read and its output; split where "
                                "a layer output is handed on")
        value, owed, update = None, (), None
        if stream.state is StreamState.PENDING:
            c = stream.pending
            assert c is not None
            if not c.update.plain_add:
                raise _not_plain("split_stream()", c.update)
            value, owed = _sliceable(stream, c)
            update = c.update
        # Cut the model's rows (an input-scattered slice is gathered to its group's first), then
        # each microbatch's stream takes its own rows of them (a slice of its own, scattered).
        rows = stream.rows
        residual = rows.to_model(stream.residual) if stream.residual is not None else None
        value = rows.to_model(value) if value is not None else None
        handles = []
        for child, lo, hi in zip(children, offsets, offsets[1:]):
            child_rows = rows.for_batch(child)
            r = child_rows.cut(residual[lo:hi]) if residual is not None else None
            v = child_rows.cut(value[lo:hi]) if value is not None else None
            s, h = ResidualStream.arrive(residual=r, output=v, update=update, owed=owed)
            assert h is not None  # a written or pending stream's microbatch arrives with a handle
            s.rows = child_rows
            s.borrowed = stream.borrowed and not rows.sliced  # views of the model's input still
            _install(child, s)
            handles.append(h)
        return tuple(handles)
    finally:
        stream.release()


def merge_streams(handles: Sequence[Handle], children: Sequence[Any], forward_batch: Any) -> Handle:
    """Join the microbatches' streams, in token order, into one stream on ``forward_batch``;
    return the handle to pass on. Each handle must be its own microbatch's last output (another
    microbatch's raises the spec's identity error). The microbatches' streams are released."""
    streams = [started_stream(c) for c in children]
    try:
        if len(handles) != len(streams):
            raise ValueError(f"merge_streams() got {len(handles)} outputs for {len(streams)} microbatches")
        for s, h in zip(streams, handles):
            s.expect(h)
        if any(s.next_update is not None for s in streams):
            raise BoundaryError("merge_streams() between a stage's read and its output; merge where "
                                "a layer output is handed on")
        if any(s.state is StreamState.INITIAL for s in streams):
            raise BoundaryError("merge_streams(): a microbatch ran no stage; merge after its layers")
        pending = [s.pending for s in streams]
        update, owed, values = None, (), None
        if all(c is not None for c in pending):
            for c in pending:
                if not c.update.plain_add:  # type: ignore[union-attr]
                    raise _not_plain("merge_streams()", c.update)  # type: ignore[union-attr]
            parts = [_sliceable(s, c) for s, c in zip(streams, pending)]  # type: ignore[arg-type]
            sig = {tuple((o.kind, o.group_name, o.static) for o in p[1]) for p in parts}
            if len(sig) > 1:  # the microbatches' exits decided differently: complete both
                parts = [(s.rows.complete(s.pending), ()) for s in streams]  # type: ignore[arg-type]
            values = [p[0] for p in parts]
            owed = parts[0][1]
            update = pending[0].update  # type: ignore[union-attr]
        elif any(c is not None for c in pending):
            # One written, one pending (their stages differed): fold so both are written.
            for s, c in zip(streams, pending):
                if c is not None:
                    if not c.update.plain_add:
                        raise _not_plain("merge_streams()", c.update)
                    s.consume()
                    s.write(c.update.apply(s.residual, s.rows.complete(c)))
        residuals = [s.residual for s in streams]
        if any(r is None for r in residuals) and not all(r is None for r in residuals):
            raise BoundaryError("merge_streams(): one microbatch has a residual and the other none")
        # Join on the model's rows, then cut the batch's rows of them (its slice, scattered).
        parts_of = [s.rows for s in streams]
        residual = (torch.cat([rows.to_model(r) for rows, r in zip(parts_of, residuals)])  # type: ignore[arg-type]
                    if residuals[0] is not None else None)
        value = torch.cat([rows.to_model(v) for rows, v in zip(parts_of, values)]) if values is not None else None
        rows = parts_of[0].for_batch(forward_batch)
        residual = rows.cut(residual) if residual is not None else None
        value = rows.cut(value) if value is not None else None
        merged, handle = ResidualStream.arrive(residual=residual, output=value, update=update, owed=owed)
        merged.rows = rows
        _install(forward_batch, merged)
        assert handle is not None
        return handle
    finally:
        for s in streams:
            s.release()


# -- the schedule --------------------------------------------------------------------------------

Stages = Generator[Any, None, Handle]


def interleave(stages: Sequence[Stages], trace: Optional[list] = None,
               at: Optional[Sequence[list[Any]]] = None) -> list[Handle]:
    """Run the generators in turn, one stage each per round, until all return; their results.

    Every rank runs the same order, so the collectives inside the stages pair up across ranks.
    ``trace`` receives ``(index, label)`` for each stage run (``(index, (at[index][0], label))``
    with ``at``, the runs' current layers). A stage that yields with an
    ``exit()`` scope still open (its flags still published) is refused: the other microbatch's
    compute would run under them.
    """
    flags = get_forward()
    results: list[Any] = [None] * len(stages)
    # A run ends through next()'s default and hands its result over through _collect: a traced
    # forward (torch.compile) cannot read StopIteration.value.
    # Traced, the results come from the streams instead (see _layer_run).
    runs = list(stages) if torch.compiler.is_compiling() else [_collect(g, results, m) for m, g in enumerate(stages)]
    live = list(range(len(stages)))
    try:
        while live:
            for m in list(live):
                before = flags.snapshot(), flags.open_scopes
                label = next(runs[m], _DONE)
                if label is _DONE:
                    live.remove(m)
                    continue
                if (flags.snapshot(), flags.open_scopes) != before:
                    raise BoundaryError(
                        f"microbatch {m} yielded at {label!r} inside an exit() scope ({flags!r}); "
                        "do not hold an exit() scope open across a two-batch-overlap yield point: "
                        "finish the output before yielding, or run the FFN operation-scheduled "
                        "(no scope, then boundary.postprocess())"
                    )
                if trace is not None:
                    trace.append((m, label) if at is None else (m, (at[m][0], label)))
    finally:
        for g in stages:
            g.close()
    return results


_DONE = object()  # the end of a run, as next()'s default


def _collect(run: Stages, results: list[Any], m: int) -> Generator[Any, None, None]:
    results[m] = yield from run


def _layer_run(layers: Iterable[tuple[int, Any]], positions: Any, hidden: Any, fb: Any,
               at: list[Any]) -> Stages:
    """The layers' stages in order; ``at[0]`` is the index of the layer whose stage ran last."""
    traced = torch.compiler.is_compiling()
    for i, layer in layers:
        at[0] = i
        if traced:
            # Traced, a generator's return value is lost (Dynamo gives None for `yield from`, and
            # torch 2.11 cannot trace `yield from` at all, nor read StopIteration.value). A layer's
            # result is the handle its last boundary call left on the stream: the next prepare()
            # refuses anything else.
            for label in layer.forward_stages(positions, hidden, fb):
                yield label
            hidden = fb.residual_stream.handle
        else:
            hidden = yield from layer.forward_stages(positions, hidden, fb)
    return hidden


def model_forward_stages(layers: LayerStack, positions: torch.Tensor, hidden_states: Any,
                         forward_batch: Any, *, split: TboSplit, plan: TboPlan) -> Handle:
    """Run ``layers`` with two-batch overlap where ``plan`` says, one stream per microbatch;
    return the handle to pass on, on ``forward_batch``'s own stream.

    A layer that does not overlap runs its ordinary ``forward`` on the whole batch. Each run of
    overlapping layers splits the batch once, interleaves the two microbatches' stages across
    all of its layers and merges once.
    """
    if len(plan.overlapped) != len(layers):
        raise ValueError(f"the TboPlan covers {len(plan.overlapped)} layers, the stack has {len(layers)}")
    i, n = 0, len(layers)
    while i < n:
        if not plan.overlapped[i]:
            hidden_states = layers[i](positions, hidden_states, forward_batch)
            i += 1
            continue
        j = i
        while j < n and plan.overlapped[j]:
            j += 1
        children = split_batch(forward_batch, split, positions)
        parts = split_stream(hidden_states, forward_batch, children)
        at: list[list[Any]] = [[None] for _ in children]
        runs = [_layer_run([(k, layers[k]) for k in range(i, j)], child.positions, part, child, where)
                for child, part, where in zip(children, parts, at)]
        trace: Optional[list] = None if split.trace is None else []
        outs = interleave(runs, trace, at)
        if torch.compiler.is_compiling():  # the runs' results are lost when traced: see _layer_run
            outs = [child.residual_stream.handle for child in children]
        if trace is not None:
            split.trace.extend((m, layer, label) for m, (layer, label) in trace)  # type: ignore[union-attr]
        hidden_states = merge_streams(outs, children, forward_batch)
        i = j
    return hidden_states
