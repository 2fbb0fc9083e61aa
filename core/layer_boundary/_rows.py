"""Row checks and the row-move helper every batch variant shares.

The moves themselves live with their variant, behind ``batch_rows.BatchRows``: attention DP in
``dp``, input-scattered and sequence parallel in ``scatter``, context parallel in ``cp``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ._quant import QuantizedRows
from ._topology import Topology

__all__ = ["check_rows", "move_input", "check_counts_agree", "ENV_CHECK_DP_COUNTS"]

# On: every batch's dp_num_tokens is compared across the TP group before its first row move (a
# gather and a host sync a batch, so off by default). Ranks that disagree otherwise fail inside
# the collective (gloo aborts on mismatched sizes) or, worse, move the wrong rows.
ENV_CHECK_DP_COUNTS = "LAYER_BOUNDARY_CHECK_DP_COUNTS"
_CHECKING: list[bool] = []  # the variable, read once a process (not on every forward)


def _checking() -> bool:
    if not _CHECKING:
        import os

        from ._plugins.discovery import _truthy

        _CHECKING.append(_truthy(os.environ.get(ENV_CHECK_DP_COUNTS), ENV_CHECK_DP_COUNTS))
    return _CHECKING[0]


def check_counts_agree(counts: Sequence[int], topology: Topology, *, dp: bool = True) -> None:
    """With ``LAYER_BOUNDARY_CHECK_DP_COUNTS`` on (read once a process), raise ``BoundaryError`` on
    every rank of the TP group unless all of them give this batch the same ``dp_num_tokens``
    (``dp=False``: the same ``num_tokens``, which every rank of a TP group without attention DP
    computes on: ranks given different batches otherwise abort in gloo or hang in NCCL)."""
    tp = topology.tp
    if tp.size == 1 or not _checking():
        return
    from ._errors import BoundaryError
    from ._ops import gather_objects

    mine = tuple(int(c) for c in counts)
    every = gather_objects(mine, tp.group)
    for rank, theirs in zip(tp.ranks, every):
        if theirs != mine and not dp:
            raise BoundaryError(
                f"ForwardBatch.num_tokens disagrees across the TP group: rank {tp.ranks[tp.rank]} has {mine[0]}, "
                f"rank {rank} has {theirs[0]}; without attention DP every rank of a TP group runs the same "
                f"batch (its rows, in the same order) ({ENV_CHECK_DP_COUNTS} found this)"
            )
        if theirs != mine:
            raise BoundaryError(
                f"ForwardBatch.dp_num_tokens disagrees across the TP group: rank {tp.ranks[tp.rank]} has {mine}, "
                f"rank {rank} has {theirs}; every rank must give every DP group's row count, in DP-rank "
                f"order, the same ({ENV_CHECK_DP_COUNTS} found this)"
            )


def check_rows(x: torch.Tensor, expected: int, what: str, source: str, fix: str) -> None:
    """A row-count check before a row move: wrong rows otherwise fail inside the collective (as
    torch's copy error, or a size mismatch on the other ranks) or, where the move pads, are
    silently zero-padded or cut. Trailing dimensions are the caller's (an MHC stream is
    [tokens, n, hidden])."""
    if x.shape[0] == expected:
        return
    from ._errors import BoundaryError

    # A [batch, seq, hidden] tensor (transformers' layout) runs unnoticed on one rank and reaches
    # the first row move as "1 rows": name its shape and the fix.
    hint = (f" (shape {tuple(x.shape)}: boundaries move token rows, [tokens, hidden]; flatten a "
            "[batch, seq, hidden] tensor with x.view(-1, x.shape[-1]))"
            if x.dim() > 2 and x.shape[:-1].numel() == expected else "")
    raise BoundaryError(f"{what} has {x.shape[0]} rows{hint}, but {source} {expected}: {fix}")


def move_input(move: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """Apply a row move to a stage input: a tensor, or a quantized input's codes and scales.

    FP8 codes travel as bytes: gathers only copy them, and not every backend knows the dtype.
    """
    if isinstance(x, QuantizedRows):
        data = move(x.data.view(torch.uint8)).view(x.data.dtype)
        return QuantizedRows(data, move(x.scale))
    return move(x)
