"""The entry of a stage on this rank's rows: check the edge, complete owed work (or let a
consumer fusion candidate complete it), apply the update and read the stage input.

Every batch variant's entry runs this read; what a variant adds (moving rows before or after it)
is its ``BatchRows`` (see ``batch_rows``), bound to the stage's plan at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch

from ._edges import check_edge
from ._errors import BoundaryError, add_note
from ._output import Contribution, HandoffOutput, fusable_handoff
from ._contracts import OwedKind
from .residual._access import check_shape, complete
from .residual._stream import ResidualStream, StreamState
from ._rows import check_rows

if TYPE_CHECKING:
    from ._plan import EntryPath, StagePlan

__all__ = ["run_entry", "enter_read", "reread", "update_read", "aliases"]

Capture = Callable[..., Any]


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
        add_note(e, f"raised by the consumer fusion candidate {getattr(cand, 'name', cand)!r} "
                    f"({type(cand).__module__}.{type(cand).__qualname__}); if its plugin is at fault, "
                    "LAYER_BOUNDARY_DISABLE=<plugin> leaves it out (layer-boundary plugins lists them)")
        raise


# A read with makes_update returns, beside its input, the update this stage's output will use
# (per-invocation coefficients, e.g. MHC): it travels with the stream, not the layer. These
# three give every read the (input, residual, update) form.
def enter_read(read: Any, hidden: torch.Tensor) -> tuple[Any, Any, Any]:
    out = read.enter(hidden)
    return out if getattr(read, "makes_update", False) else (out[0], out[1], None)


def aliases(residual: Any, hidden: Any) -> bool:
    """Whether the residual an entry made is (a view of) the model's input tensor."""
    if torch.compiler.is_compiling():
        # A traced graph cannot read storage pointers; assuming an alias only makes the stream
        # copy before its first in-place write, which gives the same numbers.
        return isinstance(residual, torch.Tensor)
    return (isinstance(residual, torch.Tensor) and isinstance(hidden, torch.Tensor)
            and residual.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr())


def reread(read: Any, residual: Any) -> tuple[Any, Any]:
    out = read.read(residual)
    return out if getattr(read, "makes_update", False) else (out, None)


def update_read(read: Any, update: Any, value: Any, residual: Any) -> tuple[Any, Any, Any]:
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
    """Return the compute input on this rank's rows and leave the stream written with the
    updated residual."""
    read = plan.read
    c = stream.pending
    if c is None:
        return _enter_unowed(plan, entry, stream, hidden, capture, collector, forward_batch)
    # PENDING, the path of every layer: the stream's transitions (consume, write) and the
    # common cases of its checks are inlined; each check's full form runs when its fast test fails.
    if hidden is not stream.handle or hidden is None:
        stream.expect(hidden, plan.name)
    if c.owed or (entry.expected_update is not None and c.update.name != entry.expected_update):
        check_edge(plan, entry, c)
    stream.pending = stream.handle = None  # consumed
    # A capture completes the owed sum unfused (the spec's rule): a fused kernel may
    # never materialize the updated residual outside its communication buffers.
    fusable = _fusable(c) if entry.candidates and capture is None else None
    residual = stream.writable_residual(read, fused=fusable is not None) if stream.borrowed else stream.residual
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
    value = c.value
    if c.owed or c.transform is not None or type(value) is not torch.Tensor:
        was_handoff = isinstance(value, HandoffOutput)
        value = complete(c)
        if was_handoff and stream.residual is not None and c.update.plain_add:
            check_shape("the finalized layer output", value, stream.residual)
    # Inlined (not update_read): this runs once per stage per forward, and the helper's call is
    # a measurable share of the boundary's host cost.
    out = read.update_and_read(c.update, value, residual)
    if plan.read_makes_update:  # the read's protocol types only the two-value form
        x, residual, upd = cast("tuple[Any, Any, Any]", out)
    else:
        x, residual, upd = out[0], out[1], None
    if capture is not None:
        capture(residual, owned=entry.capture_owned)
    stream.residual = residual  # written
    stream.borrowed = False
    stream.next_update = upd
    if collector is not None:
        collector.capture(residual, owned=entry.capture_owned)
    return x


def _enter_unowed(plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any,
                  capture: Optional[Capture], collector: Any, forward_batch: Any) -> torch.Tensor:
    """``run_entry`` on a stream with nothing pending: the stack entry, or a re-read."""
    read = plan.read
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
        if hidden.dim() < 2:
            raise BoundaryError(f"the stack input has shape {tuple(hidden.shape)}: boundaries move token "
                                "rows, [tokens, hidden]; pass the embedding output, one row per token")
        rows = getattr(forward_batch, "num_tokens", None)
        if isinstance(rows, int) and (hidden.shape[0] != rows or hidden.dim() != 2):
            # Unchecked, a model that runs on one rank fails only under TP (in its attention, or
            # a collective): a [batch, seq, hidden] tensor, or rows num_tokens does not count.
            if hidden.dim() != 2 and hidden.shape[0] == rows:
                raise BoundaryError(f"the stack input has shape {tuple(hidden.shape)}: boundaries move token "
                                    "rows, [tokens, hidden]; flatten it with x.view(-1, x.shape[-1])")
            check_rows(hidden, rows, "the stack input", "ForwardBatch.num_tokens is",
                       "give one row per token of this rank's batch (num_tokens counts them)")
        if forward_batch is not None:
            entry.rows.check_stack_rows(plan, forward_batch)
        if capture is not None:
            capture(hidden, owned=False)  # the residual aliases the model's own input
        x, residual, upd = enter_read(read, hidden)
    else:
        stream.expect(hidden, plan.name)
        residual = stream.residual
        assert residual is not None
        x, upd = reread(read, residual)
        if capture is not None:
            capture(residual, owned=entry.capture_owned)
    stream.write(residual)
    stream.borrowed = state is StreamState.INITIAL and aliases(residual, hidden)
    stream.next_update = upd
    if collector is not None:
        # At stack entry the residual is the model's own input tensor: never owned.
        collector.capture(residual, owned=entry.capture_owned and state is not StreamState.INITIAL)
    return x
