"""The model-facing :class:`StageBoundary`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .construction import EntryPath, ExitPath, StagePlan
from .contracts import ProducerReduction, StageKind
from .errors import BRANCH_ENTRY, SNAPSHOT_PLAIN, BoundaryError, no_path
from .exit import FfnExit, MixerExit
from .forward import active_variant
from .ops import all_reduce
from .prepare import publish, run_entry
from .residual.access import completed_copy
from .residual.stream import Handle, StreamState, started_stream

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

    __slots__ = ("plan", "_entries", "_exits", "_is_attn", "_scoped", "_prepared")

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self._entries = plan.entries
        self._exits = plan.exits
        self._is_attn = plan.declaration.kind is StageKind.ATTN
        self._scoped = plan.declaration.reduction is not ProducerReduction.PARTIAL
        self._prepared = plan.declaration.prepared_from is not None

    @property
    def declaration(self) -> Any:
        return self.plan.declaration

    def _entry(self, forward_batch: Any, stream: Any = None) -> EntryPath:
        variant = _variant(forward_batch, stream)
        path = self._entries.get(variant)
        if path is None:
            raise no_path(variant.name, self.plan.name)
        return path

    def _exit_path(self, forward_batch: Any, stream: Any = None) -> ExitPath:
        variant = _variant(forward_batch, stream)
        path = self._exits.get(variant)
        if path is None:
            raise no_path(variant.name, self.plan.name)
        return path

    def prepare(
        self,
        hidden_states: Any,
        forward_batch: Any,
        *,
        capture_output: Optional[Callable[..., Any]] = None,
        captured_last_layer_outputs: Any = None,
    ) -> torch.Tensor:
        """Complete owed work, apply the producer's update and read this stage's input.

        ``capture_output(value, owned=...)`` (attention only) receives the updated residual;
        ``captured_last_layer_outputs`` (attention only) collects it on the compute-input rows.
        """
        stream = started_stream(forward_batch)
        if self._prepared:
            raise BoundaryError(BRANCH_ENTRY)
        if not self._is_attn and (capture_output is not None or captured_last_layer_outputs is not None):
            raise TypeError(
                "FFN prepare() does not accept capture_output/captured_last_layer_outputs; capture "
                "at the attention stage's prepare() or at residual_batch.norm()"
            )
        return run_entry(
            self.plan, self._entry(forward_batch, stream), stream, hidden_states,
            capture_output, captured_last_layer_outputs, forward_batch,
        )

    def finish(self, hidden_states: torch.Tensor, forward_batch: Any) -> Handle:
        """Register a PARTIAL attention's contribution; return the handle the model keeps."""
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
        path = self._exit_path(forward_batch, stream)
        return publish(self.plan, stream, hidden_states, path.static_owed)

    def exit(self, forward_batch: Any) -> FfnExit | MixerExit:
        """Decide this batch's output completion; use as a context manager around compute."""
        stream = started_stream(forward_batch)
        if not self._scoped:
            raise BoundaryError(
                "this attention stage is PARTIAL: its compute always returns an unreduced "
                "contribution; call boundary.finish(hidden_states, forward_batch) instead of exit()"
            )
        path = self._exit_path(forward_batch, stream)
        cls = FfnExit if not self._is_attn else MixerExit
        return cls(self.plan, path, stream, forward_batch)

    def postprocess(self, hidden_states: torch.Tensor, forward_batch: Any) -> Handle:
        """Publish a fully reduced output computed without an exit scope (operation-scheduled
        two-batch overlap): apply the output transform, return rows to the handoff layout and
        leave nothing owed."""
        stream = started_stream(forward_batch)
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"postprocess() takes a tensor, got {type(hidden_states).__name__}")
        path = self._exit_path(forward_batch)
        transform = self.plan.declaration.output_transform
        value = transform.fn(hidden_states) if transform is not None else hidden_states
        if path.scatter_return:  # fully reduced on every group's rows: keep this rank's slice
            from .prepare import scatter_rows

            rows = scatter_rows(stream, self.plan, forward_batch)
            value = rows.my_slice(value[rows.offsets[rows.d] : rows.offsets[rows.d + 1]])
        elif path.dp_returns:  # fully reduced on every group's rows: keep this group's
            from .prepare import dp_rows

            value = dp_rows(stream, self.plan, forward_batch).take_local(value)
        return publish(self.plan, stream, value, (), transformed=True)

    def capture_output(self, hidden_states: Any, forward_batch: Any) -> tuple[Handle, torch.Tensor]:
        """``(handle, snapshot)``: dynamic owed work is completed on the main output (a fresh
        handle); a statically declared sum is computed on a copy for the snapshot only."""
        stream = started_stream(forward_batch)
        stream.expect(hidden_states)
        self._entry(forward_batch)
        if stream.state is StreamState.WRITTEN:
            assert stream.residual is not None
            return hidden_states, stream.residual.clone()
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
            for o in dynamic:
                assert o.group is not None
                c.value = all_reduce(c.value, o.group)  # type: ignore[arg-type]
            c.owed = tuple(o for o in c.owed if o.static)
            handle = stream.rehand()
        snap = c.update.apply(stream.residual, completed_copy(c))
        if snap is c.value:
            snap = snap.clone()
        return handle, snap

    def __repr__(self) -> str:
        return f"StageBoundary({self.plan.describe()})"


def _variant(forward_batch: Any, stream: Any) -> Any:
    # Read on every call, not cached per stream: an output made in one variant must not be
    # consumed in another (a flag flipped mid-forward raises instead of moving the wrong rows).
    return active_variant(forward_batch)
