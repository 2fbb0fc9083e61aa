"""Execute a stage's input preparation: check, complete owed work, update, read, move rows."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .construction import EntryPath, StagePlan
from .contracts import OwedKind
from .layout import SumGroup
from .errors import BoundaryError
from .output import Contribution, HandoffOutput, fusable_handoff
from .residual.access import check_shape, complete
from .residual.stream import Handle, ResidualStream, StreamState
from .rows import move_input

__all__ = ["run_entry", "check_edge", "publish"]

Capture = Callable[..., Any]


def check_edge(plan: StagePlan, entry: EntryPath, c: Contribution) -> None:
    """Refuse a contribution the incoming edge was not built for, before any collective runs."""
    if not c.owed and (entry.expected_update is None or c.update.name == entry.expected_update):
        return
    if entry.expected_update is not None and c.update.name != entry.expected_update:
        raise BoundaryError(
            f"{plan.name} stage input was built for a producer update {entry.expected_update!r} but "
            f"the pending contribution carries {c.update.name!r}; make previous= describe the real "
            "producer (the same declaration arguments it uses)"
        )
    for owed in c.owed:
        key = (owed.kind, owed.group_name)
        if key not in entry.accepts:
            built = ", ".join(f"{k.value}:{g.name if g else '-'}" for k, g in sorted(
                entry.accepts, key=lambda x: (x[0].value, x[1].name if x[1] else ""))) or "nothing"
            raise BoundaryError(
                f"the pending contribution owes {owed.describe()}, but this {plan.name} stage's input "
                f"was built to complete only [{built}]; previous= does not describe the real "
                "producer, which would reduce twice or not at all"
            )


def _fusable(c: Contribution) -> Any:
    """What a consumer candidate may complete: a single owed sum of a tensor with no transform
    (the tensor), or a finalize handoff with at most one sum after it (the handoff)."""
    if len(c.owed) == 1 and c.owed[0].kind is OwedKind.SUM and c.transform is None \
            and isinstance(c.value, torch.Tensor):
        return c.value
    return fusable_handoff(c)


def _try_candidates(entry: EntryPath, c: Contribution, value: Any, residual: Any, read: Any,
                    forward_batch: Any) -> Any:
    if c.update.name not in read.fuses_with:
        return None
    if isinstance(value, HandoffOutput):
        # Finalize candidates sum what the handoff records it owes (owed_sum), or nothing.
        for cand in entry.candidates:
            if getattr(cand, "takes_handoff", False):
                out = _call_candidate(cand, value, residual, read, forward_batch)
                if out is not None:
                    return out
        return None
    owed_group = c.owed[0].group_name
    for cand in entry.candidates:
        # A candidate completes the sum group it declares, and no other.
        if getattr(cand, "takes_handoff", False) or getattr(cand, "sum_group", owed_group) not in (owed_group, None):
            continue
        out = _call_candidate(cand, value, residual, read, forward_batch)
        if out is not None:
            return out
    return None


def _call_candidate(cand: Any, *args: Any) -> Any:
    """A consumer candidate's call; what it raises is named after it. It is not replaced: a
    candidate may have started a collective the other ranks are in, so a rerun could pair wrong."""
    try:
        return cand(*args)
    except Exception as e:
        e.add_note(f"raised by the consumer fusion candidate {getattr(cand, 'name', cand)!r} "
                   f"({type(cand).__module__}.{type(cand).__qualname__}); if its plugin is at fault, "
                   "LAYER_BOUNDARY_DISABLE=<plugin> leaves it out (layer-boundary plugins lists them)")
        raise


# A read with makes_update returns, beside its input, the update this stage's output will use
# (per-invocation coefficients, e.g. MHC): it travels with the stream, not the layer. These
# three give every read the (input, residual, update) form.
def _enter(read: Any, hidden: torch.Tensor) -> tuple[Any, Any, Any]:
    out = read.enter(hidden)
    return out if getattr(read, "makes_update", False) else (out[0], out[1], None)


def _aliases(residual: Any, hidden: Any) -> bool:
    """Whether the residual an entry made is (a view of) the model's input tensor."""
    return (isinstance(residual, torch.Tensor) and isinstance(hidden, torch.Tensor)
            and residual.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr())


def _reread(read: Any, residual: Any) -> tuple[Any, Any]:
    out = read.read(residual)
    return out if getattr(read, "makes_update", False) else (out, None)


def _update_read(read: Any, update: Any, value: Any, residual: Any) -> tuple[Any, Any, Any]:
    out = read.update_and_read(update, value, residual)
    return out if getattr(read, "makes_update", False) else (out[0], out[1], None)


def run_entry(
    plan: StagePlan,
    entry: EntryPath,
    stream: ResidualStream,
    hidden: Any,
    capture: Optional[Capture] = None,
    collector: Any = None,
    forward_batch: Any = None,
) -> torch.Tensor:
    """Return the compute input and leave the stream written with the updated residual."""
    read = plan.read
    if entry.dp_gather is not None:
        return _dp_entry(plan, entry, stream, hidden, forward_batch)
    if entry.scatter is not None:
        return _scattered_entry(plan, entry, stream, hidden, capture, collector, forward_batch)
    if entry.cp is not None:
        from .cp import run_cp_entry

        return run_cp_entry(plan, entry, stream, hidden, capture, collector, forward_batch)
    state = stream.state
    upd = None
    if state is StreamState.INITIAL:
        if plan.declaration.previous is not None:
            raise BoundaryError(
                f"{plan.name} stage was built with previous={plan.declaration.previous.describe()} "
                "but the residual stream is initial; only the stack's first stage (previous=None) "
                "starts the residual, and a pipeline receiver calls from_pp() first"
            )
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"stack entry expects the embedding output tensor, got {type(hidden).__name__}")
        if not hidden.is_floating_point():  # the residual would be that dtype: norms rounded to it
            raise TypeError(f"stack entry expects floating-point hidden states (the embedding output), got "
                            f"{hidden.dtype}; embed the token ids first")
        rows = getattr(forward_batch, "num_tokens", None)
        if isinstance(rows, int) and (hidden.shape[0] != rows or hidden.dim() != 2):
            # Unchecked, a model that runs on one rank fails only under TP (in its attention, or
            # a collective): a [batch, seq, hidden] tensor, or rows num_tokens does not count.
            from .rows import check_rows

            if hidden.dim() != 2 and hidden.shape[0] == rows:
                raise BoundaryError(f"the stack input has shape {tuple(hidden.shape)}: boundaries move token "
                                    "rows, [tokens, hidden]; flatten it with x.view(-1, x.shape[-1])")
            check_rows(hidden, rows, "the stack input", "ForwardBatch.num_tokens is",
                       "give one row per token of this rank's batch (num_tokens counts them)")
        # (A CP batch's ranks hold different rows by design: its split is checked instead.)
        if plan.topology.tp.size > 1 and plan.topology.attn_dp.size == 1 and forward_batch is not None \
                and not getattr(forward_batch, "context_parallel", False):
            from .rows import check_counts_agree

            check_counts_agree((forward_batch.num_tokens,), plan.topology, dp=False)
        if capture is not None:
            capture(hidden, owned=False)  # the residual aliases the model's own input
        x, residual, upd = _enter(read, hidden)
    else:
        stream.expect(hidden, plan.name)
        if state is StreamState.WRITTEN:
            residual = stream.residual
            assert residual is not None
            x, upd = _reread(read, residual)
        else:
            c = stream.pending
            assert c is not None
            check_edge(plan, entry, c)
            stream.consume()
            # A capture completes the owed sum unfused (the spec's rule): a fused kernel may
            # never materialize the updated residual outside its communication buffers.
            fusable = _fusable(c) if entry.candidates and capture is None else None
            residual = stream.writable_residual(read, fused=fusable is not None)
            if fusable is not None:
                fused = _try_candidates(entry, c, fusable, residual, read, forward_batch)
                if fused is not None:
                    x, residual = fused  # only reads without makes_update fuse
                    if capture is not None:
                        capture(residual, owned=entry.capture_owned)
                    stream.write(residual)
                    if collector is not None:
                        collector.capture(residual, owned=entry.capture_owned)
                    return x
            was_handoff = c.is_handoff
            value = complete(c)
            if was_handoff and stream.residual is not None and c.update.plain_add:
                check_shape("the finalized layer output", value, stream.residual)
            x, residual, upd = _update_read(read, c.update, value, residual)
        if capture is not None:
            capture(residual, owned=entry.capture_owned)
    stream.write(residual)
    stream.borrowed = state is StreamState.INITIAL and _aliases(residual, hidden)
    stream.next_update = upd
    if collector is not None:
        # At stack entry the residual is the model's own input tensor: never owned.
        collector.capture(residual, owned=entry.capture_owned and state is not StreamState.INITIAL)
    return x


def publish(plan: StagePlan, stream: ResidualStream, value: Any, owed: tuple, *,
            transformed: bool = False) -> Handle:
    """Hand a producer output to the stream (or apply an ``at_producer`` update right away).

    ``transformed``: the declared output transform was already applied to ``value``.
    """
    if stream.state is StreamState.INITIAL:
        raise BoundaryError(
            f"{plan.name} stage output was published before any stage read the residual; call "
            "prepare() before compute and finish() after it"
        )
    transform = None if transformed else plan.declaration.output_transform
    update = stream.next_update or plan.update
    # Input-scattered outputs sit on the group's rows while the residual holds a slice.
    if update.plain_add and isinstance(value, torch.Tensor) and stream.residual is not None \
            and stream.pending is None:
        if stream.scatter_rows is None:
            check_shape(f"the {plan.name} output", value, stream.residual)
        if value.dtype != stream.residual.dtype and (
                not value.is_floating_point()
                or torch.promote_types(value.dtype, stream.residual.dtype) != stream.residual.dtype):
            # A narrower output is the FP32-residual layout (bf16 compute, an FP32 stream: the
            # next read returns bf16). A wider or integer one is a mistake: the add rounds it to
            # the residual's dtype, but the next read's input keeps the output's, and the model's
            # next matmul fails on it far from here (an integer output is added silently).
            raise TypeError(
                f"the {plan.name} output is {str(value.dtype).replace('torch.', '')} but the residual is "
                f"{str(stream.residual.dtype).replace('torch.', '')} (the stack input's dtype): return the layer "
                f"output in the model's compute dtype, e.g. out.to({stream.residual.dtype})")
    if update.at_producer:
        stream.check_free()
        c = Contribution(value, update, owed, transform)
        residual = update.apply(stream.residual, complete(c))
        stream.write(residual, residual)
        return residual
    handle = stream.leave_parts(value, update, owed, transform)
    stream.next_update = None
    return handle


def owes_finalize(owed: tuple) -> bool:
    return any(o.kind is OwedKind.FINALIZE for o in owed)


def dp_rows(stream: ResidualStream, plan: StagePlan, forward_batch: Any) -> Any:
    """The batch's DP row bookkeeping, built once per stream (once per forward or microbatch)."""
    rows = stream.dp_rows
    if rows is None:
        from .rows import DpRows, check_counts_agree

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


def _joinable(c: Contribution, entry: EntryPath) -> bool:
    return (
        c.update.plain_add and c.transform is None and isinstance(c.value, torch.Tensor)
        and all(o.kind is OwedKind.SUM and o.group_name is SumGroup.ATTN_TP for o in c.owed)
    )


def _dp_entry(plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any, forward_batch: Any) -> torch.Tensor:
    """FFN input under attention DP: every group's rows, normalized, on every rank."""
    rows = dp_rows(stream, plan, forward_batch)
    read = plan.read
    if entry.dp_gather == "join" and stream.state is StreamState.PENDING:
        stream.expect(hidden, plan.name)
        c = stream.pending
        assert c is not None
        check_edge(plan, entry, c)
        if _joinable(c, entry):
            stream.consume()
            residual_all = rows.joined_sum(c.value, stream.residual, partial=bool(c.owed))
            x_all = read.read(residual_all)
            stream.write(rows.take_local(residual_all))
            return x_all
    assert entry.local is not None
    x_local = run_entry(plan, entry.local, stream, hidden, None, None, forward_batch)
    return move_input(rows.gather, x_local)



def scatter_rows(stream: ResidualStream, plan: Any, forward_batch: Any) -> Any:
    """The input-scattered row bookkeeping of this batch, built once per stream."""
    rows = stream.scatter_rows
    if rows is None:
        from .rows import ScatterRows, check_counts_agree

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
        stream.scatter_rows = rows
    return rows


def complete_scattered(c: Contribution, rows: Any) -> torch.Tensor:
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


def _scattered_entry(plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any,
                     capture: Optional[Capture], collector: Any, forward_batch: Any) -> torch.Tensor:
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
        x, residual, upd = _enter(read, rows.my_slice(hidden))
    else:
        stream.expect(hidden, plan.name)
        if state is StreamState.WRITTEN:
            x, upd = _reread(read, stream.residual)
            residual = stream.residual
        else:
            c = stream.pending
            assert c is not None
            check_edge(plan, entry, c)
            stream.consume()
            value = complete_scattered(c, rows)
            residual = stream.writable_residual(read)
            x, residual, upd = _update_read(read, c.update, value, residual)
        if capture is not None or collector is not None:
            # Both want the group's rows (the producer's rows, and the attention's compute-input
            # rows after its gather): one gather, which allocates, serves both.
            mine = rows.gather_group(residual)
            if capture is not None:
                capture(mine, owned=True)
            if collector is not None:
                collector.capture(mine, owned=True)
    stream.write(residual)
    stream.borrowed = state is StreamState.INITIAL and _aliases(residual, hidden)
    stream.next_update = upd
    if entry.scatter == "group":
        return move_input(rows.gather_group, x)
    return move_input(rows.gather_all, x)
