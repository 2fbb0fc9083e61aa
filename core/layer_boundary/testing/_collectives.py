"""A guard for the kit's "decline before any collective" checks: shared by the fusion and the
finalize conformance classes (one module below both, so neither imports the other for it)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist

__all__ = ["no_collectives"]

_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
                "reduce_scatter", "broadcast", "all_to_all_single", "send", "recv")


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Any torch.distributed collective started inside raises."""
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a collective started before the candidate declined")

    try:
        for n in saved:
            setattr(dist, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
