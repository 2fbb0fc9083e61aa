"""The model-facing :class:`StageBoundary`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ._adapters.branch import branch_input, check_entry
from ._adapters.lora import InputRows, input_rows
from ._contracts import ProducerReduction, StageKind
from ._errors import BRANCH_ENTRY, SNAPSHOT_PLAIN, BoundaryError, no_path
from ._exit import FfnExit, MixerExit
from ._forward import ForwardBatchLike, active_variant
from ._pp import from_pp
from ._publish import publish
from .residual._add_norm import explain_width
from .residual._stream import Handle, ResidualStream, StreamState, started_stream

if TYPE_CHECKING:
    from ._construction import EntryPath, ExitPath, StagePlan
    from ._capture import CaptureCallback, CaptureCollector
    from ._declarations import StageDeclaration
    from ._layout import BatchVariant

__all__ = ["StageBoundary"]


class StageBoundary:
    """Input preparation and output publication of one stage.

    Attention (PARTIAL)::

        x = boundary.prepare(hidden_states, forward_batch)
        hidden_states = boundary.finish(attn(x), forward_batch)

    FFN or single-stage mixer (SCOPED)::

        x = boundary.prepare(hidden_states, forward_batch)
        with boundary.exit(forward_batch) as output:
            y = mlp(x)
        hidden_states = output.finish(y)
    """

    __slots__ = ("plan", "_entries", "_exits", "_is_attn", "_scoped", "_prepared", "_exit_cls")

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self._entries = plan.entries
        self._exits = plan.exits
        self._is_attn = plan.declaration.kind is StageKind.ATTN
        self._scoped = plan.declaration.reduction is not ProducerReduction.PARTIAL
        self._prepared = plan.declaration.prepared_from is not None
        self._exit_cls = MixerExit if self._is_attn else FfnExit

    @property
    def declaration(self) -> StageDeclaration:
        return self.plan.declaration

    def _entry(self, forward_batch: ForwardBatchLike, stream: Optional[ResidualStream] = None) -> EntryPath:
        variant = _variant(forward_batch, stream)
        path = self._entries.get(variant)
        if path is None:
            raise no_path(variant.name, self.plan.name, self.plan.refusals.get(variant))
        return path

    def _exit_path(self, forward_batch: ForwardBatchLike, stream: Optional[ResidualStream] = None) -> ExitPath:
        variant = _variant(forward_batch, stream)
        path = self._exits.get(variant)
        if path is None:
            raise no_path(variant.name, self.plan.name, self.plan.refusals.get(variant))
        return path

    def prepare(
        self,
        hidden_states: Handle,
        forward_batch: ForwardBatchLike,
        *,
        capture_output: Optional[CaptureCallback] = None,
        captured_last_layer_outputs: Optional[CaptureCollector] = None,
    ) -> torch.Tensor:
        """Complete owed work, apply the producer's update and read this stage's input.

        ``capture_output(value, owned=...)`` (attention only) receives the updated residual;
        ``captured_last_layer_outputs`` (attention only) collects it on the compute-input rows.
        """
        # The per-layer calls read the stream and the variant's path inline (one dict lookup);
        # started_stream and _entry raise the spec's errors when the fast test fails.
        stream = getattr(forward_batch, "residual_stream", None)
        if stream is None or stream.released:
            stream = started_stream(forward_batch)
        if self._prepared:
            raise BoundaryError(BRANCH_ENTRY)
        if stream.branches:  # a branch output is set aside: only the branch's stages may read
            check_entry(self, stream)
        if not self._is_attn and (capture_output is not None or captured_last_layer_outputs is not None):
            raise TypeError(
                "FFN prepare() does not accept capture_output/captured_last_layer_outputs; capture "
                "at the attention stage's prepare() or at residual_batch.norm()"
            )
        entry = self._entries.get(active_variant(forward_batch))
        if entry is None:
            entry = self._entry(forward_batch, stream)
        try:
            return entry.rows.enter(self.plan, entry, stream, hidden_states, capture_output,
                                    captured_last_layer_outputs, forward_batch)
        except RuntimeError as e:
            if isinstance(hidden_states, torch.Tensor) and not isinstance(e, BoundaryError):
                explain_width(self.plan.name, self.plan.read, hidden_states, e)
            raise

    def branch_input(self, source: StageBoundary, hidden_states: torch.Tensor,
                     forward_batch: ForwardBatchLike) -> torch.Tensor:
        """Enter a ``prepared_from`` stage: ``source``'s prepared input (what its ``prepare()``
        returned) on this stage's compute rows, without reading the residual again; the residual
        passes to this branch. See ``layer_boundary._adapters.branch``."""
        return branch_input(self, source, hidden_states, forward_batch)

    def finish(self, hidden_states: torch.Tensor, forward_batch: ForwardBatchLike) -> Handle:
        """Register a PARTIAL attention's contribution; return the handle the model keeps."""
        stream = getattr(forward_batch, "residual_stream", None)
        if stream is None or stream.released:
            stream = started_stream(forward_batch)
        if self._scoped:
            raise BoundaryError(
                f"{self.plan.name} stage is {self.plan.declaration.reduction.name}: publish its "
                "output with `with boundary.exit(forward_batch) as output: ...` and then "
                "`output.finish(hidden_states)`"
            )
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"finish() takes the attention output tensor, got {type(hidden_states).__name__}"
            )
        path = self._exits.get(active_variant(forward_batch))
        if path is None:
            path = self._exit_path(forward_batch, stream)
        return publish(self.plan, stream, hidden_states, path.static_owed)

    def exit(self, forward_batch: ForwardBatchLike) -> FfnExit | MixerExit:
        """Decide this batch's output completion; use as a context manager around compute."""
        stream = getattr(forward_batch, "residual_stream", None)
        if stream is None or stream.released:
            stream = started_stream(forward_batch)
        if not self._scoped:
            raise BoundaryError(
                "this attention stage is PARTIAL: its compute always returns an unreduced "
                "contribution; call boundary.finish(hidden_states, forward_batch) instead of exit()"
            )
        path = self._exits.get(active_variant(forward_batch))
        if path is None:
            path = self._exit_path(forward_batch, stream)
        return self._exit_cls(self.plan, path, stream, forward_batch)

    def postprocess(self, hidden_states: torch.Tensor, forward_batch: ForwardBatchLike) -> Handle:
        """Publish a fully reduced output computed without an exit scope (operation-scheduled
        two-batch overlap): apply the output transform, return rows to the handoff layout and
        leave nothing owed."""
        stream = started_stream(forward_batch)
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"postprocess() takes a tensor, got {type(hidden_states).__name__}")
        path = self._exit_path(forward_batch)
        transform = self.plan.declaration.output_transform
        value = transform.fn(hidden_states) if transform is not None else hidden_states
        value = path.rows.postprocess(self.plan, stream, forward_batch, value)
        return publish(self.plan, stream, value, (), transformed=True)

    def from_pp(self, tensors: dict[str, torch.Tensor], forward_batch: ForwardBatchLike) -> Handle:
        """Rebuild the batch's stream from what the previous pipeline stage's ``to_pp()`` sent.

        Call on the first local boundary of a non-first pipeline stage; pass the returned handle
        to its ``prepare()``. A statically declared partial sum arrives pending, owed over this
        boundary's own group, and exactly when ``previous`` declares a producer that leaves one;
        anything else is refused before any collective runs.
        """
        if self._prepared:
            raise BoundaryError(BRANCH_ENTRY)
        return from_pp(self.plan, self._entry, tensors, forward_batch)

    def capture_output(self, hidden_states: Handle, forward_batch: ForwardBatchLike) -> tuple[Handle, torch.Tensor]:
        """``(handle, snapshot)``: dynamic owed work is completed on the main output (a fresh
        handle); a statically declared sum is computed on a copy for the snapshot only."""
        stream = started_stream(forward_batch)
        stream.expect(hidden_states)
        self._entry(forward_batch)
        rows = stream.rows
        if stream.state is StreamState.WRITTEN:
            assert stream.residual is not None
            return hidden_states, rows.model_copy(stream.residual)
        c = stream.pending
        assert c is not None
        if c.is_handoff:
            raise BoundaryError(
                "capture_output() cannot snapshot a finalize handoff; producer-specific handoffs "
                "need an explicit main-output capture adapter (or complete_output() first)"
            )
        if not c.update.plain_add:
            raise BoundaryError(SNAPSHOT_PLAIN)
        handle = hidden_states
        dynamic = [o for o in c.owed if not o.static]
        if dynamic:
            rows.complete_dynamic_sums(c, dynamic)
            handle = stream.rehand()
        snap = c.update.apply(stream.residual, rows.completed_copy(c))
        # On the rows the model sees; a copy unless the add made a fresh tensor.
        return handle, rows.model_copy(snap, fresh=snap is not c.value)

    def input_rows(self, forward_batch: ForwardBatchLike) -> InputRows:
        """The rows this stage's compute input lives on for this batch (the LoRA adapter hook:
        see ``layer_boundary._adapters.lora``). Host-side only; no collective runs."""
        return input_rows(self, forward_batch)

    def __repr__(self) -> str:
        return f"StageBoundary({self.plan.describe()})"


def _variant(forward_batch: ForwardBatchLike, stream: Optional[ResidualStream]) -> BatchVariant:
    # Read on every call, not cached per stream: an output made in one variant must not be
    # consumed in another (a flag flipped mid-forward raises instead of moving the wrong rows).
    return active_variant(forward_batch)
