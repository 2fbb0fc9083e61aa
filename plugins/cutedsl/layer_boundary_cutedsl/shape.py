"""How the CuTe DSL kernel lays a row over a CTA. Light (no ``cutlass``, no torch), so refusals
are decided without importing the DSL."""

from __future__ import annotations

from typing import Optional

__all__ = ["VEC", "MAX_PER_THREAD", "launch_shape"]

VEC = 8  # 16-bit elements in one 128-bit access
MAX_PER_THREAD = 16
_THREADS = (256, 128, 64, 32)


def launch_shape(hidden: int) -> Optional[tuple[int, int]]:
    """``(threads, vectors per thread)`` for a row of ``hidden`` elements, or ``None`` when the
    row does not split into whole 128-bit vectors over full warps (hidden a multiple of 256) or
    would not fit in registers."""
    if hidden <= 0 or hidden % (VEC * 32):
        return None
    vectors = hidden // VEC
    for threads in _THREADS:
        # The largest block that divides the row evenly: no predicated tail, no idle lanes.
        if vectors % threads == 0 and vectors // threads <= MAX_PER_THREAD:
            return threads, vectors // threads
    return None
