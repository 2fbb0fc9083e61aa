"""``ResidualRows``: which rows a stream's tensors live on, one object per stream.

In the ordinary, attention-DP and CP variants the residual, a pending contribution once complete,
and every value the model sees share one row set: this DP group's rows ``[T_d, H]``. In the
input-scattered and sequence-parallel variants the residual holds a slice ``[S, H]`` of those rows
per attention-TP rank, a complete contribution lands on that slice, and the model still sees the
group's rows. A stream starts with ``WHOLE_ROWS`` (the one instance of this class); the first
prepare() of an input-scattered batch replaces it with that batch's
``layer_boundary._scatter.ScatterRows``, which overrides every method below. Callers (the batch
helpers, publish, pipeline handoff, two-batch overlap, ``capture_output``) call the methods and
never ask which rows they hold.

============================  ===================================  ============================================
method                        whole rows (``WHOLE_ROWS``)          input-scattered (``ScatterRows``)
============================  ===================================  ============================================
``complete(c)``               ``complete(c)``                      attention-TP sum reduce-scattered to slice
``completed_copy(c)``         ``completed_copy(c)``                the same, on a copy
``complete_dynamic_sums``     all-reduce the dynamic sums          ``complete(c)`` (its one sum)
``to_model(x)``               identity                             all-gather over attention TP
``to_stream(x)``              identity                             this rank's slice (a copy, checked)
``cut(x)``                    identity                             this rank's slice of the group's rows
``model_copy(x, fresh)``      ``x`` if ``fresh``, else a clone     all-gather (allocates)
``check_output_shape``        refuses (the shapes must agree)      nothing (outputs sit on group rows)
``check_leaves_pp()``         nothing                              refuses: a slice does not cross stages
``fusable_handoff(c)``        the finalize handoff, if fusable     ``None`` (the fused finalize is whole-row)
``for_batch(fb)``             itself                               the rows of ``fb`` (a microbatch's)
============================  ===================================  ============================================

``sliced``: the residual holds a slice of the model's rows (no row range of it is a microbatch's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _ops as ops
from .._contracts import Owed
from .._output import Contribution, HandoffOutput, fusable_handoff
from ._access import check_shape, complete, completed_copy

__all__ = ["ResidualRows", "WHOLE_ROWS"]


class ResidualRows:
    """The residual lives on the rows the model sees: every move is the identity."""

    __slots__ = ()

    sliced = False

    def complete(self, c: Contribution) -> torch.Tensor:
        """Run ``c``'s owed work so its value lands on the residual's rows."""
        return complete(c)

    def completed_copy(self, c: Contribution) -> torch.Tensor:
        """``complete`` computed on a copy; ``c`` and its owed work stay as they were."""
        return completed_copy(c)

    def complete_dynamic_sums(self, c: Contribution, dynamic: list[Owed]) -> None:
        """Run the sums an exit deferred for this batch (``dynamic``, not static ones) on ``c``
        in place; a statically declared sum stays owed."""
        for o in dynamic:
            assert o.group is not None and isinstance(c.value, torch.Tensor)
            c.value = ops.all_reduce(c.value, o.group)
        c.owed = tuple(o for o in c.owed if o.static)

    def to_model(self, value: torch.Tensor) -> torch.Tensor:
        """A residual-rows tensor on the rows the model sees (a fresh tensor when rows move)."""
        return value

    def to_stream(self, value: torch.Tensor) -> torch.Tensor:
        """A model-rows tensor on the residual's rows (never a view of ``value`` when rows move)."""
        return value

    def cut(self, value: torch.Tensor) -> torch.Tensor:
        """The residual's rows of a tensor on the model's rows (a view where one serves)."""
        return value

    def model_copy(self, value: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
        """An owned tensor on the model's rows; ``fresh``: ``value`` is already one of its own."""
        return value if fresh else value.clone()

    def check_output_shape(self, what: str, value: torch.Tensor, residual: torch.Tensor) -> None:
        """Called when a plain-add output's shape differs from the residual's."""
        check_shape(what, value, residual)

    def check_leaves_pp(self) -> None:
        """Refuse, before anything is sent, rows that cannot cross a pipeline stage."""

    def fusable_handoff(self, c: Contribution) -> Optional[HandoffOutput]:
        """The finalize handoff a fused final norm may take from ``c``, if any."""
        return fusable_handoff(c)

    def for_batch(self, forward_batch: Any) -> ResidualRows:
        """These rows for another batch of the same forward (a microbatch, or the merged batch)."""
        return self

    def __repr__(self) -> str:
        return "WHOLE_ROWS"


WHOLE_ROWS = ResidualRows()
