"""Model-stack entry and exit, and the accessors a model uses between boundaries.

Every helper takes the value the last boundary call returned and returns the value the model
keeps next; the stream refuses any other object.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn

from .._adapters.branch import refuse_unmerged
from .._errors import SNAPSHOT_PLAIN, WRITE_BEFORE_TAKE, BoundaryError
from .._forward import ForwardBatchLike, active_variant
from .._layout import BatchVariant
from .._output import UnreducedOutput
from .._pp import PP_META, to_pp
from . import ReadInput, ReadSpec, StageRead, StageUpdate
from ._access import check_shape
from ._add_norm import ADD_NORM, PLAIN_ADD, ModuleRead, RMSNormRead, explain_width
from ._stream import Handle, ResidualStream, StreamState, start, started_stream

if TYPE_CHECKING:
    from .._capture import CaptureCallback
    from .._context import BoundaryContext

__all__ = [
    "bind_final_norm",
    "start",
    "norm",
    "to_pp",
    "PP_META",
    "fold",
    "written",
    "take_output",
    "complete_output",
    "snapshot",
    "add_to_output",
]

# Final norms are bound to a read once, not per forward. The bound read lives on the norm module
# itself (a read refers back to its norm, so a weak-keyed cache would keep every norm alive).
_READ_ATTR = "_layer_boundary_final_read"


def _read_for(module: nn.Module) -> StageRead:
    read = module.__dict__.get(_READ_ATTR)
    if read is None:
        read = ADD_NORM.bind(module)
        module.__dict__[_READ_ATTR] = read
    return read


def _check_exit_read(read: StageRead, update: StageUpdate, value: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """A scheme whose residual is wider than the layer output (MHC's [T, n, C] streams) needs its
    own exit read to contract it; the plain read would normalize every stream and return the
    residual's shape instead of the hidden rows, without any error."""
    if (residual is None or update.plain_add or not isinstance(read, (RMSNormRead, ModuleRead))
            or residual.shape[1:] == value.shape[1:]):
        return
    raise BoundaryError(
        f"the final norm reads through the plain add+norm, but the last stage's update {update.name!r} "
        f"keeps a residual of shape {tuple(residual.shape)} against the layer output's "
        f"{tuple(value.shape)}: the residual scheme's exit read must contract it. Bind it at model "
        "construction: final = semantics.exit(hidden_size, dtype=dtype); "
        "residual_batch.bind_final_norm(norm, context=context, read=final.read)"
    )


def bind_final_norm(layernorm: nn.Module, *, context: Optional[BoundaryContext] = None,
                    read: Optional[ReadSpec] = None) -> StageRead:
    """Bind the final norm's read at model construction.

    ``context`` selects its kernels (and records the choice in the selection report); ``read``
    is a read kind other than the plain add+norm (for example an MHC exit that contracts the
    expanded residual). Without this call ``norm()`` binds the torch reference on first use.
    """
    spec = read if read is not None else ADD_NORM
    select = context.kernel_selector("final norm", "ORDINARY") if context is not None else None
    bound = spec.bind(layernorm, select)
    layernorm.__dict__[_READ_ATTR] = bound
    return bound


def norm(
    hidden_states: Handle,
    forward_batch: ForwardBatchLike,
    layernorm: nn.Module,
    *,
    skip_empty: bool = False,
    capture_output: Optional[CaptureCallback] = None,
    handoff_norm: Any = None,
) -> torch.Tensor:
    """Final norm: complete owed work, apply the update, normalize; then release the stream.

    ``skip_empty`` still completes owed work on an empty batch (other ranks may be waiting in
    that collective) and skips only the norm kernel. ``capture_output`` receives the updated
    residual, borrowed. ``handoff_norm`` fuses a finalize handoff with all-reduce, add and norm
    through ``handoff_norm.finalize(handoff, residual, gamma)`` (a plain-add update without an
    output transform; otherwise, or without ``handoff_norm``, the handoff completes unfused first).
    """
    stream = started_stream(forward_batch)
    # An input-scattered stack holds a row slice per attention-TP rank; the output is gathered
    # back to the group's rows so the model's head sees the rows its stack started with.
    rows = stream.rows
    with _released_unless_refused(stream), _width_explained(stream, layernorm, hidden_states):
        _refuse_open_branches(stream, "norm()")
        read = _read_for(layernorm)
        state = stream.state
        if state is StreamState.INITIAL:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"norm() expects a tensor, got {type(hidden_states).__name__}")
            residual: Optional[torch.Tensor] = hidden_states
            out: Optional[ReadInput] = None
        else:
            stream.expect(hidden_states)
            if state is StreamState.WRITTEN:
                residual, out = stream.residual, None
            else:
                c = stream.pending
                assert c is not None
                # The fused finalize adds to the residual itself: only a plain add with no output
                # transform to run first may take it; anything else completes unfused below.
                handoff = (rows.fusable_handoff(c) if handoff_norm is not None and c.update.plain_add
                           else None)
                if handoff is not None:
                    if capture_output is not None:
                        raise BoundaryError(
                            "norm() cannot capture_output when a finalize handoff arrives with "
                            "handoff_norm: the fused finalize never materializes the residual. "
                            "Drop handoff_norm to complete the handoff unfused and capture"
                        )
                    gamma = getattr(layernorm, "gemma_weight", None)
                    if gamma is None:
                        raise TypeError(
                            f"handoff_norm fuses a Gemma RMSNorm and reads layernorm.gemma_weight; "
                            f"{type(layernorm).__name__} has none. Use a GemmaRMSNorm final norm "
                            "or drop handoff_norm"
                        )
                    stream.consume()
                    finalized: torch.Tensor = handoff_norm.finalize(
                        handoff, stream.writable_residual(fused=True), gamma)
                    if not handoff.completed:
                        handoff.mark_consumed()  # the service ran the finalize: never again
                    return finalized
                stream.consume()
                value = rows.complete(c)
                if stream.residual is not None and c.update.plain_add:
                    # A nonlinear update may own a residual of another shape (MHC streams).
                    check_shape("the layer output", value, stream.residual)
                _check_exit_read(read, c.update, value, stream.residual)
                if skip_empty and value.shape[0] == 0:
                    residual = c.update.apply(stream.residual, value)
                    out = value
                else:
                    # [:2]: a read that makes updates also returns one; the stack ends here.
                    out, residual = read.update_and_read(c.update, value, stream.writable_residual(read))[:2]
        assert residual is not None
        if capture_output is not None:
            # On the rows the model sees (gathered from the slices of an input-scattered batch);
            # borrowed in every case, as the spec promises for the final norm.
            capture_output(rows.to_model(residual), owned=False)
        if out is None:
            if skip_empty and residual.shape[0] == 0:
                out = residual
            else:
                out = read.read(residual)
                if getattr(read, "makes_update", False):
                    out = out[0]
        if not isinstance(out, torch.Tensor):
            # A quantized read (QuantizedRows) feeds a quantized matmul; the final norm feeds the
            # model's head, in the activation dtype.
            raise BoundaryError(
                f"the final norm's read {read!r} returned {type(out).__name__}, not a tensor: bind the "
                "final norm with an unquantized read")
        return rows.to_model(out)


@contextlib.contextmanager
def _released_unless_refused(stream: ResidualStream) -> Iterator[None]:
    """Release the stream when the body returns, or when it fails after changing the stream; a
    refusal before any change leaves the stream as it was, so the corrected retry works (a
    released stream would answer it with "start the layer stack before entering a stage")."""
    before = (stream.pending, stream.handle, stream.residual)
    try:
        yield
    except BaseException:
        if any(a is not b for a, b in zip(before, (stream.pending, stream.handle, stream.residual))):
            stream.release()
        raise
    stream.release()


@contextlib.contextmanager
def _width_explained(stream: ResidualStream, layernorm: nn.Module, hidden_states: Any) -> Iterator[None]:
    """A kernel's shape error in the final norm says which width disagrees."""
    try:
        yield
    except RuntimeError as e:
        if not isinstance(e, BoundaryError):
            width_of = stream.residual if isinstance(stream.residual, torch.Tensor) else hidden_states
            explain_width("the final norm", _read_for(layernorm), width_of, e)
        raise


def fold(hidden_states: Handle, forward_batch: ForwardBatchLike) -> torch.Tensor:
    """Complete a pending contribution and fold it into the residual (stream becomes written).

    Returns the residual, which is the value to pass on.
    """
    stream = started_stream(forward_batch)
    state = stream.state
    if state is StreamState.INITIAL:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"fold() expects a tensor, got {type(hidden_states).__name__}")
        _refuse_scattered_start("fold", forward_batch)
        stream.write(hidden_states, hidden_states)
        return hidden_states
    stream.expect(hidden_states)
    if state is StreamState.WRITTEN:
        assert isinstance(hidden_states, torch.Tensor)  # a written stream hands out its tensor
        return hidden_states
    c = stream.consume()
    rows = stream.rows
    residual = c.update.apply(stream.residual, rows.complete(c))
    # An input-scattered residual stays on this rank's slice; the model gets the group's rows.
    out = rows.to_model(residual)
    stream.write(residual, out)
    return out


def written(hidden_states: torch.Tensor, forward_batch: ForwardBatchLike) -> torch.Tensor:
    """Replace the stream with a written one whose residual is ``hidden_states``.

    Any pending contribution is discarded: call ``fold()`` first when one may be pending.
    """
    stream = started_stream(forward_batch)
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(
            f"written() takes the full residual tensor compute produced, got {type(hidden_states).__name__}"
        )
    if stream.state is StreamState.INITIAL:
        _refuse_scattered_start("written", forward_batch)
    stream.write(stream.rows.to_stream(hidden_states), hidden_states)
    return hidden_states


def take_output(hidden_states: Handle, forward_batch: ForwardBatchLike) -> torch.Tensor:
    """Release the stream at a terminal exit whose output is already written; return it."""
    stream = started_stream(forward_batch)
    with _released_unless_refused(stream):
        _refuse_open_branches(stream, "take_output()")
        if stream.state is StreamState.INITIAL:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"take_output() expects a tensor, got {type(hidden_states).__name__}")
            return hidden_states
        stream.expect(hidden_states)
        if stream.state is StreamState.PENDING:
            raise BoundaryError(WRITE_BEFORE_TAKE)
        assert stream.residual is not None
        return stream.rows.to_model(stream.residual)


def complete_output(hidden_states: Handle, forward_batch: ForwardBatchLike) -> Handle:
    """Finish outstanding communication/finalize work; the residual update stays pending.

    Returns the complete contribution tensor (a new handle; the old one is stale).
    """
    stream = started_stream(forward_batch)
    stream.expect(hidden_states)
    if stream.state is StreamState.WRITTEN:
        return hidden_states
    c = stream.pending
    assert c is not None
    stream.rows.complete(c)
    return stream.rehand()


def snapshot(hidden_states: Handle, forward_batch: ForwardBatchLike) -> torch.Tensor:
    """An owned copy of the updated residual; owed sums run on a copy, the stream is unchanged."""
    stream = started_stream(forward_batch)
    stream.expect(hidden_states)
    rows = stream.rows
    if stream.state is StreamState.WRITTEN:
        assert stream.residual is not None
        return rows.model_copy(stream.residual)
    c = stream.pending
    assert c is not None
    if c.is_handoff:
        raise BoundaryError(
            "snapshot() cannot run on a finalize handoff; call residual_batch.complete_output() "
            "first, which runs the producer's unfused finalize"
        )
    if not c.update.plain_add:
        raise BoundaryError(SNAPSHOT_PLAIN)
    snap = c.update.apply(stream.residual, rows.completed_copy(c))
    return rows.model_copy(snap, fresh=snap is not c.value)


def add_to_output(hidden_states: Handle, forward_batch: ForwardBatchLike, extra: torch.Tensor) -> Handle:
    """Complete the contribution, then add ``extra`` to it once; the update stays pending.

    On a written stream ``extra`` becomes the pending contribution (added by a plain add).
    """
    stream = started_stream(forward_batch)
    stream.expect(hidden_states)
    if not isinstance(extra, torch.Tensor):
        raise TypeError(f"add_to_output() extra must be a tensor, got {type(extra).__name__}")
    # ``extra`` has the model's rows; an input-scattered residual takes this rank's slice of it.
    rows = stream.rows
    if stream.state is StreamState.WRITTEN:
        assert stream.residual is not None
        mine = rows.to_stream(extra)
        check_shape("extra", mine, stream.residual)
        stream.handle = None
        return stream.leave(_plain(mine if mine is not extra else extra.clone()))
    c = stream.pending
    assert c is not None
    mine = rows.to_stream(extra)
    value = rows.complete(c)
    check_shape("extra", mine, value)
    c.value = value + mine
    return stream.rehand()


def _refuse_open_branches(stream: ResidualStream, what: str) -> None:
    """Leaving the stack would drop a branch output set aside and never merged."""
    if stream.branches:
        refuse_unmerged(stream, what)


def _refuse_scattered_start(what: str, forward_batch: ForwardBatchLike) -> None:
    """An input-scattered residual is a row slice that only a stage's prepare() can cut."""
    variant = active_variant(forward_batch)
    if variant in (BatchVariant.INPUT_SCATTERED, BatchVariant.SEQUENCE_PARALLEL):
        name = "an input-scattered" if variant is BatchVariant.INPUT_SCATTERED else "a sequence-parallel"
        raise BoundaryError(
            f"{what}() on an initial stream of {name} batch: the residual of this "
            "variant is a row slice per attention-TP rank, which the first stage's prepare() cuts; "
            "enter the stack through that prepare() first"
        )


def _plain(value: torch.Tensor) -> UnreducedOutput:
    return UnreducedOutput(value, PLAIN_ADD)
