"""Per-forward residual state and ownership of outstanding work.

========  ==================================  ===============================================
State     Stored                              Next preparation
========  ==================================  ===============================================
INITIAL   nothing                             start the residual through the read's ``enter``
WRITTEN   residual, no contribution           read the residual, apply nothing
PENDING   contribution (+ residual if any)    complete owed work, apply the update, then read
========  ==================================  ===============================================

The model passes back exactly the object the last boundary call returned (``handle``); anything
else is refused, because a rebound or foreign output would apply the wrong pending work. A
contribution is dropped the moment it is consumed, so its tensors are freed and stale handles
fail.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any, Optional, Protocol, Union

import torch

from .._contracts import Owed
from .._errors import START_FIRST, BoundaryError, add_note, foreign_output, notes_of
from .._output import Contribution, HandoffOutput, OutputTransform, OwedOutput, UnreducedOutput
from . import StageUpdate
from ._add_norm import PLAIN_ADD
from ._rows import WHOLE_ROWS, ResidualRows

__all__ = ["StreamState", "ResidualStream", "Handle", "HoldsStream", "start", "started_stream"]

Handle = Union[torch.Tensor, OwedOutput]


class StreamState(enum.Enum):
    INITIAL = "initial"
    WRITTEN = "written"
    PENDING = "pending"


class ResidualStream:
    """Residual and pending contribution of one forward (or one microbatch of it)."""

    __slots__ = ("residual", "pending", "handle", "released", "next_update", "dp_rows", "rows",
                 "branches", "borrowed", "__weakref__")

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None
        self.pending: Optional[Contribution] = None
        # The object the model must pass to the next boundary call; None right after a read,
        # when the model holds a compute input rather than a layer output.
        self.handle: Optional[Handle] = None
        self.released = False
        # The update the current stage's output will carry, when its read made one.
        self.next_update: Optional[StageUpdate] = None
        # Attention-DP row counts of this batch (built on first use; see dp.dp_rows).
        self.dp_rows: Any = None
        # Which rows the residual lives on (see residual._rows): the model's own until the first
        # prepare() of an input-scattered batch sets that batch's slices (scatter.scatter_rows).
        self.rows: ResidualRows = WHOLE_ROWS
        # Branch outputs set aside and not merged yet (see adapters.branch).
        self.branches: tuple[Any, ...] = ()
        # True while the residual is (a view of) the stack's input tensor: the model's own, which
        # an in-place kernel must not overwrite (see writable_residual).
        self.borrowed = False

    @property
    def state(self) -> StreamState:
        if self.pending is not None:
            return StreamState.PENDING
        if self.residual is not None:
            return StreamState.WRITTEN
        return StreamState.INITIAL

    # -- transitions -------------------------------------------------------------------------

    def leave(self, output: UnreducedOutput) -> Handle:
        """Take ownership of a producer output; return the handle the model keeps.

        The handle is the tensor itself when nothing is owed, otherwise an opaque ``OwedOutput``.
        """
        return self.leave_parts(output.value, output.update, output.owed, output.transform)

    def leave_parts(
        self,
        value: Union[torch.Tensor, HandoffOutput],
        update: StageUpdate,
        owed: tuple[Owed, ...] = (),
        transform: Optional[OutputTransform] = None,
    ) -> Handle:
        """``leave()`` without building the intermediate ``UnreducedOutput`` (the hot path)."""
        if self.pending is not None or self.handle is not None:
            self.check_free()
        self.pending = Contribution(value, update, owed, transform)
        if owed or isinstance(value, HandoffOutput):
            handle: Handle = OwedOutput(self, owed)
        else:
            handle = value
        self.handle = handle
        return handle

    def check_free(self) -> None:
        """Refuse a new producer output while an earlier one is still outstanding."""
        if self.pending is not None:
            raise BoundaryError(
                f"a contribution is already pending ({self.pending!r}); only one can be pending at "
                "a time. Pass the previous layer output through the next boundary's prepare() "
                "before finishing another stage"
            )
        if self.handle is not None:
            err = BoundaryError(
                "finish() was called while the stream still holds an unconsumed layer output; "
                "call the stage's prepare() on that output before finishing this stage"
            )
            raise err

    def _hand_out(self, contribution: Contribution) -> Handle:
        if contribution.owed or isinstance(contribution.value, HandoffOutput):
            owed = contribution.owed
            handle: Handle = OwedOutput(self, owed)
        else:
            handle = contribution.value
        self.handle = handle
        return handle

    def rehand(self) -> Handle:
        """Issue a fresh handle after the pending contribution changed (old handles go stale)."""
        assert self.pending is not None
        return self._hand_out(self.pending)

    def consume(self) -> Contribution:
        """Remove and return the pending contribution (the caller completes and applies it)."""
        assert self.pending is not None
        c, self.pending = self.pending, None
        self.handle = None
        return c

    def write(self, residual: torch.Tensor, handle: Optional[Handle] = None) -> None:
        """Enter the written state; any pending contribution is released."""
        self.pending = None
        self.residual = residual
        self.handle = handle
        self.borrowed = False

    def writable_residual(self, read: Any = None, *, fused: bool = False) -> Optional[torch.Tensor]:
        """The residual to hand ``read``'s update (or, ``fused``, a fused candidate, which writes
        it in place): a copy while it is still the stack's input and the writer works in place (a
        read that does not say is taken to). The entry aliases the model's input rather than
        copying it, so the copy is paid once a forward, and only where an in-place kernel follows;
        past the entry this is one flag test a layer."""
        r = self.residual
        if self.borrowed and r is not None and (fused or getattr(read, "residual_in_place", True)):
            r = self.residual = r.clone()
            self.borrowed = False
        return r

    def release(self) -> None:
        """Drop every tensor; later use of this stream reports that the stack was not started."""
        self.residual = None
        self.pending = None
        self.handle = None
        self.next_update = None
        self.dp_rows = None
        self.rows = WHOLE_ROWS
        self.branches = ()
        self.released = True

    # -- checks ------------------------------------------------------------------------------

    def expect(self, hidden: Any, stage: str = "") -> None:
        """Refuse anything but the object the last boundary call handed out; ``stage`` (the
        preparing stage's name) leads the reason, formatted only when refusing."""
        if hidden is self.handle and hidden is not None:
            return
        try:
            self._refuse(hidden)
        except BoundaryError as e:
            if stage:
                notes = notes_of(e)
                notes[-1] = f"{stage} prepare(): {notes[-1]}"
            raise

    def _refuse(self, hidden: Any) -> None:
        if isinstance(hidden, OwedOutput) and hidden._stream is not self:
            raise foreign_output(
                "this handle was produced by a different ResidualStream (another microbatch or "
                "another forward); pass each microbatch's output only to its own stream"
            )
        if self.handle is None:
            if self.state is StreamState.INITIAL:
                why = "the stream holds no layer output yet; call a stage's prepare() first"
            else:
                why = (
                    "the stream holds no layer output: the last call was a read (prepare). "
                    "Call the stage's finish() or exit().finish() on the compute output first"
                )
            raise foreign_output(why)
        kind = type(hidden).__name__
        raise foreign_output(
            f"got a {kind} that is not the object the last boundary call returned (a stale handle, "
            "a rebound tensor or another stream's output); keep the returned value and pass it on "
            "unchanged, and use residual_batch.add_to_output() for extra contributions"
        )

    # -- construction of a stream in a given state ---------------------------------------------

    @classmethod
    def arrive(
        cls,
        *,
        residual: Optional[torch.Tensor] = None,
        output: Optional[Union[torch.Tensor, HandoffOutput]] = None,
        update: Optional[StageUpdate] = None,
        owed: tuple[Owed, ...] = (),
        transform: Optional[OutputTransform] = None,
    ) -> tuple["ResidualStream", Optional[Handle]]:
        """A stream that arrives already written (``residual`` only) or pending (``output``).

        Used to split a batch into microbatches and to rebuild a stream received from another
        pipeline stage. Returns the stream and the handle to pass to its next boundary call
        (``None`` for an initial stream).
        """
        stream = cls()
        if output is None:
            if owed or transform is not None:
                raise ValueError("owed work or a transform needs an output to apply to")
            if residual is not None:
                stream.write(residual, residual)
            return stream, stream.handle
        if update is None:
            update = PLAIN_ADD
        stream.residual = residual
        return stream, stream.leave(UnreducedOutput(output, update, owed, transform))

    def __repr__(self) -> str:
        if self.released:
            return "ResidualStream(released)"
        return f"ResidualStream({self.state.value}, pending={self.pending!r})"


class HoldsStream(Protocol):
    """What the stream needs of the engine's batch object: the attribute the boundary owns.
    ``layer_boundary.ForwardBatchLike`` has it; declared here so that this module stays below the
    batch protocol, which names ``ResidualStream``."""

    residual_stream: Optional[ResidualStream]


def started_stream(forward_batch: HoldsStream) -> ResidualStream:
    """The batch's live stream, or the spec's error when the stack was not started."""
    stream = getattr(forward_batch, "residual_stream", None)
    if stream is None or stream.released:
        err = BoundaryError(START_FIRST)
        if stream is not None:
            add_note(err, "this batch's layer stack already ended (its final norm ran); a new forward "
                     "starts with residual_batch.start(forward_batch)")
        raise err
    return stream


def start(forward_batch: HoldsStream) -> ResidualStream:
    """Give the batch a fresh (initial) stream; any earlier stream of the batch is released."""
    old = getattr(forward_batch, "residual_stream", None)
    if old is not None:
        if not old.released and old.state is not StreamState.INITIAL:
            # The one place a forward that never left the stack shows: a model that normalized
            # the last layer's output itself (not residual_batch.norm) lost the last residual add.
            warnings.warn(
                f"residual_batch.start(): this batch's previous forward never left the layer stack "
                f"(its stream is {old.state.value}); leave it through residual_batch.norm(), to_pp() or "
                "take_output(), which complete the last layer's residual update. The old stream is dropped",
                stacklevel=2)
        old.release()
    stream = ResidualStream()
    try:
        forward_batch.residual_stream = stream
    except AttributeError as e:
        raise TypeError(
            f"{type(forward_batch).__name__} has no settable residual_stream attribute; the "
            "boundary owns that attribute of the engine's batch object (see ForwardBatchLike)"
        ) from e
    return stream
