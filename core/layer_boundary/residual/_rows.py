"""Which rows a stream's tensors live on, for the helpers that hand values to the model.

In the ordinary and attention-DP variants the residual, a pending contribution once complete, and
every value the model sees share one row set: this DP group's rows ``[T_d, H]``. In the
input-scattered variant the residual holds a slice ``[S, H]`` of those rows per attention-TP rank
(see ``layer_boundary._scatter.ScatterRows``), a complete contribution lands on that slice, and the
model still sees the group's rows. These helpers keep that split in one place:

=========================  ==================================  =============================
helper                     ordinary / attention DP             input-scattered
=========================  ==================================  =============================
``complete_on_rows``       ``complete(c)``                     sum reduce-scattered to slice
``completed_copy_on_rows`` ``completed_copy(c)``               same, on a copy
``to_model_rows``          identity                            all-gather over attention TP
``to_stream_rows``         identity                            this rank's slice (a copy)
=========================  ==================================  =============================
"""

from __future__ import annotations

from typing import Any

import torch

from .._output import Contribution
from .._scatter import complete_scattered
from ._access import complete, completed_copy

__all__ = ["complete_on_rows", "completed_copy_on_rows", "to_model_rows", "to_stream_rows", "scattered"]


def scattered(stream: Any) -> bool:
    return stream.scatter_rows is not None


def complete_on_rows(stream: Any, c: Contribution) -> torch.Tensor:
    """Run ``c``'s owed work so its value lands on the residual's rows."""
    rows = stream.scatter_rows
    if rows is None:
        return complete(c)
    return complete_scattered(c, rows)


def completed_copy_on_rows(stream: Any, c: Contribution) -> torch.Tensor:
    """``complete_on_rows`` computed on a copy; ``c`` and its owed work stay as they were."""
    rows = stream.scatter_rows
    if rows is None:
        return completed_copy(c)
    assert isinstance(c.value, torch.Tensor), "callers refuse handoffs before copying"
    return complete_scattered(Contribution(c.value.clone(), c.update, c.owed, c.transform), rows)


def to_model_rows(stream: Any, value: torch.Tensor) -> torch.Tensor:
    """A residual-rows tensor on the rows the model sees (a fresh tensor when rows moved)."""
    rows = stream.scatter_rows
    return value if rows is None else rows.gather_group(value)


def to_stream_rows(stream: Any, value: torch.Tensor) -> torch.Tensor:
    """A model-rows tensor on the residual's rows (never a view of ``value`` when rows moved)."""
    rows = stream.scatter_rows
    if rows is None:
        return value
    if value.shape[0] != rows.local:
        raise ValueError(
            f"got {value.shape[0]} rows but this input-scattered batch's DP group has {rows.local}; "
            "give one row per token of the group (the rows the layer stack started with)"
        )
    return rows.my_slice(value).clone()
